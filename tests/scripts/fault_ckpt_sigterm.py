"""Saves a small checkpoint, then starts a big one; the test sends SIGTERM to
the launcher while the big one is being written.

usage: fault_ckpt_sigterm.py CKPT_PATH
"""

import sys

import numpy as np

import mpijax
import mpijax.train as mt

rt = mpijax.init()
path = sys.argv[1]
mt.save_checkpoint(path, {"version": 1, "x": np.ones(1000, np.float32)})
print(f"rank {rt.rank}: saved version 1", flush=True)
big = np.full(48 << 20, 2.0, np.float32)  # 192 MB: takes a while to pack and write
for i in range(1000):
  print(f"rank {rt.rank}: saving version {i + 2}", flush=True)
  mt.save_checkpoint(path, {"version": i + 2, "x": big}, check_replicated=False)
