"""Plain-JAX code's collectives over MPI run under mpijax's guards.

XLA's partitioner inserts collectives into jitted programs over global
jax.Arrays; mpijax's bridge carries them over MPI. These jobs check that a
stall, a mismatch and a dead rank end the job the way they do for mpijax's
own collectives, within the same time bounds, at 2 and 4 ranks.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from tests._launch import REPO
from tests._launch import mpirun_command
from tests._launch import tail

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="MPI jobs on Linux")

SCRIPT = str(REPO / "tests" / "scripts" / "xla_faults.py")
TIMEOUT = 5  # MPIJAX_TIMEOUT of these jobs, seconds


def _job(
  n: int, mode: str, env: dict[str, str] | None = None, limit: float = 120, devices: int = 1
):
  """Runs xla_faults.py MODE on n ranks; (exit code, output, seconds from the
  first "entering" line to each line that matches, by pattern, and to the end)."""
  import os

  full_env = dict(os.environ, MPIJAX_TIMEOUT=str(TIMEOUT), **(env or {}))
  cmd = mpirun_command(n, devices, timeout=limit) + [sys.executable, SCRIPT, mode]
  proc = subprocess.Popen(
    cmd,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    env=full_env,
    cwd=str(REPO),
    start_new_session=True,
  )
  lines: list[tuple[float, str]] = []
  for line in proc.stdout:
    lines.append((time.monotonic(), line))
  proc.wait()
  end = time.monotonic()
  out = "".join(text for _, text in lines)
  entered = [t for t, text in lines if " entering " in text]
  return proc.returncode, out, (entered[0] if entered else None), lines, end


def _every_rank_raised(out: str, n: int) -> None:
  """mpijax-run shows the first rank's report and says every rank raised it alike."""
  assert re.search(
    r"^\[rank\d+\]: mpijax: uncaught JaxRuntimeError on rank \d+/\d+, aborting the "
    r"job \(exit code 1\): UNKNOWN: MPI error: mpijax: mismatch in XLA's collectives",
    out,
    re.M,
  ), tail(out)
  assert re.search(
    rf"uncaught JaxRuntimeError: UNKNOWN: MPI error: mpijax: mismatch in XLA's "
    rf"collectives.*\(ranks 0-{n - 1} alike\)",
    out,
  ), tail(out)


def _first(lines, pattern: str) -> float | None:
  for t, text in lines:
    if re.search(pattern, text):
      return t
  return None


@pytest.mark.parametrize("n", [2, 4])
def test_a_rank_that_never_arrives_is_reported_and_the_job_ends(n):
  rc, out, entered, lines, end = _job(n, "stall")
  assert rc != 0, tail(out)
  report = _first(lines, r"mpijax: stall: rank \d+ waited")
  assert report is not None and entered is not None, tail(out)
  assert report - entered <= TIMEOUT + 2, (report - entered, tail(out))
  assert end - entered <= TIMEOUT + 5, (end - entered, tail(out))
  # The collective, the program it is in, the communicator and the call's number;
  # the rank that did not arrive and what it does.
  assert re.search(
    r"waited [\d.]+ s in XLA all-reduce float32\[1024\] \(sum\) in "
    r"jit\(<lambda>\)/reduce_sum \(call #2 on XLA communicator #1 \(ranks "
    + ("0,1" if n == 2 else "0-3")
    + r"\)\)",
    out,
  ), tail(out)
  # Every report: only the last rank has not arrived, and every other rank but
  # the one reporting waits in the same call (none at 2 ranks).
  reports = re.findall(
    r"mpijax: stall: rank (\d+) waited [^\n]*?\. Not arrived: rank (\d+) \(idle since "
    r"[\d.]+ s; last: XLA all-reduce float32\[1024\] \(sum\) in jit\(<lambda>\)/reduce_sum, "
    r"call #1; Python: xla_faults.py:\d+ in <module>: time.sleep\(600\)\)\.( Waiting in the "
    r"same call: ranks? ([\d,]+)\.)? Every rank must",
    out,
  )
  assert reports, tail(out)
  for reporter, missing, _, waiting in reports:
    others = ",".join(str(r) for r in range(n - 1) if r != int(reporter))
    assert int(reporter) < n - 1 and int(missing) == n - 1 and waiting == others, reports


