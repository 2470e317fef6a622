"""The command line of each launcher: Open MPI's ``mpirun``, Hydra's ``mpiexec``
(MPICH, Intel MPI, MVAPICH) and ``srun``, with what every rank must see exported."""

from __future__ import annotations

import shutil
import socket
import sys

from mpijax._src import config
from mpijax._src import heap
from mpijax._src.ffi import bridge_env
from mpijax._src.run.arrivals import ENV as ARRIVALS_ENV
from mpijax._src.run.common import COORDINATOR_ENV
from mpijax._src.run.common import DEVICES_ENV
from mpijax._src.run.common import RESTART_ENV
from mpijax._src.run.common import RUN_ENV
from mpijax._src.run.common import LaunchError
from mpijax._src.run.common import Options
from mpijax._src.run.common import Plan
from mpijax._src.run.hosts import host_list
from mpijax._src.run.hosts import hosts_of
from mpijax._src.run.hosts import parse_hosts
from mpijax._src.run.program import rank_program
from mpijax._src.run.shm import JOB_FILES_ENV
from mpijax._src.run.situation import Situation
from mpijax._src.run.situation import choose_launcher
from mpijax._src.xla import compile_cache


def output_kind(opts: Options, sit: Situation) -> str:
  """How the launcher tags the ranks' lines: "openmpi", "mpich" or "srun"."""
  if choose_launcher(opts, sit.env) == "srun":
    return "srun"
  flavor = sit.mpirun_flavor or (sit.mpi.flavor if sit.mpi else "unknown")
  return "mpich" if flavor == "mpich" else "openmpi"


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
    elif sit.env.get("SLURM_JOB_ID") and (
      sit.env.get("SLURM_JOB_NODELIST") or sit.env.get("SLURM_NODELIST")
    ):
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


# JAX's and XLA's own settings: Open MPI starts the ranks of other hosts with
# none of the launching shell's variables but the ones it is told to export.
FORWARDED_PREFIXES = ("MPIJAX_", "JAX_")
FORWARDED_NAMES = (COORDINATOR_ENV, "XLA_FLAGS")


def forwarded(name: str) -> bool:
  """Whether mpijax-run exports the variable ``name`` of its environment to every rank."""
  return name.startswith(FORWARDED_PREFIXES) or name in FORWARDED_NAMES


def _exports(
  env: dict[str, str], opts: Options, plan: Plan, master: tuple[str, str], bridge: str | None = None
) -> list[tuple[str, str | None]]:
  """(name, value) pairs to export to every rank; value None = export the current value."""
  explicit: dict[str, str] = {}
  if opts.devices_per_process is not None:
    explicit[DEVICES_ENV] = str(opts.devices_per_process)
  explicit[RESTART_ENV] = str(plan.attempt)
  explicit[RUN_ENV] = "1"
  explicit["MASTER_ADDR"], explicit["MASTER_PORT"] = master
  if plan.job_files:
    explicit[JOB_FILES_ENV] = plan.job_files
  # Every job a compile cache: a restart, and the next run, load what this one compiled.
  cache = compile_cache.job_directory(config.get("compile_cache", env), env)
  if cache:  # else the user's own JAX_COMPILATION_CACHE_DIR, forwarded as JAX's variables are
    explicit[compile_cache.JAX_ENV] = cache
  if "COLUMNS" not in env and sys.stdout.isatty():
    # The ranks' terminal (Open MPI's) is 0 columns wide: rank 0's progress bar takes ours.
    explicit["COLUMNS"] = str(shutil.get_terminal_size().columns)
  pairs: list[tuple[str, str | None]] = list(explicit.items())
  for name in sorted(env):
    if forwarded(name) and name not in explicit:
      pairs.append((name, None))
  if plan.arrivals:  # its key stays off the command line: exported by name
    pairs.append((ARRIVALS_ENV, None))
  # glibc reads these at process start, before any thread has its own arena.
  pairs.extend(heap.launcher_env(env))
  # jaxlib reads it when it loads, before the program's first line runs.
  if bridge_env.ENV in env:
    pairs.append((bridge_env.ENV, None))
  elif bridge:
    pairs.append((bridge_env.ENV, bridge))
  return pairs


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


