"""The ``mpijax-run`` command line: parse it, survey the machine, run the job."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Mapping, Sequence

from mpijax._src import config
from mpijax._src.run.commands import build_command
from mpijax._src.run.common import DEVICES_ENV
from mpijax._src.run.common import DOCTOR_FAILED
from mpijax._src.run.common import DOCTOR_TIMEOUT
from mpijax._src.run.common import MAX_BACKOFF_SECONDS
from mpijax._src.run.common import PROG
from mpijax._src.run.common import LaunchError
from mpijax._src.run.common import Options
from mpijax._src.run.program import is_python
from mpijax._src.run.restarts import supervise
from mpijax._src.run.situation import choose_launcher
from mpijax._src.run.situation import survey


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
    f"  {PROG} -n 8 --hostfile hosts.txt --doctor                # check the setup first\n"
    "Exit status: the launcher's (the failing rank's), 124 after --timeout, 128+N after "
    "signal N, 75 when the program was preempted (it exits 75 after a checkpoint).",
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument("-n", "-np", "--np", dest="np", type=int, metavar="N", help="number of ranks")
  p.add_argument(
    "--devices-per-process",
    type=int,
    metavar="K",
    help=f"CPU devices per rank (exports {DEVICES_ENV}=K to every rank)",
  )
  hosts = p.add_mutually_exclusive_group()
  hosts.add_argument(
    "--hostfile", metavar="F", help="hostfile (Open MPI 'host slots=N' or Hydra 'host:N')"
  )
  hosts.add_argument("--hosts", metavar="H:S,...", help="hosts with slots, e.g. node1:4,node2:4")
  p.add_argument(
    "--timeout",
    type=float,
    metavar="S",
    help="kill the job after S seconds, restarts included (exit 124)",
  )
  p.add_argument("--dry-run", action="store_true", help="print the command and exit")
  p.add_argument(
    "--doctor",
    action="store_true",
    help="start the ranks as the job would, but run mpijax's checks and all-reduce "
    "measurements instead of PROGRAM (which may be left out), print the report, and exit "
    f"non-zero ({DOCTOR_FAILED}) if a check failed",
  )
  p.add_argument(
    "--launcher",
    choices=("auto", "mpirun", "srun"),
    default="auto",
    help="auto: srun inside a Slurm allocation, else mpirun (default)",
  )
  p.add_argument(
    "--mpirun", metavar="PATH", help="the mpirun/mpiexec to use instead of the detected one"
  )
  p.add_argument(
    "--launcher-args",
    metavar="'ARGS'",
    default="",
    help="extra arguments for the launcher, one shell-quoted string",
  )
  p.add_argument(
    "--rank-wrapper",
    metavar="'CMD'",
    default="",
    help="command each rank runs the program through, e.g. launch/gpu-per-rank.sh "
    "(the Python wrapper still applies to PROGRAM)",
  )
  p.add_argument(
    "--no-wrap",
    action="store_true",
    help="run PROGRAM exactly as given: no 'python -m mpijax', no RANK/LOCAL_RANK/"
    "WORLD_SIZE/LOCAL_WORLD_SIZE",
  )
  logs = p.add_argument_group("logs")
  logs.add_argument(
    "--log-dir",
    metavar="DIR",
    help="write each rank's output to DIR/rank_<r>.log (appended, one header per "
    "attempt), the launcher's to DIR/mpijax-run.log, the attempts to "
    "DIR/attempts.jsonl; the console shows only the launcher's lines",
  )
  logs.add_argument(
    "--tee", action="store_true", help="with --log-dir: also show the ranks' output on the console"
  )
  restarts = p.add_argument_group("restarts")
  restarts.add_argument(
    "--max-restarts",
    type=int,
    default=0,
    metavar="N",
    help="relaunch the job after a failure (a rank killed, a non-zero exit, "
    "a stall abort) up to N times; a clean exit, Ctrl-C, --timeout and "
    "exit status 75 (preempted) are never restarted (default 0)",
  )
  restarts.add_argument(
    "--restart-backoff",
    type=float,
    default=1.0,
    metavar="S",
    help="seconds before the first restart, doubling for each further one, "
    f"at most {MAX_BACKOFF_SECONDS:g} (default 1)",
  )
  restarts.add_argument(
    "--min-ranks",
    type=int,
    metavar="M",
    help="with --hosts/--hostfile: before a restart, drop the hosts that "
    "cannot start a process and go on with fewer ranks while at least "
    "M remain",
  )
  torch = p.add_argument_group("torchrun-style variables")
  torch.add_argument(
    "--master-addr", metavar="HOST", help="MASTER_ADDR for every rank (default: rank 0's host)"
  )
  torch.add_argument(
    "--master-port",
    type=int,
    metavar="PORT",
    help="MASTER_PORT for every rank (default: a free port)",
  )
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
    program = argv[cut + 1 :]
  else:
    ns = parser.parse_args(argv)
    program = ns.program
  if ns.doctor:
    program = doctor_program(program)
  if not program:
    parser.error("no PROGRAM given; e.g. mpijax-run -n 4 -- python train.py")
  for name, value in (
    ("-n", ns.np),
    ("--devices-per-process", ns.devices_per_process),
    ("--min-ranks", ns.min_ranks),
  ):
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
  if ns.doctor and ns.max_restarts:
    parser.error("--doctor runs once: drop --max-restarts")
  return Options(
    np=ns.np,
    program=program,
    devices_per_process=ns.devices_per_process,
    hostfile=ns.hostfile,
    hosts=ns.hosts,
    timeout=ns.timeout if ns.timeout is not None or not ns.doctor else DOCTOR_TIMEOUT,
    dry_run=ns.dry_run,
    launcher=ns.launcher,
    mpirun=ns.mpirun,
    launcher_args=shlex.split(ns.launcher_args),
    wrap=not ns.no_wrap,
    rank_wrapper=shlex.split(ns.rank_wrapper),
    log_dir=ns.log_dir,
    tee=ns.tee,
    max_restarts=ns.max_restarts,
    restart_backoff=ns.restart_backoff,
    min_ranks=ns.min_ranks,
    master_addr=ns.master_addr,
    master_port=ns.master_port,
    doctor=ns.doctor,
  )


def doctor_program(program: Sequence[str]) -> list[str]:
  """What every rank runs under ``--doctor``: ``python -m mpijax doctor``, with the
  job's own Python when PROGRAM names one, else this one."""
  python = program[0] if program and is_python(program[0]) else sys.executable
  return [python, "-m", "mpijax", "doctor"]


def check_settings(env: Mapping[str, str]) -> None:
  """Every ``MPIJAX_*`` variable the ranks will get, checked before any rank starts:
  a value that does not parse is a :class:`LaunchError`; a name that is no
  setting, one warning line naming the closest."""
  bad = config.problems(env)
  if bad:
    raise LaunchError("; ".join(bad) + " (docs/configuration.md lists the settings)")
  for name, closest in config.unknown(env):
    print(f"{PROG}: warning: {config.unknown_message(name, closest)}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point of ``mpijax-run``; returns the exit status."""
  argv = sys.argv[1:] if argv is None else argv
  opts = parse_args(argv)
  try:
    check_settings(os.environ)
    if opts.np is None and choose_launcher(opts, dict(os.environ)) != "srun":
      raise LaunchError(
        "give the number of ranks with -n N (e.g. mpijax-run -n 4 -- python train.py)"
      )
    sit = survey(opts)
    cmd = build_command(opts, sit)
    if opts.dry_run:
      print(shlex.join(cmd))
      return 0
    return supervise(opts, sit)
  except LaunchError as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 2