def test_a_rank_inside_mpijax_own_collective_is_named_with_it():
  rc, out, entered, lines, end = _job(2, "stall_mpijax")
  assert rc != 0, tail(out)
  assert entered is not None and end - entered <= TIMEOUT + 5, tail(out)
  # Rank 0 waits in XLA's all-reduce; rank 1 is in mpijax's allreduce, and says so.
  assert re.search(
    r"rank 0 waited [\d.]+ s in XLA all-reduce float32\[1024\].*Not arrived: rank 1 "
    r"\(.*now in allreduce\(float32\[4\], sum\) at xla_faults.py:\d+ on "
    r"communicator \d+ since [\d.]+ s; Python: xla_faults.py:\d+ in <module>: "
    r"mpijax.ops.allreduce",
    out,
  ), tail(out)
  # And rank 1's own report says rank 0 is in XLA's all-reduce.
  assert re.search(
    r"rank 1 waited [\d.]+ s in allreduce\(float32\[4\], sum\).*Not arrived: rank 0 \(.*now in "
    r"XLA all-reduce float32\[1024\] \(sum\) in jit\(<lambda>\)/reduce_sum on XLA communicator "
    r"#1 \(ranks 0,1\) since [\d.]+ s",
    out,
  ), tail(out)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize(
  "mode, theirs, mine",
  [
    ("count", r"XLA all-reduce float32\[1024\] \(sum\)", r"XLA all-reduce float32\[4096\] \(sum\)"),
    ("dtype", r"XLA all-reduce float32\[1024\] \(sum\)", r"XLA all-reduce int32\[1024\] \(sum\)"),
    ("op", r"XLA all-reduce float32\[1024\] \(sum\)", r"XLA all-reduce float32\[1024\] \(max\)"),
    # Large enough for the cross-memory all-gather: compared before it.
    (
      "gather_count",
      r"XLA all-gather float32\[65536\] from each of \d ranks",
      r"XLA all-gather float32\[131072\] from each of \d ranks",
    ),
  ],
)
def test_ranks_that_disagree_get_an_error_naming_both_operations(n, mode, theirs, mine):
  rc, out, entered, lines, end = _job(n, mode)
  assert rc != 0 and "job exceeded --timeout" not in out, tail(out)
  others = "rank 0" if n == 2 else "ranks 0,1,2"
  assert re.search(
    rf"mpijax: mismatch in XLA's collectives on XLA communicator #\d+ \(ranks "
    rf"[\d,-]+\), call #\d+: {others} runs? {theirs}.*, but rank {n - 1} runs {mine}",
    out,
  ), tail(out)
  assert "No data was exchanged." in out, tail(out)
  # Every rank raises it, well before any timeout.
  _every_rank_raised(out, n)
  assert end - entered <= 4, (end - entered, tail(out))