def _openmpi_command(
  opts: Options, sit: Situation, plan: Plan, mpirun: str, program: list[str]
) -> list[str]:
  n = _required_np(plan)
  cmd = [mpirun, "-n", str(n)]
  if sit.euid == 0:
    cmd.append("--allow-run-as-root")
  if n > _slots(opts, sit, plan):
    cmd.append("--oversubscribe")
  if plan.hosts is not None:
    cmd += ["--host", host_list(plan.hosts)]
  elif opts.hostfile:
    cmd += ["--hostfile", opts.hostfile]
  elif opts.hosts:
    cmd += ["--host", host_list(parse_hosts(opts.hosts))]
  # Binding a rank to one core starves XLA's thread pools (and JAX's compile threads).
  cmd += ["--bind-to", "none"]
  major = sit.mpi.version[0] if sit.mpi and sit.mpi.flavor == "openmpi" else 5
  if _skip_ofi_btl(opts, sit, plan):
    # Without a fabric libfabric's btl only repeats TCP and shared memory, and
    # probing it takes ~1 s of every rank's MPI_Init (2 or 4 ranks, 2 cores).
    cmd += ["--mca", "btl", "^ofi"]
  cmd += ["--output", "tag"] if major >= 5 else ["--tag-output"]
  for name, value in _exports(sit.env, opts, plan, master_address(opts, sit, plan), sit.bridge):
    cmd += ["-x", name if value is None else f"{name}={value}"]
  cmd += opts.launcher_args
  return cmd + program


# Variables by which a batch system hands mpirun its nodes.
_ALLOCATION_VARS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "PE_HOSTFILE", "FLUX_JOB_ID")


def _skip_ofi_btl(opts: Options, sit: Situation, plan: Plan) -> bool:
  """Whether to leave out Open MPI's libfabric btl (4.1 and later): a job on this machine
  alone, which has no fabric device, and no btl choice of the user's."""
  version = sit.mpi.version if sit.mpi is not None else (0, 0)
  if sit.fabric or (version != (0, 0) and version < (4, 1)):
    return False
  if plan.hosts is not None or opts.hostfile or opts.hosts:
    return False
  if any(sit.env.get(v) for v in _ALLOCATION_VARS):
    return False
  return "OMPI_MCA_btl" not in sit.env and not any("btl" in a for a in opts.launcher_args)


def _hydra_command(
  opts: Options, sit: Situation, plan: Plan, mpirun: str, program: list[str]
) -> list[str]:
  # Hydra never refuses more ranks than slots and does not need a root flag.
  n = _required_np(plan)
  cmd = [mpirun, "-n", str(n)]
  if plan.hosts is not None:
    cmd += ["-hosts", host_list(plan.hosts)]
  elif opts.hostfile:
    cmd += ["-f", opts.hostfile]
  elif opts.hosts:
    cmd += ["-hosts", host_list(parse_hosts(opts.hosts))]
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
      "the allocated nodes. Drop them, or pass --launcher mpirun to use mpirun in the allocation."
    )
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
  exports = [
    (k, v)
    for k, v in _exports(sit.env, opts, plan, master_address(opts, sit, plan), sit.bridge)
    if v is not None
  ]
  for k, v in exports:
    if "," in v:
      raise LaunchError(
        f"{k}={v!r} contains a comma, which srun --export cannot pass on; "
        f"export {k} in the batch script instead."
      )
  cmd.append("--export=" + ",".join(["ALL"] + [f"{k}={v}" for k, v in exports]))
  cmd += opts.launcher_args
  return cmd + program
