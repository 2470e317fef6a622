"""mpijax-run's conventions without launching: torchrun-style variables, exports, the
restart policy and the exit reasons read from real launcher messages."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from mpijax._src import cluster
from mpijax._src import config
from mpijax._src import rank_env
from mpijax._src.launch import cli
from mpijax._src.launch import commands
from mpijax._src.launch import common
from mpijax._src.launch import hosts
from mpijax._src.launch import joblog
from mpijax._src.launch import process_group
from mpijax._src.launch import restarts
from mpijax._src.launch.mpi_probe import MPIInfo
from mpijax._src.launch.situation import Situation

DATA = pathlib.Path(__file__).parent / "data"
LAUNCHER_PREFIXES = (
  "OMPI_",
  "PMIX_",
  "PRTE_",
  "ORTE_",
  "SLURM_",
  "SLURMD_",
  "PMI_",
  "MPI_LOCAL",
  "HYDRA_",
  "MPIJAX_",
)
OMPI5 = MPIInfo("openmpi", (5, 0), "Open MPI v5.0.11", "/p/lib/libmpi.so.40")


@pytest.fixture
def clean_env(monkeypatch):
  for key in list(os.environ):
    if key.startswith(LAUNCHER_PREFIXES):
      monkeypatch.delenv(key)
  monkeypatch.setattr(cluster.mpi, "mpi4py_available", lambda: False)


def _load(name):
  return json.loads((DATA / name).read_text())["env"]


# --- RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE ------------------------------------


@pytest.mark.parametrize(
  "name,expected",
  [
    # Open MPI numbered this node's ranks in mapping order: rank 1 is local rank 2.
    (
      "env_prrte_rank1.json",
      {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "3"},
    ),
    (
      "env_openmpi4_rank2.json",
      {"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "3"},
    ),
    (
      "env_mpich_rank0.json",
      {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3"},
    ),
  ],
)
def test_torchrun_variables_from_each_launcher(clean_env, monkeypatch, name, expected):
  for key, value in _load(name).items():
    monkeypatch.setenv(key, value)
  target = {"RANK": "stale"}  # a value inherited from the shell is replaced
  assert rank_env.apply(target) == expected
  assert target == expected


def test_torchrun_variables_from_a_slurm_step(clean_env, monkeypatch):
  env = _load("env_slurm_rank3.json")
  for key, value in env.items():
    monkeypatch.setenv(key, value)
  info = cluster.detect("slurm")
  got = rank_env.torchrun_env(rank_env.launch_info())
  assert got == {
    "RANK": str(info.rank),
    "WORLD_SIZE": str(info.size),
    "LOCAL_RANK": str(info.local_rank),
    "LOCAL_WORLD_SIZE": str(info.local_size),
  }


def test_no_launcher_sets_nothing_and_never_asks_mpi(clean_env, monkeypatch):
  called = []
  monkeypatch.setattr(cluster.mpi, "mpi4py_available", lambda: called.append(1) or True)
  target: dict[str, str] = {}
  assert rank_env.apply(target) == {} and target == {}
  monkeypatch.setenv("MPIJAX_LAUNCHER", "mpi")  # forcing the MPI detector would initialize MPI
  assert rank_env.apply(target) == {}


def test_malformed_launcher_variable_is_left_to_init(clean_env, monkeypatch):
  for key, value in _load("env_prrte_rank0.json").items():
    monkeypatch.setenv(key, value)
  monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "x")
  assert rank_env.apply({}) == {}


# --- exports ------------------------------------------------------------------------


def _sit(env, mpi=OMPI5):
  return Situation(
    env=env, euid=1000, local_slots=8, mpi=mpi, mpirun="/p/bin/mpirun", mpirun_flavor=mpi.flavor
  )


def _exported(argv, env, plan=None):
  cmd = commands.build_command(cli.parse_args(argv), _sit(env), plan)
  out = {}
  for i, a in enumerate(cmd[:-1]):
    if a == "-x":
      name, _, value = cmd[i + 1].partition("=")
      out[name] = value if _ else None
  return out


def test_master_address_is_rank_zeros_host(tmp_path):
  env = {"PATH": "/usr/bin"}
  got = _exported(["-n", "2", "--", "hostname"], env)
  assert got["MASTER_ADDR"] == "127.0.0.1" and 0 < int(got["MASTER_PORT"]) < 65536
  assert (
    _exported(["-n", "4", "--hosts", "n1:2,n2:2", "--", "hostname"], env)["MASTER_ADDR"] == "n1"
  )
  hf = tmp_path / "hosts"
  hf.write_text("# x\nfirst slots=2\nsecond slots=2\n")
  assert (
    _exported(["-n", "4", "--hostfile", str(hf), "--", "hostname"], env)["MASTER_ADDR"] == "first"
  )
  # mpirun inside an allocation: the allocation's first node.
  slurm_env = {**env, "SLURM_JOB_ID": "3", "SLURM_JOB_NODELIST": "gpu[3-4]"}
  got = _exported(["-n", "2", "--launcher", "mpirun", "--", "hostname"], slurm_env)
  assert got["MASTER_ADDR"] == "gpu3"
  # The flags, then the user's own variables, win.
  got = _exported(
    ["-n", "2", "--master-addr", "h0", "--master-port", "1234", "--", "hostname"],
    {**env, "MASTER_ADDR": "mine", "MASTER_PORT": "99"},
  )
  assert (got["MASTER_ADDR"], got["MASTER_PORT"]) == ("h0", "1234")
  got = _exported(
    ["-n", "2", "--", "hostname"], {**env, "MASTER_ADDR": "mine", "MASTER_PORT": "99"}
  )
  assert (got["MASTER_ADDR"], got["MASTER_PORT"]) == ("mine", "99")
  # After hosts were dropped, rank 0 runs on the first host left.
  plan = common.Plan(np=2, attempt=1, hosts=(("n2", 2),))
  got = _exported(["-n", "4", "--hosts", "n1:2,n2:2", "--", "hostname"], env, plan)
  assert got["MASTER_ADDR"] == "n2" and got["MPIJAX_RESTART_ATTEMPT"] == "1"


def test_restart_attempt_and_jax_coordinator_are_exported():
  env = {
    "PATH": "/usr/bin",
    "JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234",
    "MPIJAX_RESTART_ATTEMPT": "7",
  }
  got = _exported(["-n", "2", "--", "hostname"], env)
  assert got["JAX_COORDINATOR_ADDRESS"] is None  # forwarded as set
  assert got["MPIJAX_RESTART_ATTEMPT"] == "0"  # ours, not an outer job's
  assert got["MPIJAX_RUN"] == "1"  # the ranks leave their own rank tags out


def test_jax_and_xla_settings_reach_every_host():
  env = {
    "PATH": "/usr/bin",
    "JAX_PLATFORMS": "cpu",
    "JAX_ENABLE_X64": "1",
    "XLA_FLAGS": "--xla_cpu_enable_fast_math=false --xla_backend_optimization_level=2",
    "XLAFLAGS": "not XLA's",
    "MY_JAX_THING": "not JAX's",
  }
  got = _exported(["-n", "4", "--hosts", "a:2,b:2", "--", "hostname"], env)
  # Open MPI: exported by name, with the value the ranks' environment had here
  # (and the job's compile cache, which mpijax-run names).
  got.pop("JAX_COMPILATION_CACHE_DIR")
  assert {k: v for k, v in got.items() if k.startswith(("JAX", "XLA", "MY_"))} == {
    "JAX_PLATFORMS": None,
    "JAX_ENABLE_X64": None,
    "XLA_FLAGS": None,
  }
  # srun and Hydra pass the whole environment on (--export=ALL, Hydra's default).
  opts = cli.parse_args(["-n", "2", "--launcher", "srun", "--", "hostname"])
  srun = commands.build_command(opts, _sit({**env, "SLURM_JOB_ID": "1", "SLURM_NTASKS": "2"}))
  assert [a for a in srun if a.startswith("--export=")][0].startswith("--export=ALL,")


def test_dropped_hosts_replace_the_hostfile(tmp_path):
  hf = tmp_path / "hosts"
  hf.write_text("a slots=2\nb slots=2\n")
  opts = cli.parse_args(["-n", "4", "--hostfile", str(hf), "--", "hostname"])
  cmd = commands.build_command(
    opts, _sit({"PATH": "/usr/bin"}), common.Plan(np=2, hosts=(("a", 2),))
  )
  assert "--hostfile" not in cmd and cmd[cmd.index("--host") + 1] == "a:2"
  assert cmd[cmd.index("-n") + 1] == "2" and "--oversubscribe" not in cmd


@pytest.mark.parametrize(
  "argv,message",
  [
    (["-n", "2", "--tee", "--", "x"], "--log-dir"),
    (["-n", "2", "--max-restarts", "-1", "--", "x"], "0 or more"),
    (["-n", "2", "--restart-backoff", "-1", "--", "x"], "0 or more"),
    (["-n", "2", "--min-ranks", "1", "--max-restarts", "1", "--", "x"], "--hosts or --hostfile"),
    (["-n", "2", "--hosts", "a:2", "--min-ranks", "1", "--", "x"], "--max-restarts"),
    (
      ["-n", "2", "--hosts", "a:2", "--min-ranks", "3", "--max-restarts", "1", "--", "x"],
      "more than -n 2",
    ),
    (["-n", "2", "--min-ranks", "0", "--", "x"], "at least 1"),
    (["-n", "2", "--master-port", "70000", "--", "x"], "1..65535"),
  ],
)
def test_bad_new_arguments(argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    cli.parse_args(argv)
  assert e.value.code == 2
  assert message in capsys.readouterr().err


def test_jax_coordinator_address_setting(monkeypatch):
  monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
  assert config.get("jax_coordinator_address") == ""
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.1.2.3:4567")
  assert config.get("jax_coordinator_address") == "10.1.2.3:4567"
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.1.2.3")
  with pytest.raises(
    ValueError, match="JAX_COORDINATOR_ADDRESS='10.1.2.3' is not valid.*host:port"
  ):
    config.get("jax_coordinator_address")
  assert "`JAX_COORDINATOR_ADDRESS`" in config.markdown_table()
  monkeypatch.setenv("MPIJAX_RESTART_ATTEMPT", "2")
  assert config.get("restart_attempt") == 2
  monkeypatch.setenv("MPIJAX_RESTART_ATTEMPT", "-1")
  with pytest.raises(ValueError, match="MPIJAX_RESTART_ATTEMPT"):
    config.get("restart_attempt")


# --- restart policy -----------------------------------------------------------------


def _reasons(*launcher_lines):
  r = joblog.Reasons()
  for line in launcher_lines:
    r.launcher_line(line)
  return r


@pytest.mark.parametrize(
  "outcome,expected",
  [
    (process_group.Outcome(0), ("ok", 0)),
    (process_group.Outcome(1), ("failed", 1)),
    (process_group.Outcome(137), ("failed", 137)),
    (process_group.Outcome(75), ("preempted", 75)),
    (process_group.Outcome(130), ("interrupted", 130)),
    (process_group.Outcome(130, interrupted=signal.SIGINT), ("interrupted", 130)),
    (process_group.Outcome(143, interrupted=signal.SIGTERM), ("interrupted", 143)),
    (process_group.Outcome(124, timed_out=True), ("timeout", 124)),
  ],
)
def test_verdict(outcome, expected):
  assert restarts.verdict(outcome, joblog.Reasons()) == expected


def test_a_launcher_that_exits_zero_after_losing_a_host_failed():
  # Open MPI 5.0's prterun, when the processes of a remote host were killed (exit status 0).
  lost = _reasons(
    "------------------------------------------------------------",
    "A daemon failed to report back after being spawned. This could",
    "be due to several factors, including inability to find the",
    "back to prterun:",
    "",
    "  Local host:    ha77",
    "  Remote host:   hb77",
    "  Daemon exit status: 0",
  )
  assert restarts.verdict(process_group.Outcome(0), lost) == ("failed", 1)
  assert "lost its daemon on host hb77" in lost.summary(0)


def test_backoff_doubles_up_to_a_minute():
  assert [restarts.backoff_seconds(k, 1.0) for k in (1, 2, 3, 4)] == [1, 2, 4, 8]
  assert restarts.backoff_seconds(30, 1.0) == common.MAX_BACKOFF_SECONDS
  assert restarts.backoff_seconds(3, 0.0) == 0


# --- exit reasons from real launcher output ---------------------------------------------

# Verbatim from Open MPI 5.0.11's prterun (its message boxes wrap lines).
OMPI_KILLED = """\
--------------------------------------------------------------------------
prterun noticed that process rank 1 with PID 20196 on node vm exited on
signal 9 (Killed).
--------------------------------------------------------------------------"""
OMPI_EXIT = """\
--------------------------------------------------------------------------
prterun detected that one or more processes exited with non-zero status,
thus causing the job to be terminated. The first process to do so was:

   Process name: [prterun-vm-20198@1,1]
   Exit code:    3
