"""The straggler report in real jobs: who is named, when, with what split, and in the timeline.

The job is tests/scripts/straggler_job.py: mpijax.train steps with one rank doing
40 % more work per step, or with equal ranks; a rank whose batches come late;
plain JAX whose collectives are XLA's over the bridge.
"""

from __future__ import annotations

import json
import re
import sys

from tests._launch import REPO
from tests._launch import run_mpi
from tests._launch import tail

SCRIPT = str(REPO / "tests" / "scripts" / "straggler_job.py")
STEPS = 50
# "... arrived last in 94 % of the 50 collectives ..., 25 ms late on average
# (input 0.41 ms, compute 24 ms); ..."
_NAMED = re.compile(
  # mpijax-run prefixes rank 0's line with [rank0] (mpijax's own tag then drops the rank).
  r"\[rank0\]: mpijax: warning: straggler (in the last [\d.]+ s|over the job[^:]*): "
  r"rank (\d+) \(host [^)]+\) arrived last in (\d+) % of the (\d+) collectives"
)
_SPLIT = re.compile(r"\(input ([\d.]+) ms, compute ([\d.]+) ms\)")


def _job(ranks, mode, late=None, *, env=None, steps=STEPS):
  argv = [sys.executable, SCRIPT, mode, str(steps)] + ([] if late is None else [str(late)])
  out, _ = run_mpi(ranks, argv, timeout=300, env=env)
  assert out.returncode == 0, tail(out.stdout)
  assert out.stdout.count(f"{steps} steps") == ranks, tail(out.stdout)
  return out.stdout


def _named(out):
  """[(window, rank, percent, collectives, line)] of every straggler line rank 0 logged."""
  found = []
  for line in out.splitlines():
    m = _NAMED.search(line)
    if m:
      found.append((m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4)), line))
  return found


def _split(line):
  m = _SPLIT.search(line)
  assert m, line
  return float(m.group(1)), float(m.group(2))


def test_a_rank_with_40_percent_more_work_is_named_within_50_steps(tmp_path):
  trace = tmp_path / "trace.json"
  out = _job(4, "compute", 2, env={"MPIJAX_TIMELINE": str(trace)})
  job = [n for n in _named(out) if n[0] == "over the job"]
  assert len(job) == 1 and job[0][1] == 2, tail(out)
  assert job[0][3] >= 10, job[0][4]
  input_ms, compute_ms = _split(job[0][4])
  assert compute_ms > 4 * input_ms, job[0][4]  # its extra work is compute
  assert not [n for n in _named(out) if n[1] != 2], tail(out)
  # The timeline shows it: the verdict, and the late rank's calls marked with their lateness.
  meta = json.loads(trace.read_text())
  stragglers = meta["otherData"]["mpijax"]["stragglers"]
  assert stragglers["rank"] == 2, stragglers
  calls = [e for e in meta["traceEvents"] if e.get("cat") == "mpijax"]
  last = [e for e in calls if e["args"].get("arrived_last")]
  assert len(last) >= STEPS and all(e["args"]["late_ns"] >= 0 for e in last)
  # The calls say what the verdict does: rank 2 holds most of the waiting for a late rank.
  held = [e for e in last if e["args"]["late_ns"] >= 500_000]
  mine = [e["args"]["late_ns"] for e in held if e["pid"] == 2]
  assert len(mine) >= len(held) / 2 and sum(mine) >= 0.75 * sum(e["args"]["late_ns"] for e in held)
  lines = [e for e in meta["traceEvents"] if e.get("cat") == "straggler"]
  assert [e["args"]["report"] for e in lines] == [job[0][4].split("warning: ", 1)[1]], lines


def test_equal_ranks_name_none():
  out = _job(4, "compute", env={"MPIJAX_STRAGGLER_INTERVAL": "2"})
  assert not _named(out), tail(out)
  assert (
    len(
      re.findall(
        r"\[rank0\]: mpijax: stragglers over the job: none; \d+ collectives "
        r"compared across 4 ranks",
        out,
      )
    )
    == 1
  ), tail(out)


def test_xla_collectives_over_the_bridge_and_the_periodic_line():
  out = _job(2, "xla", 0, env={"MPIJAX_STRAGGLER_INTERVAL": "1"})
  named = _named(out)
  assert named and {n[1] for n in named} == {0}, tail(out)
  periodic = [n for n in named if n[0] != "over the job"]
  first = re.search(r"first straggler line at step (\d+)", out)
  assert periodic and first and int(first.group(1)) <= STEPS, tail(out)
  job = [n for n in named if n[0] == "over the job"]
  assert len(job) == 1 and job[0][3] >= STEPS - 5, job  # every call's all-reduce compared
  assert "(input" not in job[0][4]  # no mpijax.train loop: no split


def test_a_rank_whose_batches_come_late_is_late_by_its_input():
  out = _job(2, "input", 1)
  job = [n for n in _named(out) if n[0] == "over the job"]
  assert len(job) == 1 and job[0][1] == 1, tail(out)
  input_ms, compute_ms = _split(job[0][4])
  assert input_ms > 4 * compute_ms, job[0][4]


def test_the_setting_turns_it_off():
  out = _job(
    2, "xla", 0, env={"MPIJAX_STRAGGLERS": "0", "MPIJAX_STRAGGLER_INTERVAL": "1"}, steps=15
  )
  assert "straggler" not in out, tail(out)


def test_a_rank_that_does_not_come_to_the_end_does_not_hold_the_report():
  # Rank 1 holds its exit 6 s; rank 0 waits for its last stamps 2 s (the script's bound),
  # then reports what the periods brought.
  out = _job(
    2, "xla", 1, env={"STRAGGLER_TEST_HOLD": "6", "MPIJAX_STRAGGLER_INTERVAL": "1"}, steps=45
  )
  job = [n for n in _named(out) if n[0].startswith("over the job")]
  line = re.search(r"job line at ([\d.]+)", out)
  ended = re.search(r"hold ended at ([\d.]+)", out)
  assert job and line and ended, tail(out)
  assert "(no last stamps from ranks [1] within 2 s)" in job[0][4], job[0][4]
  assert job[0][1] == 1, job[0][4]  # its stamps until the last period: still named
  assert float(line.group(1)) < float(ended.group(1)) - 3, (line.group(1), ended.group(1))
