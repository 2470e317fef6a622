"""JAX's own distributed runtime under mpijax, with XLA's collectives over MPI.

In a job of more than one rank, ``mpijax.init()`` starts
``jax.distributed`` with mpijax's coordinator, so ``jax.process_index()``,
``jax.devices()`` and global ``jax.Array``s span every rank, and selects
XLA's MPI collectives (``jax_cpu_collectives_implementation='mpi'``) for the
collectives XLA's partitioner inserts. XLA reaches MPI through MPItrampoline
(inside jaxlib), which loaded mpijax's bridge library when jaxlib loaded (see
bridge_env.py); :func:`start` attaches the bridge to the MPI mpi4py runs, a
private duplicate of the job's communicator, before JAX starts its backend.

With several CPU devices per rank, each (rank, local device) is a member of
XLA's communicators (cliques.py, ffi/csrc/xla_collectives/members.h). Where
XLA's MPI collectives cannot serve -- a jaxlib that refuses the bridge, the bridge not
loaded because ``jax`` was imported before anything named it -- every rank
uses gloo and rank 0 says why, once. The choice is made together: XLA's
collectives over MPI on some ranks and gloo on others would never meet.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import socket
import sys
import time

from mpijax._src import config
from mpijax._src import log
from mpijax._src import mpi_util
from mpijax._src.ffi import bridge_env
from mpijax._src.guards import failure
from mpijax._src.xla import labels as xla_labels

# What XLA's MPI collectives raise for a float16 all-reduce or all-gather
# (bfloat16 works: XLA computes it in float32), and the fix.
F16_ERROR = "Unsupported primitive type for reduction: f16"
F16_HINT = ("XLA's MPI collectives (jit over global jax.Arrays, MPIJAX_XLA_COLLECTIVES) "
            "have no float16 all-reduce or all-gather. Cast to float32 or bfloat16 around "
            "the sharded computation, use mpijax.lax collectives inside mpijax.shard_map "
            "(they carry float16), or run with MPIJAX_XLA_COLLECTIVES=gloo.")

# What prepare_environment() found at `import mpijax` (None: not run).
_import_outcome: tuple[bool, str] | None = None
_jax_was_imported = False
_attached = False


def prepare_environment() -> None:
  """At ``import mpijax``, before JAX is imported: names the bridge in
  MPITRAMPOLINE_LIB where it is wanted (a multi-rank launch) and safe."""
  global _import_outcome, _jax_was_imported
  _jax_was_imported = "jax" in sys.modules or "jaxlib._jax" in sys.modules
  if _jax_was_imported:
    return  # too late: jaxlib has read the variable already
  try:
    _import_outcome = bridge_env.select(
        bridge_env.installed_bridge(), collectives=config.get("xla_collectives"),
        distributed=config.get("jax_distributed"))
  except ValueError:
    raise  # a malformed MPIJAX_* value: the message names it
  except Exception as e:  # noqa: BLE001 -- init() reports it, with gloo
    _import_outcome = (False, f"checking the bridge failed: {e}")


def loaded_bridge() -> ctypes.CDLL | None:
  """The bridge as jaxlib's MPItrampoline loaded it, or None if it did not."""
  path = bridge_env.installed_bridge()
  if path is None:
    return None
  try:  # RTLD_NOLOAD: only an already loaded copy (the trampoline's)
    return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
  except OSError:
    return None


def _why_not_loaded() -> str:
  """Why the bridge is not in this process, with the fix."""
  env = os.environ.get(bridge_env.ENV)
  path = bridge_env.installed_bridge()
  if path is None:
    return (f"mpijax's bridge library ({bridge_env.LIB_NAME}) is not installed; "
            "reinstall mpijax (pip install -e . builds it)")
  if env is not None and not (os.path.exists(env) and os.path.samefile(env, path)):
    return (f"{bridge_env.ENV}={env} names another library than mpijax's bridge; to use "
            "it, set jax_cpu_collectives_implementation='mpi' yourself")
  if _import_outcome is not None and not _import_outcome[0] and _import_outcome[1]:
    return _import_outcome[1]
  return (f"jax was imported before mpijax, and {bridge_env.ENV} was not set then (jaxlib "
          "reads it once, when it loads). Launch with mpijax-run, import mpijax before jax, "
          f"or export {bridge_env.ENV}={path}")


