"""What every part of ``mpijax-run`` shares: its constants, ``LaunchError``,
the parsed command line and the plan of one attempt."""

from __future__ import annotations

import dataclasses
import os

PROG = "mpijax-run"

# Seconds between forwarding SIGTERM/SIGINT to the launcher and SIGKILL of
# everything left: long enough for mpirun to tear down remote daemons.
GRACE_SECONDS = 5.0

TIMEOUT_EXIT_CODE = 124  # like timeout(1)

DEVICES_ENV = "MPIJAX_DEVICES_PER_PROCESS"

RESTART_ENV = "MPIJAX_RESTART_ATTEMPT"

# Tells every rank that mpijax-run prefixes its lines with the rank and
# checked the MPIJAX_* settings (config.py's "run").
RUN_ENV = "MPIJAX_RUN"

COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"

# EX_TEMPFAIL (sysexits.h): the program was preempted, saved its state and
# asks to be run again later (Slurm: requeued). Never restarted here.
PREEMPTED_EXIT_CODE = 75

MAX_BACKOFF_SECONDS = 60.0

# mpijax-run --doctor: the status of a report with a failed check (the doctor's
# FAILED), and the job's --timeout unless one is given.
DOCTOR_FAILED = 3
DOCTOR_TIMEOUT = 180.0

# Seconds a host gets to start one process before a restart drops it (--min-ranks).
PREFLIGHT_SECONDS = 30.0


def started_as_launcher(orig_argv: list[str]) -> bool:
  """Whether the interpreter with command line ``orig_argv`` (``sys.orig_argv``) was
  started to run ``mpijax-run`` or ``python -m mpijax.launch`` itself, not a rank."""
  args = iter(orig_argv[1:])
  for arg in args:
    if arg in ("-X", "-W"):
      next(args, None)  # the option's value
    elif arg.startswith("-m"):
      return (arg[2:] or next(args, "")) == "mpijax.launch"
    elif arg == "-c":
      return False
    elif not arg.startswith("-"):
      return os.path.basename(arg) == PROG  # the console script
  return False


class LaunchError(Exception):
  """A problem with the command line or the environment, reported without a traceback."""


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
  doctor: bool = False


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
  job_files: str | None = None  # where the ranks note their shared-memory files (shm.py)
  arrivals: bool = False  # the ranks get MPIJAX_ARRIVALS from the launcher's environment
