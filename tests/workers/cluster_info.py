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
    open(sys.argv[-1], "w").close()  # the handler is set: worker 1 may fail now
if "fail-1" in sys.argv and index == 1:
    sys.exit(3)
if "end-1-then-fail-0" in sys.argv:  # as a script that skips fit on worker 1: worker 0's step then fails
    if index == 1:
        with open(sys.argv[-1], "w") as f:
            f.write(str(os.getpid()))
        sys.exit(0)
    for _ in range(1200):  # up to 120 s: until worker 1 has ended (a zombie until the launcher reaps it)
        try:
            with open(sys.argv[-1]) as f, open(f"/proc/{int(f.read() or 0) or os.getpid()}/stat") as stat:
                if stat.read().split(")")[-1].split()[0] == "Z":
                    break
        except (FileNotFoundError, ProcessLookupError):
            if os.path.exists(sys.argv[-1]) and open(sys.argv[-1]).read():
                break
        time.sleep(0.1)
    sys.exit(1)
if "raise-1" in sys.argv and index == 1:
    for _ in range(1200):  # up to 120 s: a busy machine starts Python slowly
        if os.path.exists(sys.argv[-1]):
            break
        time.sleep(0.1)
    raise RuntimeError("worker 1's own failure")
if "kill-1" in sys.argv and index == 1 or "kill-0" in sys.argv and index == 0:
    os.kill(os.getpid(), signal.SIGKILL)
if "hang-0" in sys.argv and index == 0:
    time.sleep(300)
