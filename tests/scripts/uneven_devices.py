"""Rank 1 asks for 2 CPU devices, the others for 1: init() must refuse on every rank."""

import os

import mpijax

rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
try:
  mpijax.init(devices_per_process=2 if rank == 1 else 1)
except RuntimeError as e:
  print(f"rank {rank} refused: {e}", flush=True)
  raise SystemExit(3)  # noqa: B904
print(f"rank {rank} started: the uneven device counts were not caught", flush=True)
