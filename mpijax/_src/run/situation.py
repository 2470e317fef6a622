"""The facts about the machine that decide the launcher's flags: environment,
user, cores, the MPI library and its launcher, the bridge for XLA's collectives."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys

from mpijax._src.ffi import bridge_env
from mpijax._src.run.common import PROG
from mpijax._src.run.common import LaunchError
from mpijax._src.run.common import Options
from mpijax._src.run.hosts import local_slots
from mpijax._src.run.mpi_probe import MPIInfo
from mpijax._src.run.mpi_probe import find_mpirun
from mpijax._src.run.mpi_probe import launcher_flavor
from mpijax._src.run.mpi_probe import probe_mpi


@dataclasses.dataclass(frozen=True)
class Situation:
  """Facts about the machine that decide the flags (surveyed by :func:`survey`, injectable in tests)."""

  env: dict[str, str]
  euid: int
  local_slots: int
  mpi: MPIInfo | None = None  # None when launching with srun needs no MPI probe
  mpirun: str | None = None
  mpirun_flavor: str | None = None
  # MPITRAMPOLINE_LIB for the ranks: mpijax's bridge for XLA's MPI collectives.
  bridge: str | None = None
  # Whether this machine has a device a libfabric provider drives (has_fabric).
  fabric: bool = True


# Where libfabric's high-speed providers find their devices: verbs and EFA
# (/sys/class/infiniband), Slingshot (cxi), Omni-Path (hfi1).
_FABRIC_DIRS = ("sys/class/infiniband", "sys/class/cxi", "dev/infiniband")
_FABRIC_DEVICES = ("hfi1_", "cxi")


def has_fabric(root: str = "/") -> bool:
  """Whether this machine has an RDMA or HPC fabric device (without one: TCP and shared memory)."""
  for d in _FABRIC_DIRS:
    try:
      if os.listdir(os.path.join(root, d)):
        return True
    except OSError:
      pass
  try:
    return any(n.startswith(_FABRIC_DEVICES) for n in os.listdir(os.path.join(root, "dev")))
  except OSError:
    return True  # cannot tell: leave Open MPI's choice alone


def in_slurm_allocation(env: dict[str, str]) -> bool:
  """Inside ``salloc``/``sbatch`` but not already inside an ``srun`` step."""
  return (
    bool(env.get("SLURM_JOB_ID")) and not env.get("SLURM_STEP_ID") and not env.get("SLURM_STEPID")
  )


def choose_launcher(opts: Options, env: dict[str, str]) -> str:
  """``srun`` inside a Slurm allocation (not in a step), else ``mpirun``; --launcher wins."""
  if opts.launcher != "auto":
    return opts.launcher
  if opts.mpirun:
    return "mpirun"
  if in_slurm_allocation(env) and shutil.which("srun", path=env.get("PATH")):
    return "srun"
  return "mpirun"


def _bridge_for(opts: Options, env: dict[str, str]) -> str | None:
  """The bridge library the ranks should load for XLA's MPI collectives, if any."""
  if opts.np == 1:
    return None
  try:
    from mpijax._src import config

    chosen = dict(env)
    ok, _ = bridge_env.select(
      bridge_env.installed_bridge(),
      environ=chosen,
      collectives=config.get("xla_collectives", env),
      distributed=config.get("jax_distributed", env),
      need_launcher=False,
    )
  except ValueError as e:  # a malformed MPIJAX_* value
    raise LaunchError(str(e)) from None
  # The ranks say why not, when they choose gloo.
  return chosen[bridge_env.ENV] if ok and bridge_env.ENV not in env else None


def survey(opts: Options, env: dict[str, str] | None = None) -> Situation:
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
      print(
        f"{PROG}: warning: {mpirun} is {flavor}, but mpi4py loads {mpi.flavor} "
        f"({mpi.library_path}); ranks will likely not see each other.",
        file=sys.stderr,
      )
  return Situation(
    env=env,
    euid=os.geteuid(),
    local_slots=local_slots(),
    mpi=mpi,
    mpirun=mpirun,
    mpirun_flavor=flavor,
    bridge=_bridge_for(opts, env),
    fabric=has_fabric(),
  )
