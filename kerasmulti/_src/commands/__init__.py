"""The `kerasmulti` command: demo, devices, predict, launch."""
