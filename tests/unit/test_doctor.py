"""The doctor's rules, one by one, on the plain data every rank gathers.

The verdicts are pure functions of each rank's facts (mpijax/_src/doctor/
facts.py) and the measurements; the jobs that produce real facts are in
tests/test_doctor_jobs.py and tests/system/test_doctor_multihost.py. Every
failure is one line that names the fix.
"""

from __future__ import annotations

import sys

import pytest

from mpijax._src import doctor
from mpijax._src.doctor import verdicts
from mpijax._src.doctor.measure import Cell
from mpijax._src.run import cli
from mpijax._src.run.common import DOCTOR_FAILED


def _rank(rank: int, **over) -> dict:
  f = {
    "rank": rank,
    "host": "n0",
    "node": 0,
    "local_rank": rank,
    "local_size": 4,
    "launcher": "prrte",
    "variables": ["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"],
    "under_run": True,
    "affinity": [0, 1, 2, 3, 4, 5, 6, 7],
    "online": 8,
    "allowed": 8,
    "oversubscribed": False,
    "cpu_bind": "auto",
    "shm": {"free": 8 << 30, "size": 8 << 30},
    "ptrace_scope": 1,
    "mpitrampoline_lib": "/x/libmpijax_bridge.so",
    "btl": "",
    "pml": "",
    "mpi_library": "Open MPI v5.0.11",
    "mpi_path": "/x/libmpi.so.40",
    "thread_multiple": True,
    "built_for": "Open MPI 5.0.11",
    "ext_error": "",
    "bridge_loaded": True,
    "bridge_installed": "/x/libmpijax_bridge.so",
    "xla_collectives": "mpi",
    "xla_setting": "auto",
    "jax_distributed": True,
    "jax_setting": True,
    "coordinator": "127.0.0.1:1234",
    "devices": 1,
    "platform": "cpu",
    "segments": 4,
    "segment_bytes": 64 << 20,
    "shm_max_bytes": 1 << 20,
    "cma_min_bytes": 64 << 10,
    "cache": {"dir": "/c/mpijax", "error": ""},
  }
  f.update(over)
  return f


def _job(n: int = 4, **over) -> list[dict]:
  return [_rank(r, **over) for r in range(n)]


def _all_fail_lines_name_a_fix(lines) -> None:
  for line in lines:
    if isinstance(line, verdicts.Line) and line.kind == "FAIL":
      assert "; fix: " in line.text, line
      assert "\n" not in str(line), line


def test_a_healthy_job_has_no_failure():
  cells = [Cell(8, 20e-6, 15e-6, 4, True), Cell(4 << 20, 1e-3, 2e-3, 8, True)]
  lines = doctor.report(
    _job(),
    sum_error="",
    node_sweeps={"n0": cells},
    across=[],
    links=[],
    fabric=False,
    shm_required=0,
  )
  kinds = [x.kind for x in lines if isinstance(x, verdicts.Line)]
  assert "FAIL" not in kinds and "warn" not in kinds, [str(x) for x in lines]


def test_launcher_line_names_the_launcher_and_its_variables():
  line = verdicts.launcher(_job())
  assert line.kind == "ok"
  assert line.text.startswith(
    "prrte, under mpijax-run; 4 ranks on 1 node; variables read: "
    "OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE"
  ), line
  job = _job()
  job[2]["launcher"] = ""
  bad = verdicts.launcher(job)
  assert bad.kind == "FAIL" and bad.text.startswith("rank 2 found no launcher's variables"), bad
  _all_fail_lines_name_a_fix([bad])


def test_shm_too_small_fails_naming_what_is_free_and_needed():
  job = _job(shm={"free": 40 << 20, "size": 64 << 20}, segment_bytes=0)
  (line,) = verdicts.shm(job, 0)
  # Open MPI's 16 MiB and 2 x 1 MiB of mpijax's segments per rank: 72 MiB for 4 ranks.
  assert verdicts.shm_needed(job) == 4 * (16 << 20) + 4 * 2 * ((1 << 20) + 4096)
  assert line.kind == "FAIL", line
  assert line.text.startswith(
    "n0 has 40 MiB for the job (40 MiB free of 64 MiB), less than the "
    "72.0 MiB needed (what the job's ranks map there)"
  ), line
  assert "docker run --shm-size" in line.text
  (line,) = verdicts.shm(_job(), 1 << 40)  # the setting asks for more than there is
  assert line.kind == "FAIL" and "1024 GiB needed (MPIJAX_DOCTOR_SHM_BYTES)" in line.text, line
  (line,) = verdicts.shm(_job(), 0)
  assert line.kind == "ok" and line.text == "n0: 8 GiB free, 72.0 MiB needed", line


