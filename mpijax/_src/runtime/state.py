"""The runtime: who this rank is, which devices it has, and how to reach the others.

``init()`` detects the launcher (layer 1), initializes MPI with
``MPI_THREAD_MULTIPLE``, cross-checks the launcher's view against
``MPI.COMM_WORLD``, works out the node layout, picks a coordinator address,
configures JAX's local devices and gathers the global device table.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import socket
import threading
from typing import Any

import numpy as np

from mpijax._src import cluster
from mpijax._src import config
from mpijax._src import ffi
from mpijax._src import log
from mpijax._src import mpi_util
from mpijax._src.ffi import settings as ffi_settings
from mpijax._src.guards import arrival
from mpijax._src.guards import failure
from mpijax._src.guards import inspector
from mpijax._src.runtime import devices as device_setup
from mpijax._src.runtime import layout
from mpijax._src.runtime.layout import DeviceInfo as DeviceInfo
from mpijax._src.runtime.layout import Topology as Topology
from mpijax._src.timeline import record as timeline_record
from mpijax._src.timeline import straggler_watch
from mpijax._src.xla import compile_hook
from mpijax._src.xla import distributed as jax_runtime
from mpijax._src.xla import pools as xla_pools
from mpijax._src.xla import program_check


@dataclasses.dataclass
class Runtime:
  """What ``mpijax.init()`` returns; one per process.

  Attributes:
    topology: where this rank sits (:class:`Topology`).
    comm: mpijax's private clone of the job's mpi4py communicator.
    local_devices: this rank's JAX devices.
    device_table: every device of every rank (:class:`DeviceInfo`), in
      global order.
    jax_distributed: whether JAX's distributed runtime spans the ranks.
    xla_collectives: what XLA's cross-process collectives run on:
      ``"mpi"`` (through mpijax's bridge), ``"gloo"``, another the user
      chose, or ``""`` without JAX's distributed runtime.
  """

  topology: Topology
  comm: Any  # mpi4py communicator: mpijax's private clone
  local_devices: list[Any]
  device_table: tuple[DeviceInfo, ...]
  jax_distributed: bool
  # XLA's cross-process collectives: "mpi" (through mpijax's bridge), "gloo",
  # another the user chose, or "" without JAX's distributed runtime.
  xla_collectives: str = ""
  _world_comm: Any = dataclasses.field(repr=False, default=None)
  _owns_distributed: bool = dataclasses.field(repr=False, default=False)
  # What the init() that started it was given (and chose), for a second call.
  _first_call: dict = dataclasses.field(repr=False, default_factory=dict)

  @property
  def rank(self) -> int:
    return self.topology.rank

  @property
  def size(self) -> int:
    return self.topology.size

  @property
  def local_device_count(self) -> int:
    return len(self.local_devices)

  @property
  def platform(self) -> str:
    return self.local_devices[0].platform

  def __str__(self) -> str:
    t = self.topology
    return (
      f"mpijax.Runtime(rank {t.rank}/{t.size}, local {t.local_rank}/{t.local_size}, "
      f"node {t.node_index}/{t.node_count} {t.hostname!r}, launcher={t.launcher!r}, "
      f"coordinator={t.coordinator_address!r}, devices={self.local_device_count} x "
      f"{self.platform} (global {len(self.device_table)}), "
      f"jax_distributed={self.jax_distributed}"
      + (f", xla_collectives={self.xla_collectives!r}" if self.xla_collectives else "")
      + ")"
    )

  __repr__ = __str__


_lock = threading.RLock()
_runtime: Runtime | None = None
_shutdown_hooks: list[Any] = []


def is_initialized() -> bool:
  return _runtime is not None


def get(what: str = "this operation") -> Runtime:
  """The runtime, or a clear error naming ``what`` needed it."""
  rt = _runtime
  if rt is None:
    raise RuntimeError(
      f"{what} needs the mpijax runtime: call mpijax.init() first "
      "(once per process, before any mpijax collective)."
    )
  return rt


def register_shutdown_hook(fn) -> None:
  """Runs ``fn()`` at ``shutdown()`` (e.g. to free communicators)."""
  _shutdown_hooks.append(fn)


# --- coordinator -------------------------------------------------------------


# --- init / shutdown ---------------------------------------------------------


def _check(name: str, launcher: str, env_value: int | None, mpi_value: int) -> str:
  """The problem when the launcher (or an explicit argument) and MPI disagree, else ''."""
  if env_value is None or env_value == mpi_value:
    return ""
  return (
    f"mpijax.init(): the {launcher!r} launcher environment (or init's arguments) says "
    f"{name}={env_value}, but MPI.COMM_WORLD says {name}={mpi_value}. The environment "
    "belongs to a different launch (e.g. variables inherited from an outer job, or mpi4py "
    "linked to another MPI than the launcher's), or the argument is wrong. Launch with the "
    "mpirun/srun matching mpi4py's MPI, or pass launcher='mpi' to trust MPI alone."
  )


def _check_arguments(coordinator_address: Any, devices_per_process: Any, comm: Any) -> None:
  """Type and format errors in init's arguments, before anything starts."""
  if devices_per_process is not None and (
    isinstance(devices_per_process, bool) or not isinstance(devices_per_process, (int, np.integer))
  ):
    raise TypeError(
      f"mpijax.init got devices_per_process={devices_per_process!r}; "
      "expected an int >= 1 (CPU devices per rank)."
    )
  if coordinator_address is not None:
    host, sep, port = str(coordinator_address).rpartition(":")
    if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
      raise ValueError(
        f"mpijax.init got coordinator_address={coordinator_address!r}; "
        "expected 'host:port' with a port in 1..65535, e.g. '10.0.0.1:12345'."
      )
  if comm is not None and not hasattr(comm, "Get_rank"):
    raise TypeError(
      f"mpijax.init got comm={comm!r}; expected an mpi4py communicator "
      "(e.g. MPI.COMM_WORLD or a communicator split from it)."
    )


def _check_same_as_first(rt: Runtime, args: dict[str, Any]) -> None:
  """A second ``init()``: an argument it gives that differs from what the
  running runtime was started with is an error naming both."""
  t, first = rt.topology, rt._first_call
  running = {
    "launcher": t.launcher,
    "rank": t.rank,
    "size": t.size,
    "local_rank": t.local_rank,
    "local_size": t.local_size,
    "coordinator_address": t.coordinator_address,
    "devices_per_process": rt.local_device_count,
    "jax_distributed": rt.jax_distributed,
    "abort_on_exception": first.get("abort_on_exception"),
    "timeline": first.get("timeline") or None,
  }
  differ = []
  for name, value in args.items():
    if value is None:
      continue
    if name == "comm":
      base = rt._world_comm
      if not (value is base or value == base):
        differ.append(f"comm={value!r} (the runtime runs on {base!r})")
      continue
    have = running[name]
    if name == "timeline":
      same = have is not None and str(value) == str(have)
    elif name in ("jax_distributed", "abort_on_exception"):
      same = bool(value) == bool(have)
    else:
      same = value == have
    if not same:
      differ.append(f"{name}={value!r} (the runtime runs with {name}={have!r})")
  if differ:
    given = ", ".join(f"{k}={v!r}" for k, v in first.get("args", {}).items())
    raise RuntimeError(
      f"mpijax.init() was called again, with {'; '.join(differ)}; the first call, "
      f"init({given}), started the runtime. A second init() returns the running runtime "
      "and cannot change it: give these arguments to the first init(), or call "
      "mpijax.shutdown() before init() again."
    )


def _interactive() -> bool:
  """Whether this process is an interactive session (a REPL, IPython, a notebook kernel)."""
  import sys

  return bool(
    hasattr(sys, "ps1")
    or sys.flags.interactive
    or "IPython" in sys.modules
    or "ipykernel" in sys.modules
  )


_said_single_rank = False


def _say_single_rank() -> None:
  """One line, once per process: this job is one rank because no launcher
  started it, and how to start N (not in an interactive session)."""
  import os
  import sys

  global _said_single_rank
  if _said_single_rank or _interactive():
    return
  _said_single_rank = True
  script = sys.argv[0] if sys.argv and sys.argv[0].endswith(".py") else "script.py"
  log.notice(
    "running as 1 rank: no MPI launcher started this process (N ranks: mpijax-run -n N "
    f"python {os.path.basename(script)}; 1 rank meant: MPIJAX_LAUNCHER=single silences this)"
  )


def _raise_on_every_rank(comm, problems: list[str]) -> None:
  """Collective: if any rank found a problem, every rank raises it, naming the rank."""
  bad = mpi_util.rank_problems(comm, "\n".join(p for p in problems if p))
  if bad:
    rank, text = bad[0]
    more = f"; ranks {[r for r, _ in bad[1:]]} too" if len(bad) > 1 else ""
    raise RuntimeError(f"{text.splitlines()[0]} (found on rank {rank}{more})")


def init(
  *,
  launcher: str | None = None,
  rank: int | None = None,
  size: int | None = None,
  local_rank: int | None = None,
  local_size: int | None = None,
  coordinator_address: str | None = None,
  devices_per_process: int | None = None,
  jax_distributed: bool | None = None,
  comm: Any = None,
  abort_on_exception: bool | None = None,
  timeline: str | None = None,
) -> Runtime:
  """Starts the mpijax runtime on this rank (idempotent).

  A later call returns the running runtime; one whose arguments differ from
  what the runtime was started with raises, naming both (``shutdown()``
  first to start it anew). A process started without any launcher runs as
  1 rank and says so in one line, unless 1 rank is asked for
  (``launcher="single"``, ``MPIJAX_LAUNCHER=single``, ``size=1``) or the
  session is interactive.

  Args:
    launcher: force a detector ("openmpi4", "prrte", "slurm", "mpich", "mpi",
      "single"); default: the first whose variables are present.
    rank: this rank's index, instead of the launcher's variables; still
      cross-checked against MPI.
    size: the job's rank count, as ``rank``.
    local_rank: this rank's index among the ranks of its node, as ``rank``.
    local_size: the number of ranks on this node, as ``rank``.
    coordinator_address: "host:port" to use instead of rank 0 picking one
      (default: JAX_COORDINATOR_ADDRESS when set).
    devices_per_process: number of CPU devices per rank (default: the user's
      XLA_FLAGS / jax_num_cpu_devices, else MPIJAX_DEVICES_PER_PROCESS, else 1).
    jax_distributed: start JAX's distributed runtime
      (``jax.distributed.initialize`` with mpijax's coordinator), so that
      ``jax.process_index()``, ``jax.devices()`` and global ``jax.Array``s
      span every rank, with XLA's cross-process collectives over MPI where
      they can serve (MPIJAX_XLA_COLLECTIVES). Default: on in a job of more
      than one rank (MPIJAX_JAX_DISTRIBUTED=0 turns it off). A
      ``jax.distributed.initialize()`` of the user's, made before, is adopted
      when it agrees with MPI's ranks.
    comm: the mpi4py communicator spanning the job (default COMM_WORLD);
      mpijax works on a private clone of it.
    abort_on_exception: install the hook that aborts every rank when one has
      an uncaught exception (default on, MPIJAX_ABORT_ON_EXCEPTION).
    timeline: record every rank's mpijax calls and training steps, and write
      them merged into this one Chrome-trace JSON file at exit (default:
      MPIJAX_TIMELINE; see docs/timeline.md). The same path on every rank.

  Returns:
    The :class:`Runtime` (the same one on every later call).

  Raises:
    TypeError: ``devices_per_process`` is not an int, or ``comm`` not an
      mpi4py communicator.
    ValueError: ``coordinator_address`` is not ``"host:port"``.
    RuntimeError: on every rank, when the launcher's view (or the explicit
      ``rank``/``size``) disagrees with ``MPI.COMM_WORLD``'s.

  Examples:
    >>> import mpijax
    >>> rt = mpijax.init()  # doctest: +SKIP
    >>> print(rt.topology)  # doctest: +SKIP
    Topology(rank=0, size=4, local_rank=0, local_size=4, node=0/1, ...)
  """
  global _runtime
  args = dict(
    launcher=launcher,
    rank=rank,
    size=size,
    local_rank=local_rank,
    local_size=local_size,
    coordinator_address=coordinator_address,
    devices_per_process=devices_per_process,
    jax_distributed=jax_distributed,
    comm=comm,
    abort_on_exception=abort_on_exception,
    timeline=timeline,
  )
  with _lock:
    if _runtime is not None:
      _check_same_as_first(_runtime, args)
      return _runtime
    state = _Start(dict(args))
    # One cleanup for every step: what a failed step leaves is freed, on every rank.
    with contextlib.ExitStack() as cleanup:
      _detect_launcher(state)
      # A rank that never calls init() holds the others in MPI_Init: named after MPIJAX_TIMEOUT.
      watch = arrival.waiting(state.info.size) if not state.explicit_comm else None
      _join_mpi(state, cleanup)
      _place_on_nodes(state)
      if watch is not None:
        watch.arrived()
      _start_jax(state)
      cleanup.pop_all()
    _runtime = _make_runtime(state)
    _start_services(_runtime, state)
    return _runtime


@dataclasses.dataclass
class _Start:
  """What init()'s steps have found so far, from the launcher to the device table."""

  args: dict[str, Any]
  info: Any = None  # the launcher's cluster.Info
  coordinator: str | None = None  # the address asked for, if any
  base: Any = None  # the job's communicator: COMM_WORLD or the user's
  private: Any = None  # mpijax's clone of it
  rank: int = 0
  size: int = 1
  hostnames: tuple[str, ...] = ()
  local_rank: int = 0
  local_size: int = 1
  node_cpus: int = 0
  node_index: int = 0
  node_count: int = 1
  address: str = ""
  started: Any = None  # jax_runtime's start, where JAX's distributed runtime spans the ranks
  local_devices: list[Any] = dataclasses.field(default_factory=list)
  table: tuple[DeviceInfo, ...] = ()

  @property
  def explicit_comm(self) -> bool:
    return self.args["comm"] is not None


def _detect_launcher(state: _Start) -> None:
  """Checks the arguments and settings, then detects the launcher (nothing collective)."""
  a = state.args
  _check_arguments(a["coordinator_address"], a["devices_per_process"], a["comm"])
  log.warn_unknown_settings()
  # JAX's convention: JAX_COORDINATOR_ADDRESS
  state.coordinator = a["coordinator_address"] or config.get("jax_coordinator_address") or None
  forced = a["launcher"] or config.get("launcher") or None
  sizes = {k: a[k] for k in ("rank", "size", "local_rank", "local_size")}
  state.info = cluster.detect(forced, **sizes)
  # No launcher's variables: plain MPI (a singleton) or no MPI at all.
  no_launcher = state.info.launcher in ("single", "mpi") and state.info.size == 1
  if no_launcher and not (forced or a["size"] == 1 or state.explicit_comm):
    _say_single_rank()


def _join_mpi(state: _Start, cleanup: contextlib.ExitStack) -> None:
  """MPI's view of the job, checked against the launcher's; mpijax's private communicator."""
  info, MPI = state.info, mpi_util.import_mpi()
  state.base = state.args["comm"] if state.explicit_comm else MPI.COMM_WORLD
  if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
    log.warning(
      f"MPI was initialized with thread level {MPI.Query_thread()} "
      "< MPI_THREAD_MULTIPLE (mpi4py was imported before mpijax.init() with another "
      "mpi4py.rc.thread_level); several local devices calling MPI at once need MULTIPLE."
    )
  if not state.explicit_comm:
    _raise_on_every_rank(
      state.base,
      [
        _check("rank", info.launcher, info.rank, state.base.Get_rank()),
        _check("size", info.launcher, info.size, state.base.Get_size()),
      ],
    )
  state.rank, state.size = state.base.Get_rank(), state.base.Get_size()
  state.private = state.base.Clone()
  cleanup.callback(state.private.Free)
  state.private.Set_name("mpijax")


def _place_on_nodes(state: _Start) -> None:
  """Every rank's host, this rank's place on its node (checked against the
  launcher's), the node's cores, and the coordinator's address (collective)."""
  info, private, MPI = state.info, state.private, mpi_util.import_mpi()
  state.hostnames = tuple(mpi_util.allgather_str(private, socket.gethostname()))
  # Order the node's ranks by the launcher's local rank when it gives one (Open MPI
  # may number them in mapping order, not world order); then MPI's local rank
  # equals the launcher's exactly when the launcher's numbering is consistent.
  key = info.local_rank if (info.local_rank is not None and not state.explicit_comm) else state.rank
  shared = private.Split_type(MPI.COMM_TYPE_SHARED, key=key)
  state.local_rank, state.local_size = shared.Get_rank(), shared.Get_size()
  state.node_cpus = xla_pools.count_node_cpus(shared)
  shared.Free()
  if not state.explicit_comm:
    _raise_on_every_rank(
      private,
      [
        _check("local_rank", info.launcher, info.local_rank, state.local_rank),
        _check("local_size", info.launcher, info.local_size, state.local_size),
      ],
    )
  state.node_index, state.node_count = layout.node_layout(state.hostnames, state.rank)
  state.address = layout.pick_coordinator(private, state.hostnames, state.coordinator)


def _start_jax(state: _Start) -> None:
  """JAX's local devices, its distributed runtime over the ranks (unless off),
  the compile hook, XLA's pools, and the global device table (collective)."""
  import jax

  from mpijax._src import jax_compat
  from mpijax._src.runtime import multihost

  a = state.args
  n_local = device_setup.configure(a["devices_per_process"], state.local_rank, state.local_size)
  if a["jax_distributed"] is None:
    use_dist = state.size > 1 and config.get("jax_distributed")
  else:
    use_dist = bool(a["jax_distributed"])
  if use_dist or jax_compat.distributed.global_state.client is not None:
    # Before JAX's runtime spans the ranks: an uneven job stops here, clearly.
    layout.check_device_counts(state.private, n_local)
    state.started = jax_runtime.start(
      state.private,
      address=state.address,
      rank=state.rank,
      size=state.size,
      local_devices=n_local,
      raise_on_every_rank=_raise_on_every_rank,
    )
  multihost.install()
  _start_compile_cache(jax, state.rank, state.address)
  state.local_devices = list(jax.local_devices())
  _settle_xla_spin(state.local_size, state.local_devices, state.node_cpus)
  here = (jax.process_index(), jax.process_count())
  if state.started is not None and here != (state.rank, state.size):
    raise RuntimeError(
      f"mpijax.init(): JAX says process {here[0]} of {here[1]}, "
      f"but MPI says rank {state.rank} of {state.size}."
    )
  host = state.hostnames[state.rank]
  state.table = layout.device_table(state.private, state.local_devices, host)


def _make_runtime(state: _Start) -> Runtime:
  """The Runtime the steps found, with what the first init() was given."""
  topology = Topology(
    rank=state.rank,
    size=state.size,
    local_rank=state.local_rank,
    local_size=state.local_size,
    node_index=state.node_index,
    node_count=state.node_count,
    hostnames=state.hostnames,
    coordinator_address=state.address,
    launcher=state.info.launcher,
  )
  started, a = state.started, state.args
  rt = Runtime(
    topology=topology,
    comm=state.private,
    local_devices=state.local_devices,
    device_table=state.table,
    jax_distributed=started is not None,
    xla_collectives=started.collectives if started else "",
    _world_comm=state.base,
    _owns_distributed=bool(started and started.owns_distributed),
  )
  abort = a["abort_on_exception"]
  rt._first_call = dict(
    abort_on_exception=bool(config.get("abort_on_exception") if abort is None else abort),
    timeline=a["timeline"] if a["timeline"] is not None else config.get("timeline"),
    args={k: v for k, v in a.items() if v is not None},
  )
  return rt


def _start_services(rt: Runtime, state: _Start) -> None:
  """The abort hook, the stall inspector, the timeline and the straggler report."""
  private, started = rt.comm, state.started
  if rt._first_call["abort_on_exception"]:
    failure.install()
  # The stall inspector's responder answers other ranks' "what are you
  # doing?" queries; its communicator is cloned here (collective), its thread
  # starts with the first collective and stops at shutdown() and at exit.
  inspector.prepare(private, drain=_drain_at_exit)
  register_shutdown_hook(inspector.stop)
  if started is not None and started.collectives == "mpi" and jax_runtime.attached():
    # XLA's collectives run through the bridge under the same guards as
    # mpijax's own: the settings and the responder are needed from XLA's
    # first collective on, which may come before any mpijax call.
    ffi_settings.push_settings()
    inspector.ensure_started()
  timeline_path = rt._first_call["timeline"]
  if timeline_path:
    # Written at exit after the drain and before MPI finalizes (atexit runs
    # the last registered first), or at shutdown().
    atexit.register(timeline_record.finish, _drain_at_exit)
    register_shutdown_hook(lambda: timeline_record.finish(_drain_at_exit))
  # Off on every rank where one rank cannot run it: starting it is collective.
  stragglers = rt.size > 1 and min(
    mpi_util.allgather_int(private, int(bool(config.get("stragglers")) and _extension_loads()))
  )
  if stragglers:
    # At exit after the drain, before the timeline's file (which shows its lines).
    atexit.register(straggler_watch.finish)
    register_shutdown_hook(lambda: straggler_watch.finish(_drain_at_exit))
  atexit.register(_drain_at_exit)
  if stragglers:
    interval = config.get("straggler_interval")
    straggler_watch.start(private, hostnames=rt.topology.hostnames, interval=interval)
  if timeline_path:
    timeline_record.start(
      str(timeline_path), private, hostnames=rt.topology.hostnames, devices=rt.local_device_count
    )


def _extension_loads() -> bool:
  """Whether the C++ extension loads (the straggler report needs it; mpijax's own
  collectives say why it does not when they need it)."""
  try:
    ffi.load()
  except ImportError as e:
    log.LOGGER.debug("%s: no straggler report: %s", log.rank_label(), e)
    return False
  return True


def _start_compile_cache(jax, rank: int, job: str) -> None:
  """Every program compiled from now on passes mpijax's compile hook, and a
  directory named by MPIJAX_COMPILE_CACHE is JAX's cache unless JAX has one."""
  setting = config.get("compile_cache")
  if setting not in ("auto", "off") and not jax.config.jax_compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(setting))
  compile_hook.install(rank, job)


