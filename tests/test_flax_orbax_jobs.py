"""An Orbax checkpoint of a Flax model trained by 4 ranks, restored by 2 ranks x 2 devices
and by 1 rank (tests/flax_orbax.py run as a script in separate MPI jobs)."""

from __future__ import annotations

import os
import sys

import pytest

from tests._launch import run_mpi
from tests._launch import tail

pytest.importorskip("flax", reason="flax is in the test extra: pip install -e '.[test]'")
pytest.importorskip("orbax.checkpoint", reason="orbax-checkpoint is in the test extra")


def _run(n: int, devices: int, *args: str) -> str:
  result, seconds = run_mpi(n, [sys.executable, "-m", "tests.flax_orbax", *args],
                            devices_per_process=devices, timeout=240,
                            env={"MPIJAX_TIMEOUT": "120"})
  assert result.returncode == 0, (f"{args[0]} on {n} ranks x {devices} devices failed "
                                  f"(exit {result.returncode}, {seconds:.0f}s):\n"
                                  f"{tail(result.stdout)}")
  return result.stdout


def test_a_4_rank_orbax_checkpoint_restores_on_2_ranks_x_2_devices_and_on_1_rank(tmp_path):
  path = str(tmp_path / "state")
  out = _run(4, 1, "save", path)
  assert out.count("SAVED rank") == 4, tail(out)
  # One array-data directory per process wrote shards (Orbax's OCDBT layout).
  assert sorted(d for d in os.listdir(path) if d.startswith("ocdbt.process_")) == [
      f"ocdbt.process_{p}" for p in range(4)]
  out = _run(2, 2, "restore", path)
  assert out.count("RESTORED rank") == 2 and "of 2 x 2 devices" in out, tail(out)
  out = _run(1, 1, "restore", path)
  assert out.count("RESTORED rank 0 of 1 x 1 devices") == 1, tail(out)
