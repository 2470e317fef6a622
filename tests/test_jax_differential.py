"""JAX's own collectives across ranks equal one process with the same devices (randomized).

tests/scripts/jax_differential.py draws the cases (shard_map + jax.lax
collectives, jit partitioner resharding and reductions, 1-D and 2-D meshes
in several device orders, float32/int32/bfloat16); a single process with as
many CPU devices as the job computes the reference, then the MPI job
compares every shard with it, and checks that the compiled programs held
the collectives the cases call for and that XLA ran them through mpijax's
bridge. CI runs about 200 cases over the three layouts; MPIJAX_TEST_SLOW=1
runs 10,000 (other seeds).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests._launch import REPO
from tests._launch import SLOW
from tests._launch import run_mpi
from tests._launch import tail

SCRIPT = REPO / "tests" / "scripts" / "jax_differential.py"
# (ranks, devices per rank), all through mpijax's MPI bridge: with 2 per rank
# each (rank, device) is a member of XLA's communicators.
LAYOUTS = [(2, 1), (4, 1), (2, 2)]
CI_CASES = {(2, 1): 60, (4, 1): 70, (2, 2): 70}
SLOW_CASES = {(2, 1): 3332, (4, 1): 3334, (2, 2): 3334}
NOISE = re.compile(r"Involuntary full rematerialization|\[Gloo\] Rank")


def _reference(ranks: int, local: int, args: list[str], out: str, timeout: float) -> None:
  """The same cases in one process with ranks * local CPU devices, saved to ``out``."""
  env = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "MPIJAX_")) and k != "MPITRAMPOLINE_LIB"
  }
  layout = ["--ranks", str(ranks), "--local", str(local)]
  cmd = [sys.executable, str(SCRIPT), "reference", *layout, "--out", out, *args]
  r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(REPO), timeout=timeout)
  assert r.returncode == 0, tail(r.stdout + r.stderr)
  assert "DIFF REFERENCE" in r.stdout, tail(r.stdout + r.stderr)


def _differential(ranks: int, local: int, cases: int, seed: int, tmp_path, timeout: float) -> str:
  args = ["--cases", str(cases), "--seed", str(seed)]
  ref = str(tmp_path / f"ref{ranks}x{local}.npz")
  _reference(ranks, local, args, ref, timeout)
  try:
    result, _ = run_mpi(
      ranks,
      [sys.executable, str(SCRIPT), "check", "--ref", ref, *args],
      devices_per_process=local,
      timeout=timeout,
    )
  finally:
    os.unlink(ref)  # 3,334 cases' results take about 350 MB
  # Without XLA's partitioner notes and gloo's connection lines, the mismatches show.
  out = "\n".join(line for line in result.stdout.splitlines() if not NOISE.search(line))
  assert result.returncode == 0, tail(out, 200)
  total = re.search(
    rf"DIFF TOTAL {ranks}x{local} \((\w+)\) seed {seed}: (\d+) cases .*, (\d+) mismatches", out
  )
  assert total, tail(out, 200)
  # XLA's collectives over MPI at every layout (several devices per rank too).
  assert (total[1], int(total[2]), int(total[3])) == ("mpi", cases, 0), tail(out, 200)
  for r in range(ranks):
    assert f"DIFF rank {r}: {cases} cases, 0 mismatches" in out, tail(out, 200)
  _check_collectives(out, ranks, local)
  return out


# XLA's collectives and the bridge's calls that carry them.
BRIDGE_CALLS = {
  "all-reduce": "allreduce",
  "all-gather": "allgather",
  "reduce-scatter": "reduce_scatter",
}
POINT_TO_POINT = ("all-to-all", "collective-permute")  # sendrecv, isend and irecv


def _check_collectives(out: str, ranks: int, local: int) -> None:
  """Equal results prove little if the programs moved nothing between ranks: the compiled
  programs hold the collectives the cases' shard_map steps lower to, and XLA ran them
  through mpijax's bridge (every device of a rank calls it once per collective)."""
  expect = json.loads(re.search(r"DIFF EXPECT (\{.*\})", out)[1])
  assert set(expect["across"]) == set(BRIDGE_CALLS) | set(POINT_TO_POINT), expect
  for r in range(ranks):
    hlo = json.loads(re.search(rf"DIFF HLO rank {r}: (\{{.*\}})", out)[1])
    bridge = json.loads(re.search(rf"DIFF BRIDGE rank {r}: (\{{.*\}})", out)[1])
    assert set(expect["hlo"]) <= {k for k, v in hlo.items() if v > 0}, (r, expect, hlo)
    for kind, call in BRIDGE_CALLS.items():
      assert bridge[call] >= local * hlo.get(kind, 0) > 0, (r, kind, hlo, bridge)
    # A device may sit out a partial permutation: only that some exchange ran is certain.
    assert bridge["sendrecv"] + bridge["isend"] + bridge["irecv"] > 0, (r, hlo, bridge)


@pytest.mark.parametrize("ranks,local", LAYOUTS, ids=[f"{p}x{l}" for p, l in LAYOUTS])
def test_jax_collectives_equal_one_process(ranks, local, tmp_path):
  _differential(ranks, local, CI_CASES[(ranks, local)], 0, tmp_path, timeout=300)


@pytest.mark.parametrize(
  "ranks,local", [pytest.param(p, l, id=f"{p}x{l}", marks=SLOW) for p, l in LAYOUTS]
)
def test_jax_collectives_equal_one_process_10000_cases(ranks, local, tmp_path):
  _differential(ranks, local, SLOW_CASES[(ranks, local)], 1, tmp_path, timeout=3600)
