"""A worker that reports its pid and sleeps: for stopping `kerasmulti launch` from outside."""

import os
import time

print(f"pid={os.getpid()}", flush=True)
time.sleep(120)