@dataclasses.dataclass
class Started:
  """What :func:`start` did."""
  owns_distributed: bool  # mpijax called jax.distributed.initialize (and shuts it down)
  collectives: str  # 'mpi' (through the bridge), 'gloo', or the user's own choice


def _users_collectives() -> str | None:
  """The CPU collectives the user chose for JAX, if any (env or jax.config)."""
  import jax
  if os.environ.get("JAX_CPU_COLLECTIVES_IMPLEMENTATION"):
    return os.environ["JAX_CPU_COLLECTIVES_IMPLEMENTATION"]
  value = jax.config.jax_cpu_collectives_implementation
  return value if value not in (None, "gloo") else None


def start(comm, *, address: str, rank: int, size: int, local_devices: int,
          raise_on_every_rank) -> Started:
  """Collective over ``comm`` (the job): starts or adopts JAX's distributed
  runtime and picks XLA's cross-process collectives, the same on every rank.

  ``raise_on_every_rank(comm, problems)`` raises on every rank if any rank
  found a problem (runtime._raise_on_every_rank).
  """
  import jax

  # Imported here: this module is imported before JAX (see prepare_environment).
  from mpijax._src import jax_compat
  state = jax_compat.distributed.global_state
  problems = []
  adopted = state.client is not None
  if adopted:  # the user's own jax.distributed.initialize()
    if (state.process_id, state.num_processes) != (rank, size):
      problems.append(
          f"mpijax.init(): jax.distributed.initialize() was already called with "
          f"process_id={state.process_id}, num_processes={state.num_processes}, but MPI says "
          f"rank {rank} of {size}. Drop that call (mpijax.init() starts JAX's distributed "
          "runtime itself) or pass it process_id=MPI rank and num_processes=MPI size.")
  elif jax_compat.backends_started():
    problems.append(
        "mpijax.init(): JAX's backend already started in this process (jax.devices(), an "
        "array or a jit call ran before mpijax.init()), so JAX's distributed runtime can no "
        "longer start. Call mpijax.init() before using JAX, or pass jax_distributed=False "
        "(MPIJAX_JAX_DISTRIBUTED=0) if JAX need not know the other ranks.")
  raise_on_every_rank(comm, problems)

  setting = config.get("xla_collectives")
  users = _users_collectives()
  library = None
  if jax_compat.backends_started():
    chosen = "started"  # adopted with its backend running: its choice stands
  elif users is not None:
    chosen = users
    library = loaded_bridge() if users == "mpi" else None  # ours: attach it
  else:
    chosen = setting if setting == "gloo" else "mpi"
    library = loaded_bridge() if chosen == "mpi" else None
  # Decided together: XLA's MPI collectives on some ranks and gloo on others
  # would never meet, and attaching the bridge is collective.
  if chosen == "mpi":
    # A user's 'mpi' with an MPIwrapper of their own is theirs to make work;
    # with none loaded, XLA's first MPI call would end the process.
    mine = users is None or library is not None or bridge_env.ENV not in os.environ
    reason = _why_not_mpi(library) if mine else ""
    bad = [(r, text) for r, text in enumerate(mpi_util.allgather_str(comm, reason)) if text]
    if bad and (setting == "mpi" or users == "mpi"):
      why = ("MPIJAX_XLA_COLLECTIVES=mpi" if users is None
             else "jax_cpu_collectives_implementation='mpi'")
      raise_on_every_rank(comm, [
          f"mpijax.init(): {why}, but XLA's MPI collectives cannot serve on rank "
          f"{bad[0][0]}: {bad[0][1]}"])
    if bad:
      chosen, library = "gloo", None
      if rank == 0:
        log.warning("XLA's cross-process collectives (jit over global jax.Arrays) "
                    "use gloo, not MPI:\n" + mpi_util.rank_lines(bad)
                    + "\nmpijax's own collectives use MPI either way. "
                    "MPIJAX_XLA_COLLECTIVES=gloo chooses gloo without this warning.")
    elif library is not None:
      _attach(library, comm)
      if local_devices > 1:
        # XLA's requests for communicators do not say which local device asks:
        # each compiled program's are prepared before it runs (cliques.py;
        # imported here: it loads numpy, which mpijax-run's own process never needs).
        from mpijax._src.xla import cliques as xla_cliques

        xla_cliques.install(local_devices)
      failure.add_hint(F16_ERROR, F16_HINT)
      if users is None:
        jax.config.update("jax_cpu_collectives_implementation", "mpi")
      if config.get("xla_dispatch") == "inline":
        # XLA hands a program of 1,000 flops or more to its thread pool and
        # the caller waits for it: two thread hand-offs around every
        # cross-process collective, most of a small one's time.
        jax.config.update("jax_cpu_enable_async_dispatch", False)
      xla_labels.install()
  if chosen == "gloo" and local_devices > 1:
    xla_labels.guard_gloo_reduce_scatter(local_devices)
  owns = not adopted
  if owns:
    if "JAX_ENABLE_PREEMPTION_SERVICE" not in os.environ:
      # JAX's preemption service catches SIGTERM and keeps the process running
      # (for a checkpoint at a later sync point): mpirun, srun and mpijax-run
      # stop a job with SIGTERM, and mpijax's checkpoints do not wait for one.
      try:
        jax.config.update("jax_enable_preemption_service", False)
      except (AttributeError, KeyError, ValueError):  # a JAX without the service
        pass
    if rank != 0:
      _wait_for_coordinator(address)
    jax.distributed.initialize(coordinator_address=address, num_processes=size,
                               process_id=rank)
  return Started(owns_distributed=owns, collectives=chosen)