def _settle_xla_spin(local_ranks: int, local_devices: list, node_cpus: int) -> None:
  """Setting xla_spin: XLA's idle pool workers stop spinning where the node's
  device threads outnumber the cores its ranks may use (xla_pools)."""
  mode = config.get("xla_spin")
  report = xla_pools.settle(
    mode,
    local_ranks=local_ranks,
    local_devices=len(local_devices),
    node_cpus=node_cpus,
    platform=local_devices[0].platform,
  )
  if not report.reason:
    text = f"XLA's CPU thread pools: {report.changed} of {report.pools} kept from spinning."
  else:
    text = f"XLA's CPU thread pools keep spinning: {report.reason}."
  if report.reason and report.wanted and mode == "off":
    log.warning(text)
  else:
    log.LOGGER.debug("%s: %s", log.rank_label(), text)


def _drain_at_exit() -> None:
  """Waits for dispatched computations before mpi4py finalizes MPI.

  With asynchronous dispatch a jitted call can still be running (inside an
  MPI collective) when the script ends; mpi4py's MPI_Finalize at exit would
  then race with it. atexit runs this before mpi4py's own hook (registered
  earlier, run later), and every rank drains the same work. The inspector's
  exit hook calls it too, before stopping its responder; a second call finds
  nothing left to wait for.
  """
  if _runtime is None:
    return
  try:
    import jax

    for a in jax.live_arrays():
      try:
        a.block_until_ready()
      except Exception:  # a failed computation has nothing left to wait for
        pass
  except Exception:
    pass