def test_an_unwritable_compile_cache_fails_with_the_fix():
  job = _job()
  job[1]["cache"] = {"dir": "/ro/mpijax", "error": "PermissionError: Permission denied"}
  line = verdicts.cache(job)
  assert line.kind == "FAIL"
  assert line.text.startswith("/ro/mpijax cannot be written on rank 1 (PermissionError:"), line
  assert "MPIJAX_COMPILE_CACHE=off" in line.text
  assert verdicts.cache(_job()).text == "/c/mpijax, writable on every rank"


@pytest.mark.parametrize(
  "btl,segments,fails",
  [
    ("tcp,self", 0, True),
    ("", 0, True),  # no btl chosen, but no shared-memory segment mapped either
    ("^sm", 4, True),
    ("sm,tcp,self", 4, False),
    ("", 4, False),
    ("^ofi", 4, False),
  ],
)
def test_mpi_over_tcp_within_a_node_fails(btl, segments, fails):
  lines = verdicts.node_transport(_job(btl=btl, segments=segments))
  assert bool(lines) == fails, lines
  if fails:
    assert lines[0].kind == "FAIL"
    assert "falls back to TCP where shared memory should serve" in lines[0].text, lines
    _all_fail_lines_name_a_fix(lines)


def test_mpi_within_a_node_is_not_judged_for_ucx_or_one_rank():
  assert verdicts.node_transport(_job(pml="ucx", segments=0)) == []
  assert verdicts.node_transport(_job(1, segments=0)) == []


def test_the_sweep_fails_below_half_of_raw_mpi():
  ok = [Cell(8, 20e-6, 15e-6, 4, True), Cell(4 << 20, 4e-3, 2.1e-3, 8, True)]
  (line,), table = verdicts.sweep("within n0", ok, 4)
  assert line.kind == "ok", line
  assert "latency 20.0 µs at 8 B (raw MPI 15.0 µs)" in line.text, line
  assert "52% of raw MPI's" in line.text, line
  assert any("CMA" in row for row in table)
  slow = [Cell(8, 20e-6, 15e-6, 4, True), Cell(4 << 20, 4e-3, 1.9e-3, 1, True)]
  (line,), _ = verdicts.sweep("within n0", slow, 4)
  assert line.kind == "FAIL" and "48% of raw MPI's" in line.text, line
  _all_fail_lines_name_a_fix([line])
  wrong = [Cell(8, 20e-6, 15e-6, 4, False)]
  (line,), _ = verdicts.sweep("within n0", wrong, 4)
  assert line.kind == "FAIL" and line.text.startswith("wrong results at 8 B"), line
  # Latency alone (a sweep of small sizes only): 5x raw MPI's is no bandwidth below half.
  tiny = [Cell(8, 100e-6, 20e-6, 4, True)]
  (line,), _ = verdicts.sweep("within n0", tiny, 4)
  assert line.kind == "ok" and "no bandwidth judged" in line.text, line


def test_a_link_below_half_of_what_it_should_carry_fails():
  link = {
    "from": "a",
    "to": "b",
    "rate": 12.5e6,
    "error": "",
    "rated": 1.25e9,
    "interface": "eth0",
    "loopback": 3e9,
  }
  (line,) = verdicts.link_lines([link])
  assert line.kind == "FAIL" and line.topic == "link a -> b", line
  assert line.text.startswith(
    "12.5 MB/s over TCP, 1% of the 1.25 GB/s expected (eth0's rated "
    "speed): below half; fix: a slow or shaped link (tc qdisc show dev "
    "eth0)"
  ), line
  # A link faster than TCP over loopback is judged against loopback.
  (line,) = verdicts.link_lines([dict(link, rate=0.9e9, rated=None, loopback=1.5e9)])
  assert line.kind == "ok" and "60% of the 1.50 GB/s expected (this node's TCP over loopback)" in (
    line.text
  ), line
  (line,) = verdicts.link_lines([dict(link, rate=0.0, error="ConnectionRefusedError: refused")])
  assert line.kind == "FAIL" and "no stream got through (ConnectionRefusedError" in line.text
  _all_fail_lines_name_a_fix([line])