--------------------------------------------------------------------------"""
OMPI_ABORT = """\
--------------------------------------------------------------------------
prterun has exited due to process rank 1 with PID 0 on node vm calling
"abort". This may have caused other processes in the application to be
terminated by signals sent by prterun (as reported here).
--------------------------------------------------------------------------"""
# MPICH 5.0's Hydra mpiexec.
HYDRA_KILLED = """
===================================================================================
=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
=   PID 29668 RUNNING AT vm
=   EXIT CODE: 9
=   CLEANING UP REMAINING PROCESSES
=   YOU CAN IGNORE THE BELOW CLEANUP MESSAGES
===================================================================================
YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)
This typically refers to a problem with your application."""
SRUN_KILLED = "srun: error: vm: task 2: Killed"
SRUN_EXIT = "srun: error: vm: tasks 0-1: Exited with exit code 75"


@pytest.mark.parametrize(
  "text,status,expected",
  [
    (
      OMPI_KILLED,
      137,
      "rank 1 on node vm was killed by signal 9 (Killed); exit status 137 (signal 9, SIGKILL)",
    ),
    (OMPI_EXIT, 3, "rank 1 exited with status 3; exit status 3"),
    (OMPI_ABORT, 1, "rank 1 on node vm called MPI_Abort; exit status 1"),
    (SRUN_KILLED, 137, "task 2 on node vm: killed; exit status 137 (signal 9, SIGKILL)"),
    (SRUN_EXIT, 75, "task 0-1 on node vm: exited with exit code 75; exit status 75"),
    (HYDRA_KILLED, 9, "a rank on node vm: exit code: 9 (killed (signal 9)); exit status 9"),
    (
      "=   RANK 3 PID 1 RUNNING AT n7\n=   KILLED BY SIGNAL: 9 (Killed)",
      9,
      "rank 3 on node n7: killed by signal: 9 (killed); exit status 9",
    ),
    ("something else", 5, "exit status 5"),
  ],
)
def test_launcher_reasons(text, status, expected):
  assert _reasons(*text.splitlines()).summary(status) == expected


def test_uncaught_exception_and_stall_reasons():
  r = _reasons(*OMPI_ABORT.splitlines())
  for line in [
    "[rank 2/4] mpijax: uncaught ValueError on rank 2/4; aborting the whole job (exit code 1).",
    "[rank 2/4] Traceback (most recent call last):",
    '[rank 2/4]   File "x.py", line 3, in <module>',
    "[rank 2/4] ValueError: bad batch",
  ]:
    r.rank_line(line)
  assert r.summary(1) == (
    "rank 1 on node vm called MPI_Abort; rank 2: uncaught ValueError: bad batch; exit status 1"
  )
  s = joblog.Reasons()
  s.rank_line(
    "mpijax: stall: rank 0 waited 60.0 s in mpijax.ops.allreduce ... Not arrived: rank 3."
  )
  assert s.summary(1).startswith("stall: rank 0 waited 60.0 s")


# --- the relay ------------------------------------------------------------------------


def test_relay_splits_ranks_into_logs_and_keeps_the_launchers_lines(tmp_path):
  out, err = io.BytesIO(), io.BytesIO()
  relay = joblog.Relay("openmpi", str(tmp_path), tee=False, stdout=out, stderr=err)
  relay.begin(0, 2)
  relay._lines([b"[1,0]<stdout>: hello 0\n", b"[1,1]<stderr>: oops 1\n", b"launcher says\n"], out)
  relay.begin(1, 2)
  relay._lines([b"[1,1]<stdout>: again\n"], out)
  relay.note("mpijax-run: a note")
  relay.close()
  r0 = (tmp_path / "rank_0.log").read_text().splitlines()
  r1 = (tmp_path / "rank_1.log").read_text().splitlines()
  assert r0[0].startswith("===== mpijax-run attempt 0: 2 ranks") and r0[1] == "hello 0"
  assert r1[1] == "oops 1" and r1[2].startswith("===== mpijax-run attempt 1") and r1[3] == "again"
  assert out.getvalue() == b"launcher says\n"  # no --tee: only the launcher's lines on the console
  own = (tmp_path / "mpijax-run.log").read_text()
  assert "launcher says" in own and "a note" in own and err.getvalue() == b"mpijax-run: a note\n"


@pytest.mark.parametrize(
  "kind,line,rank,text",
  [
    ("openmpi", b"[1,12]<stdout>: x y\n", 12, b"x y\n"),
    ("openmpi", b"[1,3]<stderr>:x\n", 3, b"x\n"),  # Open MPI 4's --tag-output
    ("mpich", b"[5] x\n", 5, b"x\n"),
    ("srun", b" 7: x\n", 7, b"x\n"),
    ("openmpi", b"prterun noticed that\n", None, b"prterun noticed that\n"),
  ],
)
def test_split_tag(kind, line, rank, text):
  assert joblog.split_tag(kind, line) == (rank, text)


def test_hydra_pieces_of_lines_go_to_their_ranks(tmp_path):
  # Hydra tags each piece it reads (unbuffered prints), and pieces of two ranks can share a line:
  # verbatim from MPICH 5.0's mpiexec with PYTHONUNBUFFERED=1.
  out = io.BytesIO()
  relay = joblog.Relay("mpich", str(tmp_path), stdout=out, stderr=io.BytesIO())
  relay.begin(0, 2)
  hydra = joblog.HydraDemux()
  hydra.ranks = 2
  relay._lines(
    [
      b"[1] RANK[1]  [1] 1[1]  [1] LOCAL_RANK\n",
      b"[0] RANK[1] RANK 1 again\n",
      b"[0]  0 done [7] literally\n",
      b"[0] unfinished",
    ],
    out,
    hydra,
  )
  relay._lines([], out, hydra, final=True)
  relay.close()
  assert (tmp_path / "rank_1.log").read_text().splitlines()[1:] == [
    "RANK 1 LOCAL_RANK",
    "RANK 1 again",
  ]
  assert (tmp_path / "rank_0.log").read_text().splitlines()[1:] == [
    "RANK 0 done [7] literally",
    "unfinished",
  ]
  assert out.getvalue() == b""  # no --tee


@pytest.mark.parametrize(
  "kind,lines",
  [
    ("srun", [b"0: a\n", b"1: b\n"]),
    ("openmpi", [b"[1,0]<stdout>: a\n", b"[1,1]<stdout>: b\n"]),
  ],
)
def test_relay_tee_shows_one_prefix_per_line(tmp_path, kind, lines):
  out = io.BytesIO()
  relay = joblog.Relay(kind, str(tmp_path), tee=True, stdout=out, stderr=io.BytesIO())
  relay._lines(lines, out)
  relay.close()
  assert out.getvalue() == b"[rank0]: a\n[rank1]: b\n"  # the launcher's own tag replaced
  assert (tmp_path / "rank_1.log").read_text() == "b\n"


def test_a_bar_redrawn_in_place_shows_its_last_state_after_one_prefix(tmp_path):
  out = io.BytesIO()
  relay = joblog.Relay("openmpi", str(tmp_path), tee=True, stdout=io.BytesIO(), stderr=out)
  relay._lines([b"[1,0]<stderr>: \rstep 1/4\rstep 2/4\rstep 4/4\n"], out)
  relay.close()
  assert out.getvalue() == b"[rank0]: step 4/4\n"
  assert (tmp_path / "rank_0.log").read_bytes() == b"\rstep 1/4\rstep 2/4\rstep 4/4\n"


def test_hydra_pieces_are_shown_as_whole_lines_each_with_its_rank():
  out = io.BytesIO()
  relay = joblog.Relay("mpich", None, stdout=out, stderr=io.BytesIO())
  hydra = joblog.HydraDemux()
  hydra.ranks = 2
  relay._lines(
    [b"[1] RANK[1]  [1] 1\n", b"[0] RANK[1] again\n", b"[0]  0\n", b"[1] end"], out, hydra
  )
  relay._lines([], out, hydra, final=True)
  assert out.getvalue() == b"[rank1]: RANK 1\n[rank1]: again\n[rank0]: RANK 0\n[rank1]: end\n"


def _block(rank: int, message: str, own_tag: bool = False) -> list[bytes]:
  """A rank's report of an uncaught exception: under mpijax-run without the rank's own
  tag on each line, under plain mpirun (``own_tag``) with it."""
  tag, p = f"[1,{rank}]<stderr>: ".encode(), f"[rank {rank}/4] ".encode() if own_tag else b""
  return [
    tag
    + p
    + f"mpijax: uncaught OSError on rank {rank}/4, aborting the job (exit code 1): "
    f"{message}\n".encode(),
    tag + p + b"Traceback (most recent call last):\n",
    tag + p + b'  File "err.py", line 7, in <module>\n',
    tag + p + f"OSError: {message}\n".encode(),
  ]


def _shown(lines: list[bytes]) -> list[str]:
  """Lines of the launcher (Open MPI tags) as mpijax-run's console shows them."""
  out = []
  for b in lines:
    rank, text = joblog.split_tag("openmpi", b)
    out.append((f"[rank{rank}]: " + text.decode()).rstrip("\n"))
  return out