# Whichever side of a mismatched exchange reads the other's header first
# reports it and stops the job: the ranks of the usual sizes, or the last rank.
@pytest.mark.parametrize(
  "n, mode, message",
  [
    (
      2,
      "permute",
      r"(rank 0: mismatch in XLA's collectives on XLA communicator #\d+ \(ranks 0,1\): this rank "
      r"runs XLA collective-permute 4096 bytes in jit\(<lambda>\)/shard_map/jit\(<lambda>\)/"
      r"ppermute and receives from rank 1, which runs XLA collective-permute 16384 bytes\."
      r"|rank 1: mismatch in XLA's collectives on XLA communicator #\d+ \(ranks 0,1\): this rank "
      r"runs XLA collective-permute 16384 bytes in jit\(<lambda>\)/shard_map/jit\(<lambda>\)/"
      r"ppermute and receives from rank 0, which runs XLA collective-permute 4096 bytes\.)",
    ),
    # 4 ranks: each rank's three exchanges (128 KiB, sent after their header)
    # are posted together, and every header is checked before any data.
    (
      4,
      "all_to_all",
      r"(rank [0-2]: mismatch in XLA's collectives on XLA communicator #\d+ \(ranks 0-3\): this "
      r"rank runs XLA all-to-all 131072 bytes to each of 4 ranks in jit\(<lambda>\)/shard_map/"
      r"jit\(<lambda>\)/all_to_all and receives from rank 3, which runs XLA all-to-all 262144 "
      r"bytes\."
      r"|rank 3: mismatch in XLA's collectives on XLA communicator #\d+ \(ranks 0-3\): this "
      r"rank runs XLA all-to-all 262144 bytes to each of 4 ranks in jit\(<lambda>\)/shard_map/"
      r"jit\(<lambda>\)/all_to_all and receives from rank [0-2], which runs XLA all-to-all "
      r"131072 bytes\.)",
    ),
  ],
)
def test_point_to_point_blocks_of_different_sizes_are_named_not_delivered(n, mode, message):
  rc, out, entered, lines, end = _job(n, mode)
  assert rc != 0 and "job exceeded --timeout" not in out, tail(out)
  assert re.search("mpijax: " + message, out), tail(out)
  assert "double free" not in out and "corruption" not in out, tail(out)
  assert end - entered <= 4, (end - entered, tail(out))


# The paths across nodes, taken here by turning the node-local ones off.
MPI_PATHS = {"MPIJAX_SHM_MAX_BYTES": "0", "MPIJAX_CMA_MIN_BYTES": "0"}


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize(
  "mode, mine, theirs",
  [
    ("count", r"float32\[1024\] \(sum\)", r"float32\[4096\] \(sum\)"),
    ("dtype", r"float32\[1024\] \(sum\)", r"int32\[1024\] \(sum\)"),
    ("op", r"float32\[1024\] \(sum\)", r"float32\[1024\] \(max\)"),
  ],
)
def test_small_all_reduces_across_nodes_compare_in_their_exchange(n, mode, mine, theirs):
  # Each exchange carries its sender's operation: the pair that differs names
  # both and stops the job (the other ranks may be in a later exchange).
  rc, out, entered, lines, end = _job(n, mode, env=MPI_PATHS)
  assert rc != 0 and "job exceeded --timeout" not in out, tail(out)
  # Either rank of the pair may tell first.
  low, high = n - 2, n - 1
  assert re.search(
    rf"mpijax: rank {low}: mismatch in XLA's collectives on XLA communicator #\d+ \(ranks "
    rf"[\d,-]+\): this rank runs XLA all-reduce {mine}.* and receives from rank {high}, which "
    rf"runs XLA all-reduce {theirs}\.",
    out,
  ) or re.search(
    rf"mpijax: rank {high}: mismatch in XLA's collectives on XLA communicator #\d+ \(ranks "
    rf"[\d,-]+\): this rank runs XLA all-reduce {theirs}.* and receives from rank {low}, which "
    rf"runs XLA all-reduce {mine}\.",
    out,
  ), tail(out)
  assert end - entered <= 4, (end - entered, tail(out))


@pytest.mark.parametrize("n", [2, 4])
def test_large_all_reduces_across_nodes_are_compared_first(n):
  rc, out, entered, lines, end = _job(n, "count_large", env=MPI_PATHS)
  assert rc != 0 and "job exceeded --timeout" not in out, tail(out)
  others = "rank 0" if n == 2 else "ranks 0,1,2"
  assert re.search(
    rf"{others} runs? XLA all-reduce float32\[65536\] \(sum\).*, but rank {n - 1} runs XLA "
    r"all-reduce float32\[131072\] \(sum\)",
    out,
  ), tail(out)
  _every_rank_raised(out, n)
  assert end - entered <= 4, (end - entered, tail(out))


