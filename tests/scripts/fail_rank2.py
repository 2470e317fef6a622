"""Rank 2 raises; the others wait in a collective that can only end by abort."""

import sys

import mpijax

rt = mpijax.init()  # installs the abort hook
if rt.rank == 2:
  raise ValueError("deliberate failure on rank 2")
rt.comm.Barrier()  # rank 2 never arrives
print(f"rank {rt.rank} passed the barrier: the abort did not happen", flush=True)
sys.exit(0)
