"""Rank 2 raises before mpijax.init(); run under `python -m mpijax`."""

from mpi4py import MPI

if MPI.COMM_WORLD.rank == 2:
  raise RuntimeError("deliberate failure on rank 2 before init")
MPI.COMM_WORLD.Barrier()
print("barrier passed: the abort did not happen", flush=True)
