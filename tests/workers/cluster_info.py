"""Prints what TF_CONFIG says about this worker; optional failures, a hang and a noisy stop for the launcher tests."""

import json
import os
import signal
import sys
import time

config = json.loads(os.environ["TF_CONFIG"])
index = config["task"]["index"]
print(f"index={index} workers={len(config['cluster']['worker'])} "
      f"devices={os.environ.get('KERASMULTI_SIMULATE_DEVICES')} "
      f"gpus={os.environ.get('CUDA_VISIBLE_DEVICES')} args={sys.argv[1:]}", flush=True)
if "noisy-0" in sys.argv and index == 0:
    def noisy_stop(signum, frame):  # as a training interrupted mid-step: a long traceback
        for line in range(40):
            print(f"stopping, line {line}", flush=True)
        sys.exit(1)

    signal.signal(signal.SIGTERM, noisy_stop)
if "fail-1" in sys.argv and index == 1:
    sys.exit(3)
if "raise-1" in sys.argv and index == 1:
    time.sleep(1)  # worker 0 has set its handler
    raise RuntimeError("worker 1's own failure")
if "kill-1" in sys.argv and index == 1 or "kill-0" in sys.argv and index == 0:
    os.kill(os.getpid(), signal.SIGKILL)
if "hang-0" in sys.argv and index == 0:
    time.sleep(300)