def test_oversubscription_warns_and_a_launchers_narrow_binding_fails():
  over = _job(affinity=[0], online=2, allowed=2, oversubscribed=True)
  for r, f in enumerate(over):
    f["affinity"] = [r % 2]
  (line,) = verdicts.cores(over)
  assert (
    line.kind == "warn"
    and "n0 runs 4 ranks x 1 device on 2 cores: oversubscribed 2x; mpijax "
    "binds each rank to one core"
    in line.text
  ), line
  narrow = _job(allowed=32, online=32)
  for r, f in enumerate(narrow):
    f["affinity"] = [r]
  (line,) = verdicts.cores(narrow)
  assert line.kind == "FAIL", line
  assert line.text.startswith(
    "on n0, ranks 0-3 may run on 1 core each of the 32 the node allows (a share of 8)"
  ), line
  assert "srun --cpus-per-task=8" in line.text
  (line,) = verdicts.cores(_job())
  assert line.kind == "ok" and line.text == "n0: 4 ranks x 1 device on 8 cores, unbound"


def test_xla_collectives_falling_back_to_gloo_fail_unless_asked_for():
  lines = verdicts.xla(_job(xla_collectives="gloo", bridge_loaded=False), "")
  assert [x.kind for x in lines] == ["ok", "FAIL"], lines
  assert lines[1].text.startswith(
    "XLA's cross-process collectives fall back to gloo (TCP) instead "
    "of MPI: jaxlib did not load mpijax's bridge on ranks 0-3"
  ), lines
  _all_fail_lines_name_a_fix(lines)
  lines = verdicts.xla(_job(xla_collectives="gloo", bridge_loaded=False, xla_setting="gloo"), "")
  assert [x.kind for x in lines] == ["ok", "warn"], lines
  lines = verdicts.xla(_job(), "got 3, expected 10")
  assert lines[0].kind == "FAIL" and "got 3, expected 10" in lines[0].text


def test_node_local_paths_that_did_not_serve_warn():
  refused = [Cell(8, 1e-5, 1e-5, 4, True), Cell(256 << 10, 1e-4, 1e-4, 2, True)]
  lines = verdicts.node_paths(_job(ptrace_scope=3), refused)
  assert [x.topic for x in lines] == ["cross-memory attach"], lines
  assert lines[0].kind == "warn" and "(Yama ptrace_scope=3)" in lines[0].text
  assert "take ring instead" in lines[0].text, lines
  no_shm = [Cell(8, 1e-5, 1e-5, 1, True), Cell(256 << 10, 1e-4, 1e-4, 8, True)]
  lines = verdicts.node_paths(_job(), no_shm)
  assert lines[0].topic == "node-local paths" and "took MPI, not mpijax's shared memory" in (
    lines[0].text
  ), lines


def test_mpijax_run_doctor_runs_python_m_mpijax_doctor_once_and_bounded():
  opts = cli.parse_args(["-n", "4", "--doctor"])
  assert opts.program == [sys.executable, "-m", "mpijax", "doctor"] and opts.doctor
  assert opts.timeout == 180.0 and opts.max_restarts == 0
  opts = cli.parse_args(["-n", "4", "--doctor", "--timeout", "50", "--", "python3", "train.py"])
  assert opts.program == ["python3", "-m", "mpijax", "doctor"] and opts.timeout == 50
  with pytest.raises(SystemExit):
    cli.parse_args(["-n", "4", "--doctor", "--max-restarts", "1"])
  assert doctor.FAILED == DOCTOR_FAILED == 3


def test_nodes_of_one_machine_sweep_in_turn_and_nodes_of_their_own_at_once():
  def rank(host: str, boot: str) -> dict:
    return {"host": host, "boot_id": boot}

  # Two namespaces of one machine (one boot id), two ranks each: two turns.
  one = [rank("a", "k"), rank("a", "k"), rank("b", "k"), rank("b", "k")]
  assert doctor.machine_turn(one, "a") == (0, 2)
  assert doctor.machine_turn(one, "b") == (1, 2)
  # Machines of their own: one turn, every node at once.
  apart = [rank("a", "k1"), rank("b", "k2"), rank("c", "")]
  assert [doctor.machine_turn(apart, h) for h in "abc"] == [(0, 1)] * 3