@pytest.mark.parametrize("own_tag", [False, True])
def test_a_failure_reaches_the_console_as_one_block_and_the_logs_whole(tmp_path, own_tag):
  err = io.BytesIO()
  relay = joblog.Relay("openmpi", str(tmp_path), tee=True, stdout=io.BytesIO(), stderr=err)
  relay.begin(0, 4)
  box = [
    b"[1,1]<stderr>: -------------------------\n",
    b"[1,1]<stderr>: MPI_ABORT was invoked on rank 1 in communicator MPI_COMM_WORLD\n",
    b"[1,1]<stderr>:   Errorcode: 1\n",
    b"[1,1]<stderr>: -------------------------\n",
    b"[1,1]<stderr>: \x00\n",
  ]
  launcher_box = [
    b"-------------------------\n",
    b"prterun has exited due to process rank 1 with PID 0 on node vm calling\n",
    b'"abort". This may have caused other processes in the application to be\n',
    b"-------------------------\n",
  ]
  noise = [
    b"[1,3]<stderr>: Additional GRPC error information from remote target "
    b"coordination_service while calling /xla.coordination.CoordinationService/PollForError:\n",
    b"[1,3]<stderr>: E1127 11:02:33.123456   4242 client.cc:123] Terminating process because "
    b"the JAX distributed service detected fatal errors.\n",
  ]
  p = b"[rank 2/4] " if own_tag else b""
  other = [
    b"[1,2]<stderr>: " + p + b"mpijax: uncaught JaxRuntimeError on rank 2/4, aborting the "
    b"job (exit code 1): UNAVAILABLE: the coordinator is gone\n",
    b"[1,2]<stderr>: " + p + b"Traceback (most recent call last):\n",
  ]
  # A line of rank 1's report that looks like JAX's teardown: shown, it is the report's.
  first = _block(1, "it exists", own_tag)
  first.insert(
    3,
    b"[1,1]<stderr>: "
    + (b"[rank 1/4] " if own_tag else b"")
    + b"    client.wait('CoordinationService')\n",
  )
  relay._lines(
    first
    + box
    + _block(0, "it exists", own_tag)
    + noise
    + other
    + launcher_box
    + ([b"[1,0]<stderr>: -----\n", b"[1,0]<stderr>: a rank's own line\n"] if own_tag else []),
    err,
  )
  relay._lines([], err, final=True)
  relay.close()
  shown = err.getvalue().decode().splitlines()
  # Rank 0's lines after its report (plain mpirun: without its tag) are its own.
  after = ["[rank0]: -----", "[rank0]: a rank's own line"] if own_tag else []
  assert shown == _shown(first) + _shown(other[:1]) + after
  assert all(line.startswith("[rank") and "<stderr>" not in line for line in shown), shown
  # The logs keep every line, without Open MPI's NUL.
  rank1 = (tmp_path / "rank_1.log").read_bytes()
  assert b"MPI_ABORT was invoked" in rank1 and b"\0" not in rank1
  assert b"prterun has exited" in (tmp_path / "mpijax-run.log").read_bytes()
  summary = relay.reasons.summary(1)
  assert "rank 1: uncaught OSError: it exists (ranks 0-1 alike)" in summary, summary


