"""What one rank finds out about its own setup, as plain data every rank gathers.

:func:`before_init` reads what needs no MPI (the launcher and its variables,
the cores this rank may use, ``/dev/shm``, Yama's ptrace setting), and
:func:`after_init` what the running job shows (the MPI library and the
extension built for it, the bridge for XLA's collectives, the devices, MPI's
shared-memory segments, the compile cache's directory, JAX's distributed
runtime). Nothing here judges: :mod:`verdicts` does.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from typing import Any

from mpijax._src import cluster
from mpijax._src import config
from mpijax._src import mpi_util
from mpijax._src.ffi import bridge_env

SHM_DIR = "/dev/shm"
YAMA = "/proc/sys/kernel/yama/ptrace_scope"

# What the launchers say that mpijax reads beyond the detector's integer
# fields (Open MPI 5's marker, srun's node list, Hydra's proxy variables).
_MARKERS = (
  "PRTE_LAUNCHED",
  "OMPI_MCA_orte_launch",
  "SLURM_JOB_ID",
  "SLURM_STEP_ID",
  "PMI_SIZE",
  "PMIX_RANK",
  "HYDI_CONTROL_FD",
)


def _launcher() -> dict[str, Any]:
  """The detector that claims this process, and the variables it reads that are set."""
  for cls in cluster.registered():
    if cls.name in ("mpi", "single"):
      continue
    try:
      present = cls.is_env_present()
    except ValueError:
      present = False
    if not present:
      continue
    names = []
    for var in cls.env_vars.values():
      names += list(var) if isinstance(var, tuple) else [var]
    names += list(_MARKERS)
    return {
      "launcher": cls.name,
      "variables": sorted({n for n in names if n in os.environ}),
      "hint": cls.env_hint,
    }
  return {"launcher": "", "variables": [], "hint": ""}


def _shm() -> dict[str, Any]:
  try:
    st = os.statvfs(SHM_DIR)
  except OSError as e:
    return {"error": f"{SHM_DIR}: {e.strerror or e}"}
  return {"free": st.f_bavail * st.f_frsize, "size": st.f_blocks * st.f_frsize}


def _ptrace_scope() -> int | None:
  try:
    with open(YAMA) as f:
      return int(f.read().strip())
  except (OSError, ValueError):
    return None


def _boot_id() -> str:
  try:
    with open("/proc/sys/kernel/random/boot_id") as f:
      return f.read().strip()
  except OSError:
    return ""


def before_init() -> dict[str, Any]:
  """The facts that need no MPI, read before ``mpijax.init()``."""
  affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
  return {
    "host": socket.gethostname(),
    "boot_id": _boot_id(),  # one kernel: nodes that are containers of one machine
    "pid": os.getpid(),
    **_launcher(),
    "under_run": bool(config.get("run")),
    "affinity": affinity,
    "online": os.cpu_count() or 0,
    "cpu_bind": config.get("cpu_bind"),
    "shm": _shm(),
    "ptrace_scope": _ptrace_scope(),
    "mpitrampoline_lib": os.environ.get(bridge_env.ENV, ""),
    "btl": os.environ.get("OMPI_MCA_btl", ""),
    "pml": os.environ.get("OMPI_MCA_pml", ""),
  }


def _libmpi_path() -> str:
  try:
    with open("/proc/self/maps") as f:
      for line in f:
        name = line.split()[-1] if len(line.split()) >= 6 else ""
        if "/libmpi" in name and ".so" in name:
          return name
  except OSError:
    pass
  return ""


def _mapped_segments() -> tuple[int, int]:
  """(count, bytes) of MPI's shared-memory segment files this rank maps."""
  seen: dict[str, int] = {}
  try:
    with open("/proc/self/maps") as f:
      for line in f:
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
          continue
        path = fields[5].strip()
        if os.path.basename(path).startswith(mpi_util.SEGMENT_PREFIXES) and path not in seen:
          try:
            seen[path] = os.stat(path).st_size
          except OSError:
            seen[path] = 0
  except OSError:
    pass
  return len(seen), sum(seen.values())


def _cache() -> dict[str, Any]:
  """The compile cache's directory and whether this rank can write there."""
  from mpijax._src.xla import compile_hook

  try:
    directory = compile_hook.cache_directory()
  except Exception as e:  # noqa: BLE001 -- reported, never fatal here
    return {"dir": None, "error": f"{type(e).__name__}: {e}"}
  if directory is None:
    return {"dir": None, "error": ""}
  try:
    os.makedirs(directory, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix=".doctor-", dir=directory)
    os.close(fd)
    os.unlink(path)
  except OSError as e:
    return {"dir": directory, "error": f"{type(e).__name__}: {e.strerror or e}"}
  return {"dir": directory, "error": ""}


def after_init(rt) -> dict[str, Any]:
  """The facts of the running job on this rank (``rt``: the :class:`Runtime`)."""
  from mpijax._src import ffi
  from mpijax._src.xla import distributed as jax_runtime

  MPI = mpi_util.import_mpi()
  version = MPI.Get_library_version().strip().splitlines()[0].split(",")[0]
  try:
    ext = ffi.load()
    built, ext_error = ext.build_mpi_version(), ""
  except ImportError as e:
    built, ext_error = "", str(e).splitlines()[0]
  segments, segment_bytes = _mapped_segments()
  return {
    "rank": rt.rank,
    "local_rank": rt.topology.local_rank,
    "local_size": rt.topology.local_size,
    # As mpijax's import judged it (cpu_bind.py): more ranks on the node than cores.
    "oversubscribed": rt.topology.local_size > (os.cpu_count() or rt.topology.local_size),
    "node": rt.topology.node_index,
    "mpi_library": version,
    "mpi_path": _libmpi_path(),
    "thread_multiple": MPI.Query_thread() >= MPI.THREAD_MULTIPLE,
    "built_for": built,
    "ext_error": ext_error,
    "bridge_loaded": jax_runtime.loaded_bridge() is not None,
    "bridge_installed": bridge_env.installed_bridge() or "",
    "xla_collectives": rt.xla_collectives,
    "xla_setting": config.get("xla_collectives"),
    "jax_distributed": rt.jax_distributed,
    "jax_setting": bool(config.get("jax_distributed")),
    "coordinator": rt.topology.coordinator_address,
    "devices": rt.local_device_count,
    "platform": rt.platform,
    "segments": segments,
    "segment_bytes": segment_bytes,
    "shm_max_bytes": int(config.get("shm_max_bytes")),
    "cma_min_bytes": int(config.get("cma_min_bytes")),
    "cache": _cache(),
    "python": sys.executable,
  }