@pytest.mark.parametrize("n", [2, 4])
def test_large_all_gathers_on_one_node_read_each_others_blocks(n, tmp_path):
  import json

  path = tmp_path / "trace.json"
  rc, out, entered, lines, end = _job(n, "gather", env={"MPIJAX_TIMELINE": str(path)})
  assert rc == 0 and out.count(" gather ok") == n, tail(out)
  events = json.loads(path.read_text())["traceEvents"]
  gathers = [e["args"] for e in events if e.get("name") == "XLA all-gather"]
  # 4 KiB per rank through MPI, 256 KiB by cross-memory attach; twice each, on every rank.
  assert sorted((a["bytes"], a["path"]) for a in gathers) == sorted(
    [(4096, "mpi")] * 2 * n + [(262144, "cross-memory attach")] * 2 * n
  ), gathers


@pytest.mark.parametrize("n", [2, 4])
def test_a_killed_rank_ends_the_job(n):
  rc, out, entered, lines, end = _job(n, "kill")
  assert rc != 0 and "job exceeded --timeout" not in out, tail(out)
  assert end - entered <= 6, (end - entered, tail(out))


def test_no_fault_no_message():
  rc, out, entered, lines, end = _job(2, "ok")
  assert rc == 0, tail(out)
  assert out.count("total 3.0") == 2 and "mpijax: stall" not in out and "mismatch" not in out, tail(
    out
  )
  assert "compiled different programs" not in out, tail(out)


@pytest.mark.parametrize("n,devices", [(2, 1), (4, 1), (2, 2)])
def test_ranks_that_compiled_other_shapes_stop_at_the_programs_first_collective(n, devices):
  # The last rank's rows have another shape: its program's all-reduce has the
  # same size as the others', but the programs differ. Every rank stops at that
  # all-reduce, before any data moves, and no rank prints a mean.
  rc, out, entered, lines, end = _job(n, "shapes", devices=devices)
  assert rc != 0 and not re.search(r"rank \d+ shape \(\d+, 4\) mean", out), tail(out)
  _every_rank_raised(out, n)
  found = re.search(r"mpijax: mismatch in XLA's collectives on .*", out)
  assert found, tail(out)
  text = found[0]
  # The ranks (with several devices: each rank's devices), and each one's
  # program by the shapes of its arguments, each device's part.
  if devices == 1:
    others = "rank 0 runs" if n == 2 else "ranks " + ",".join(map(str, range(n - 1))) + " run"
    last = f"rank {n - 1} runs"
  else:
    others, last = "rank 0 local devices 0,1 run", "rank 1 local devices 0,1 run"
  op = "XLA all-reduce float32[4] (sum), the first collective of program jit__lambda"
  assert f"{others} {op} (f32[2,4])->f32[4]," in text, text
  assert f"but {last} {op} (f32[3,4])->f32[4]," in text, text
  assert "pass global_shape to jax.make_array_from_process_local_data" in text, text
  # The exception every rank raises names the programs too (without their labels).
  assert re.search(
    r"JaxRuntimeError: UNKNOWN: MPI error: .*program jit__lambda \(f32\[3,4\]\)->f32\[4\]", out
  ), tail(out)
  assert "compiled different programs" not in out, tail(out)  # no warning at the end