def start_timeline(path: str) -> None:
  """Starts recording the collective timeline into ``path`` (collective).

  ``mpijax.init(timeline=path)`` or ``MPIJAX_TIMELINE=path`` do this at
  start-up and write the file at exit; call this (``mpijax.timeline.start``)
  to record only part of a run, then :func:`finish_timeline`. The same path
  on every rank.
  """
  rt = get("mpijax.timeline.start()")
  timeline_record.start(
    path,
    rt.comm,
    hostnames=rt.topology.hostnames,
    devices=rt.local_device_count,
    drain=_drain_at_exit,
  )


def finish_timeline() -> str | None:
  """Stops recording; rank 0 merges every rank's events and writes the file.

  Collective (``mpijax.timeline.finish``). Returns the path written on
  rank 0, None on the other ranks (and when the timeline was not recording).
  """
  return timeline_record.finish(_drain_at_exit)


def shutdown() -> None:
  """Frees mpijax's communicators and state; ``init()`` may be called again."""
  global _runtime
  with _lock:
    rt = _runtime
    if rt is None:
      return
    for fn in reversed(_shutdown_hooks):
      fn()
    _shutdown_hooks.clear()
    if rt._owns_distributed:
      import jax

      program_check.compare()  # through JAX's key-value store, while it is up
      jax.distributed.shutdown()
    MPI = mpi_util.import_mpi()
    if not MPI.Is_finalized():
      rt.comm.Free()
    failure.uninstall()
    _runtime = None


# --- convenience accessors ---------------------------------------------------


def process_index() -> int:
  return get("mpijax.process_index()").rank


def process_count() -> int:
  return get("mpijax.process_count()").size


def local_devices() -> list[Any]:
  return list(get("mpijax.local_devices()").local_devices)


def local_device_count() -> int:
  return get("mpijax.local_device_count()").local_device_count


def devices() -> tuple[DeviceInfo, ...]:
  """The global device table: every device of every rank, in global order."""
  return get("mpijax.devices()").device_table