def test_other_boxes_of_the_launcher_are_shown():
  f = joblog.ConsoleFilter()
  box = [
    b"----------------------------\n",
    b"ssh: connect to host n2 port 22: refused\n",
    b"----------------------------\n",
  ]
  assert [line for b in box for line in f.launcher_line(b.decode().rstrip(), b)] == box


# --- dropping hosts before a restart ------------------------------------------------------


def _fake_mpirun(tmp_path, bad_hosts):
  """An "mpirun" that fails like Open MPI does when ssh cannot reach one of ``bad_hosts``."""
  cases = "\n".join(
    f'  *"--host {h}:1"*) echo "ssh: connect to host {h} port 22: No route to host" >&2\n'
    f'    printf -- "-----\\nA daemon failed to report back\\n  Remote host: {h}\\n-----\\n"; '
    f"exit 255 ;;"
    for h in bad_hosts
  )
  path = tmp_path / "mpirun"
  path.write_text(f'#!/bin/sh\ncase "$*" in\n{cases}\nesac\nexit 0\n')
  path.chmod(0o755)
  return str(path)


def test_preflight_names_the_hosts_that_cannot_start_a_process(tmp_path):
  mpirun = _fake_mpirun(tmp_path, ["b"])
  opts = cli.parse_args(
    [
      "-n",
      "4",
      "--hosts",
      "a:2,b:2",
      "--max-restarts",
      "1",
      "--min-ranks",
      "2",
      "--mpirun",
      mpirun,
      "--",
      "python",
      "x.py",
    ]
  )
  sit = Situation(
    env={"PATH": "/usr/bin"},
    euid=1000,
    local_slots=2,
    mpi=OMPI5,
    mpirun=mpirun,
    mpirun_flavor="openmpi",
  )
  got = restarts.preflight(opts, sit, [("a", 2), ("b", 2)])
  assert got["a"] is None
  assert got["b"].startswith("the launcher lost its daemon on host b") and got["b"].endswith(
    "ssh: connect to host b port 22: No route to host"
  ), got
  relay = joblog.Relay("openmpi", None, stdout=io.BytesIO(), stderr=io.BytesIO())
  plan, problem = restarts._next_plan(opts, sit, common.Plan(np=4), hosts.hosts_of(opts), relay)
  assert problem is None and (plan.np, plan.attempt, plan.hosts) == (2, 1, (("a", 2),))
  assert b"dropping host b" in relay.stderr.getvalue()
  # Below --min-ranks: no restart.
  opts4 = dataclasses.replace(opts, min_ranks=3)
  _, problem = restarts._next_plan(opts4, sit, common.Plan(np=4), hosts.hosts_of(opts), relay)
  assert problem == "2 slot(s) left on a:2, fewer than --min-ranks 3"
  # Every host fine: the next attempt keeps the command line's hosts and rank count.
  ok = dataclasses.replace(opts, mpirun=_fake_mpirun(tmp_path, []))
  plan, problem = restarts._next_plan(ok, sit, common.Plan(np=4), hosts.hosts_of(opts), relay)
  assert problem is None and (plan.np, plan.hosts) == (4, None)