def test_the_timeline_shows_xla_collectives_beside_mpijax_own(tmp_path):
  import json

  path = tmp_path / "trace.json"
  rc, out, entered, lines, end = _job(2, "timeline", env={"MPIJAX_TIMELINE": str(path)})
  assert rc == 0, tail(out)
  events = json.loads(path.read_text())["traceEvents"]
  calls = [e for e in events if e.get("cat") == "mpijax"]
  xla = [e for e in calls if e["name"] == "XLA all-reduce"]
  own = [e for e in calls if e["name"] == "allreduce"]
  # Warm-up plus 3 steps of XLA's all-reduce, 3 psums, on each rank.
  assert sorted(e["pid"] for e in xla) == [0] * 4 + [1] * 4, [e["pid"] for e in xla]
  assert sorted(e["pid"] for e in own) == [0, 0, 0, 1, 1, 1], [e["name"] for e in calls]
  for e in xla:
    a = e["args"]
    assert a["bytes"] == 4096 and a["dtype"] == "float32" and a["path"] == "shared memory", a
    assert "jit(<lambda>)/reduce_sum" in a["call_site"], a
  # Rank 1 arrives 0.3 s late at every step's XLA all-reduce: rank 0's recorded
  # wait covers it and names rank 1.
  late = [
    e["args"]["wait_ns"] for e in xla if e["pid"] == 0 and e["args"].get("waited_for_rank") == 1
  ]
  assert len([w for w in late if w >= 0.25e9]) == 3, late
  png = tmp_path / "step.png"
  r = subprocess.run(
    [sys.executable, "-m", "mpijax.timeline", "render", str(path), "-o", str(png), "--step", "1"],
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert r.returncode == 0 and png.stat().st_size > 0, r.stdout + r.stderr


# Several devices per rank: each (rank, local device) is a member of XLA's
# communicators, under the same guards.
CLIQUE = r"XLA communicator of devices 0,1,2048,2049 on ranks 0,1"


def test_several_devices_per_rank_a_stall_names_each_missing_device():
  rc, out, entered, lines, end = _job(2, "stall", devices=2)
  assert rc != 0, tail(out)
  report = _first(lines, r"mpijax: stall: rank 0 waited")
  assert report is not None and entered is not None, tail(out)
  assert report - entered <= TIMEOUT + 2, (report - entered, tail(out))
  assert end - entered <= TIMEOUT + 5, (end - entered, tail(out))
  idle = (
    r"\(idle since [\d.]+ s; last: XLA all-reduce float32\[1024\] \(sum\) in "
    r"jit\(<lambda>\)/reduce_sum, call #\d+; Python: xla_faults.py:\d+ in <module>: "
    r"time.sleep\(600\)\)"
  )
  assert re.search(
    r"rank 0 waited [\d.]+ s in XLA all-reduce float32\[1024\] \(sum\) in "
    rf"jit\(<lambda>\)/reduce_sum \(call #\d+ on {CLIQUE}.*\)\. Not arrived: "
    rf"rank 1 local device 0 {idle}, rank 1 local device 1 {idle}\. "
    r"Waiting in the same call: rank 0 local device [01]\.",
    out,
  ), tail(out)
  # One report for the rank, not one per waiting device.
  assert len(re.findall(r"mpijax: stall: rank 0 waited", out)) == 1, tail(out)


def test_several_devices_per_rank_a_mismatch_names_every_device():
  rc, out, entered, lines, end = _job(2, "count", devices=2)
  assert rc != 0 and "job exceeded --timeout" not in out, tail(out)
  assert re.search(
    rf"mpijax: mismatch in XLA's collectives on {CLIQUE}, call #\d+: rank 0 local devices "
    r"0,1 run XLA all-reduce float32\[1024\] \(sum\) in jit\(<lambda>\)/reduce_sum, but rank 1 "
    r"local devices 0,1 run XLA all-reduce float32\[4096\] \(sum\) in jit\(<lambda>\)/reduce_sum\. "
    r"No data was exchanged\.",
    out,
  ), tail(out)
  # The exception (at most 255 bytes) without the programs' names, on every rank.
  assert re.search(
    r"\[rank\d\]: mpijax: uncaught JaxRuntimeError on rank \d/2, aborting the job \(exit code "
    r"1\): UNKNOWN: MPI error: mpijax: mismatch in XLA's collectives on XLA communicator on "
    r"ranks 0,1, call #\d+: rank 0 local devices 0,1 run XLA all-reduce float32\[1024\] \(sum\), "
    r"but rank 1 local devices 0,1 run XLA all-reduce float32\[4096\] \(sum\) \(details on "
    r"stderr\)",
    out,
  ), tail(out)
  assert end - entered <= 4, (end - entered, tail(out))


def test_several_devices_per_rank_point_to_point_blocks_of_different_sizes():
  rc, out, entered, lines, end = _job(2, "permute", devices=2)
  assert rc != 0 and "job exceeded --timeout" not in out, tail(out)
  assert re.search(
    rf"mismatch in XLA's collectives on {CLIQUE}: this rank runs XLA collective-permute "
    r"(4096|16384) bytes .*receives from rank [01], which runs XLA collective-permute "
    r"(16384|4096) bytes\.",
    out,
  ), tail(out)
  assert "double free" not in out and "corruption" not in out, tail(out)
  assert end - entered <= 4, (end - entered, tail(out))


def test_several_devices_per_rank_the_timeline_shows_each_device(tmp_path):
  import json

  path = tmp_path / "trace.json"
  env = {"MPIJAX_TIMELINE": str(path)}
  rc, out, entered, lines, end = _job(2, "timeline", env=env, devices=2)
  assert rc == 0, tail(out)
  events = json.loads(path.read_text())["traceEvents"]
  xla = [
    e
    for e in events
    if e.get("cat") == "mpijax" and e["name"] == "XLA all-reduce" and e["args"]["bytes"] == 4096
  ]
  # Warm-up plus 3 steps on each (rank, device).
  assert sorted((e["pid"], e["tid"]) for e in xla) == sorted(
    [(r, 1 + d) for r in (0, 1) for d in (0, 1)] * 4
  ), xla
  # Rank 1 arrives 0.3 s late at every step: both of rank 0's devices wait for it.
  for tid in (1, 2):
    late = [
      e["args"]["wait_ns"]
      for e in xla
      if e["pid"] == 0 and e["tid"] == tid and e["args"].get("waited_for_rank") == 1
    ]
    assert len([w for w in late if w >= 0.25e9]) == 3, (tid, late)


def test_several_devices_per_rank_a_call_is_named_by_its_own_program(tmp_path):
  # init()'s warm-up of XLA's communicators all-reduces one float32 per device
  # on the same communicator before the user's program of that very shape runs.
  import json

  path = tmp_path / "trace.json"
  rc, out, entered, lines, end = _job(2, "label", env={"MPIJAX_TIMELINE": str(path)}, devices=2)
  assert rc == 0, tail(out)
  events = json.loads(path.read_text())["traceEvents"]
  sites = [
    e["args"]["call_site"]
    for e in events
    if e.get("cat") == "mpijax" and e["name"] == "XLA all-reduce" and e["args"]["bytes"] == 4
  ]
  mine = [s for s in sites if s == "XLA all-reduce float32[1] (sum) in jit(<lambda>)/reduce_sum"]
  assert len(mine) == 2 * 4, sites  # 2 calls on each (rank, device)
  assert not any("prepare_communicators" in s for s in sites), sites


# (Not "mpi" as an id: pytest-mpi takes a test of that keyword for its own.)
@pytest.mark.parametrize("transport", ["mpi", "gloo"], ids=["bridge", "gloo"])
def test_several_devices_per_rank_reduce_scatter(transport):
  # Right over MPI; over gloo (jax-ml/jax#40830) rank 0 warns at the first program.
  env = {"MPIJAX_XLA_COLLECTIVES": "gloo"} if transport == "gloo" else {}
  rc, out, entered, lines, end = _job(2, "reduce_scatter", env=env, devices=2)
  assert rc == 0 and out.count("scatter ok") == 2, tail(out)
  warning = re.findall(
    r"\[rank0\]: mpijax: warning: jit_\S+ has a reduce-scatter, and XLA's collectives run over "
    r"gloo with 2 devices per rank: .*jax-ml/jax/issues/40830\)\. Unset "
    r"MPIJAX_XLA_COLLECTIVES=gloo",
    out,
  )
  assert len(warning) == (1 if transport == "gloo" else 0), tail(out)
