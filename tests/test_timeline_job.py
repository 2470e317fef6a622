"""MPIJAX_TIMELINE on a 4-rank training job: one complete file, same results, a PNG."""

from __future__ import annotations

import collections
import json
import re
import subprocess
import sys

from tests._launch import REPO
from tests._launch import run_mpi
from tests._launch import tail

SCRIPT = str(REPO / "tests" / "scripts" / "timeline_train.py")
RANKS, STEPS = 4, 5


def _digests(out: str) -> dict[int, str]:
  return {int(r): d for r, d in re.findall(r"rank (\d+): state sha256 (\w+)", out)}


def test_timeline_of_a_training_job(tmp_path):
  plain, _ = run_mpi(RANKS, [sys.executable, SCRIPT, str(STEPS)], timeout=300)
  assert plain.returncode == 0, tail(plain.stdout)
  path = tmp_path / "trace.json"
  traced, _ = run_mpi(
    RANKS, [sys.executable, SCRIPT, str(STEPS)], timeout=300, env={"MPIJAX_TIMELINE": str(path)}
  )
  assert traced.returncode == 0, tail(traced.stdout)
  # The timeline changes no value.
  assert len(_digests(plain.stdout)) == RANKS
  assert _digests(traced.stdout) == _digests(plain.stdout)

  trace = json.loads(path.read_text())
  meta = trace["otherData"]["mpijax"]
  assert meta["ranks_merged"] == list(range(RANKS)) and not meta["ranks_missing"]
  events = trace["traceEvents"]
  calls = [e for e in events if e.get("cat") == "mpijax"]
  per_rank = collections.Counter(e["pid"] for e in calls)
  assert set(per_rank) == set(range(RANKS)) and len(set(per_rank.values())) == 1, per_rank
  assert {e["tid"] for e in calls} == {1}  # one device per rank
  steps = collections.Counter(
    e["pid"] for e in events if e.get("cat") == "step" and e["name"] == "DataParallel.step"
  )
  assert steps == {r: STEPS for r in range(RANKS)}, steps
  for e in calls:
    a = e["args"]
    assert a["wait_ns"] >= 0 and a["transfer_ns"] >= 0  # a wait never exceeds the call
    assert a["bytes"] > 0 and a["path"] != "none"
  # Each step's gradient all-reduce lies inside that rank's step span.
  spans = collections.defaultdict(list)
  for e in events:
    if e.get("cat") == "step" and e["name"] == "DataParallel.step":
      spans[e["pid"]].append((e["ts"], e["ts"] + e["dur"]))
  for e in calls:
    if "allreduce" in e["name"]:
      assert any(a - 1 <= e["ts"] and e["ts"] + e["dur"] <= b + 1 for a, b in spans[e["pid"]]), e

  png = tmp_path / "step.png"
  out = subprocess.run(
    [sys.executable, "-m", "mpijax.timeline", "render", str(path), "-o", str(png), "--step", "-1"],
    capture_output=True,
    text=True,
    timeout=120,
    cwd=str(REPO),
  )
  assert out.returncode == 0, out.stdout + out.stderr
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert f"step {STEPS} of {STEPS}: " in out.stdout  # the last, counted from 1
  bad = subprocess.run(
    [sys.executable, "-m", "mpijax.timeline", "render", str(path), "-o", str(png), "--step", "99"],
    capture_output=True,
    text=True,
    timeout=120,
    cwd=str(REPO),
  )
  assert bad.returncode == 1 and "out of range" in bad.stderr


_ONE_RANK = r"""
import sys
import jax, jax.numpy as jnp
import mpijax
from mpijax import ops
try:
  mpijax.init(timeline=sys.argv[1])
except ValueError as e:
  print("ERROR", e)
  raise SystemExit(3)
y = jax.jit(lambda x: ops.allreduce(x, "sum"))(jnp.arange(3.0))
print("sum", y.tolist())
"""


def _one_rank(path: str) -> subprocess.CompletedProcess:
  import os

  from tests.unit.test_cluster import LAUNCHER_PREFIXES

  env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}
  return subprocess.run(
    [sys.executable, "-c", _ONE_RANK, path],
    env=env,
    capture_output=True,
    text=True,
    timeout=180,
    cwd=str(REPO),
  )


def test_init_argument_writes_the_file_at_exit(tmp_path):
  path = tmp_path / "sub" / "one.json"
  out = _one_rank(str(path))
  assert out.returncode == 0, out.stdout + out.stderr
  assert "sum [0.0, 1.0, 2.0]" in out.stdout
  trace = json.loads(path.read_text())
  calls = [e for e in trace["traceEvents"] if e.get("cat") == "mpijax"]
  assert len(calls) == 1 and calls[0]["args"]["op"] == "allreduce"
  assert calls[0]["args"]["shape"] == [3] and calls[0]["args"]["bytes"] == 12
  assert not list(path.parent.glob("*.tmp.*"))  # written atomically, nothing left over


def test_unwritable_timeline_path_is_a_clear_error(tmp_path):
  out = _one_rank(str(tmp_path))  # a directory
  assert out.returncode == 3, out.stdout + out.stderr
  assert "cannot be written" in out.stdout and "MPIJAX_TIMELINE" in out.stdout