def _wait_for_coordinator(address: str, limit: float = 60.0) -> None:
  """Returns once rank 0's coordinator accepts connections (or after ``limit`` s).

  A JAX client that finds no coordinator yet retries about a second later;
  rank 0 starts it within milliseconds, so waiting for it here saves most of
  that second at every start.
  """
  host, _, port = address.rpartition(":")
  host = host.strip("[]")
  deadline = time.monotonic() + limit
  while time.monotonic() < deadline:
    try:
      socket.create_connection((host, int(port)), timeout=1.0).close()
      return
    except OSError:
      time.sleep(0.005)


def _why_not_mpi(library: ctypes.CDLL | None) -> str:
  """Why XLA's MPI collectives cannot serve on this rank ('' if they can)."""
  if library is None:
    return _why_not_loaded()
  MPI = mpi_util.import_mpi()
  if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
    return "MPI runs below MPI_THREAD_MULTIPLE, and XLA calls MPI from its own threads"
  from mpijax._src import ffi
  try:
    ffi.load()  # the extension that fills the bridge's table
  except ImportError as e:
    return f"mpijax's extension does not load: {str(e).splitlines()[0]}"
  return ""


def _attach(library: ctypes.CDLL, comm) -> None:
  """Hands the bridge the extension's table of real MPI calls (collective)."""
  global _attached
  from mpijax._src import ffi
  MPI = mpi_util.import_mpi()
  ext = ffi.load()
  table_lib = ctypes.CDLL(ext.__file__, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
  make = table_lib.mpijax_bridge_make_table
  make.restype = ctypes.c_void_p
  make.argtypes = [ctypes.c_void_p, ctypes.c_double, ctypes.c_char_p, ctypes.c_int]
  error = ctypes.create_string_buffer(512)
  table = make(MPI._addressof(comm), float(config.get("timeout")), error, len(error))
  if not table:
    raise RuntimeError(f"mpijax.init(): attaching the MPI bridge failed: {error.value.decode()}")
  attach = library.mpijax_bridge_attach
  attach.argtypes = [ctypes.c_void_p]
  if attach(table) != 0:
    raise RuntimeError(
        "mpijax.init(): mpijax's MPI bridge library and its extension come from different "
        "builds (their table versions differ); reinstall mpijax.")
  _attached = True


def attached() -> bool:
  """Whether this process handed the bridge its table (XLA's collectives over MPI)."""
  return _attached


def bridge_stats() -> dict[str, int]:
  """Calls XLA made through the bridge in this process, by kind (for tests and checks)."""
  names = ("init", "split", "free", "allreduce", "allgather", "reduce_scatter",
           "sendrecv", "isend", "irecv", "wait", "finalize")
  library = loaded_bridge()
  if library is None:
    return {}
  out = (ctypes.c_uint64 * len(names))()
  library.mpijax_bridge_stats(out, len(names))
  return dict(zip(names, (int(v) for v in out)))

