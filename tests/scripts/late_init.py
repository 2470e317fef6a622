"""A rank that reaches mpijax.init() late: the last rank loads its data first.

``python late_init.py SECONDS``: the last rank sleeps SECONDS in
``load_data()`` before ``mpijax.init()``; every rank then all-reduces its
rank and prints ``rank R arrived: SUM``.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import mpijax


def load_data(seconds: float) -> None:
  time.sleep(seconds)


rank = int(os.environ.get("RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or 0)
size = int(os.environ.get("WORLD_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or 1)
if rank == size - 1:
  load_data(float(sys.argv[1]))
rt = mpijax.init()
total = mpijax.ops.allreduce(np.array([rt.rank], np.int32))
print(f"rank {rt.rank} arrived: {int(total[0])}", flush=True)
