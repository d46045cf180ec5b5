"""Prints what TF_CONFIG says about this worker; optional failure and hang for the launcher tests."""

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
if "fail-1" in sys.argv and index == 1:
    sys.exit(3)
if "kill-1" in sys.argv and index == 1 or "kill-0" in sys.argv and index == 0:
    os.kill(os.getpid(), signal.SIGKILL)
if "hang-0" in sys.argv and index == 0:
    time.sleep(300)