def test_usr1_during_the_back_off_ends_the_job_as_preempted(tmp_path):
  # An "mpirun" that always fails, a long back-off, and USR1 (Slurm's warning) meanwhile.
  fail = tmp_path / "mpirun"
  fail.write_text("#!/bin/sh\necho 'rank 1 failed' >&2\nexit 3\n")
  fail.chmod(0o755)
  logs = tmp_path / "logs"
  proc = subprocess.Popen(
    [
      sys.executable,
      "-m",
      "mpijax.launch",
      "-n",
      "2",
      "--max-restarts",
      "3",
      "--restart-backoff",
      "30",
      "--mpirun",
      str(fail),
      "--log-dir",
      str(logs),
      "--",
      "true",
    ],
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  try:
    end = time.monotonic() + 60
    while time.monotonic() < end and "restart 1 of 3 in 30 s" not in _read(logs / "mpijax-run.log"):
      time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=20)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert proc.returncode == common.PREEMPTED_EXIT_CODE, out + err
  assert "got SIGUSR1 before the restart; not restarting, exit 75" in err, err
  attempts = (logs / "attempts.jsonl").read_text().splitlines()
  assert len(attempts) == 1 and json.loads(attempts[0])["status"] == 3


def _read(path):
  try:
    return path.read_text()
  except OSError:
    return ""
