"""The one wrapper of JAX's compile function: the compile cache, and what mpijax
reads from every compiled program.

After ``mpijax.init()`` every program JAX compiles (``jax.jit``, ``.lower().compile()``,
``pmap``) passes :func:`_compile`:

1. **The compile cache.** Where JAX's persistent cache is on
   (``jax_compilation_cache_dir``, ``JAX_COMPILATION_CACHE_DIR``; mpijax-run
   sets one for every job, ``MPIJAX_COMPILE_CACHE``), the executable comes from
   :func:`compile_cache.fetch` under :func:`program_key`: a program each rank
   jits on its own devices has the same key on every rank, every rank reads
   and writes, and of the ranks that miss at once one compiles while the
   others wait for its entry and load it. JAX's own cache writes from
   process 0 only and keys such a program by its devices, so without this a
   multi-rank job waits for the ranks that compile. Programs with host
   callbacks, which cannot be serialized, take JAX's own path.
2. **What this rank is doing.** While it compiles, or waits for another
   rank's compile, the stall inspector's answers say so (a rank waiting in a
   collective for it reports "compiling", not a stall) and the timeline
   draws it.
3. **The readers.** Each function given to :func:`add_reader` then sees the
   program (its HLO text read once and its collective instructions parsed
   once, by ``xla_hlo``): the names of XLA's collectives in reports and the
   check that every rank runs the same program (``xla_labels``), the
   communicators they will ask for (``xla_cliques``), the gloo guard. They
   run on a loaded program as on a compiled one.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import hashlib
import os
import platform
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from mpijax._src import config
from mpijax._src import log
from mpijax._src.xla import compile_cache
from mpijax._src.xla import hlo as xla_hlo

_lock = threading.Lock()
_installed = False
_readers: list[Callable[[Program], None]] = []
_warned_dirs: set[str] = set()


@dataclasses.dataclass
class Program:
  """A compiled (or loaded) program, as the readers see it."""

  name: str
  executable: Any
  devices: Any  # numpy array of jax Devices (the device assignment's order)
  compile_options: Any
  spans_processes: bool  # devices of several processes (XLA's collectives cross ranks)

  @functools.cached_property
  def hlo(self) -> list[xla_hlo.Module]:
    """Each of the executable's HLO modules: its text read once, its collectives parsed once."""
    return [xla_hlo.Module(m.name, m.to_string()) for m in self.executable.hlo_modules()]


@dataclasses.dataclass
class Stats:
  """This process's compiles since init: counts and seconds in the compile hook."""

  compiled: int = 0  # compiled here
  loaded: int = 0  # loaded from an entry that was there
  waited: int = 0  # loaded after waiting for another rank's compile
  uncached: int = 0  # compiled without the cache (off, host callbacks, unwritable)
  seconds: float = 0.0  # in the hook, all of it
  compile_s: float = 0.0  # of which compiling
  wait_s: float = 0.0  # of which waiting for another rank's compile


_stats = Stats()
# (program, how, whose compile was waited for: a rank or None), in compile order.
_outcomes: list[tuple[str, str, int | None]] = []


def stats() -> Stats:
  """A copy of this process's compile statistics (benchmarks, tests)."""
  with _lock:
    return dataclasses.replace(_stats)


def outcomes() -> list[tuple[str, str, int | None]]:
  """Each program this process compiled or loaded: (name, how, rank waited for).

  ``how`` is "compiled", "loaded" (its entry was there), "waited" (loaded
  after another rank's compile) or "uncached".
  """
  with _lock:
    return list(_outcomes)


def add_reader(fn: Callable[[Program], None]) -> None:
  """Has ``fn(program)`` see every program compiled or loaded from now on (once each)."""
  with _lock:
    if fn not in _readers:
      _readers.append(fn)


# --- what this rank is doing ----------------------------------------------------------

_activity: dict[int, tuple[int, str, float]] = {}  # thread -> (kind, text, since)
COMPILING, WAITING = 1, 2


@contextlib.contextmanager
def _doing(kind: int, text: str) -> Iterator[None]:
  from mpijax._src import ffi

  ident = threading.get_ident()
  with _lock:
    _activity[ident] = (kind, text, time.monotonic())
  _publish(ffi)
  try:
    yield
  finally:
    with _lock:
      _activity.pop(ident, None)
    _publish(ffi)


def _publish(ffi: Any) -> None:
  """Hands the stall inspector the most urgent thing this process is doing."""
  ext = ffi.loaded()
  if ext is None:  # no collective has run: no inspector to tell
    return
  with _lock:
    kind, text = max(((k, t) for k, t, _ in _activity.values()), default=(0, ""))
  ext.set_activity(kind, text)


def activity() -> str:
  """What this rank's compile hook is doing, e.g. "compiling jit_step for 12.0 s" ('' if nothing)."""
  with _lock:
    doing = list(_activity.values())
  now = time.monotonic()
  return "; ".join(f"{text} for {now - since:.1f} s" for _, text, since in doing)


def _span(name: str, start_ns: int) -> None:
  from mpijax._src.timeline import record

  if record.active():
    record.add_span(name, start_ns, record.now_ns(), category="compile")


def _now_ns() -> int:
  from mpijax._src.timeline import record

  return record.now_ns() if record.active() else 0


# --- the key --------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _host_cpu() -> str:
  """The host's CPU model and features: XLA compiles for this host's CPU."""
  model = flags = ""
  with contextlib.suppress(OSError):
    with open("/proc/cpuinfo") as f:
      for line in f:
        name, _, value = line.partition(":")
        name = name.strip()
        if name in ("model name", "Processor", "CPU part") and not model:
          model = value.strip()
        elif name in ("flags", "Features") and not flags:
          flags = value.strip()
        if model and flags:
          break
  return f"{platform.machine()} {model} {flags}"


@functools.lru_cache(maxsize=1)
def _mpijax_build() -> str:
  """mpijax's version and its extension's digest: the handlers an executable calls."""
  from importlib import metadata

  from mpijax._src import ffi

  try:
    version = metadata.version("mpijax")
  except metadata.PackageNotFoundError:
    version = "unknown"
  digest = ""
  path = ffi.extension_path()
  with contextlib.suppress(OSError):
    with open(path or "", "rb") as f:
      digest = hashlib.sha256(f.read()).hexdigest()
  return f"{version} {digest}"


def program_key(computation: Any, devices: Any, compile_options: Any, backend: Any) -> str:
  """The compile cache's key of a program: the same on every rank that compiles it.

  What JAX's own key holds (the program, jaxlib, XLA flags, compile options)
  with a rank's own devices numbered by their place on the rank, so that a
  program each rank jits on its own devices has one key, plus what changes the
  executable and JAX's key leaves out or keys per process here: the device
  kind, the devices per rank (and in the job, for a program over several
  ranks), the host's CPU, mpijax's build and the settings that shape its
  lowering (``config.BAKED``).
  """
  import jax
  import numpy as np

  from mpijax._src import jax_compat

  flat = list(np.asarray(devices, dtype=object).flat)
  me = jax.process_index()
  options = compile_options
  assignment = compile_options.device_assignment
  per_rank = all(d.process_index == me for d in flat)
  if assignment is not None and flat and per_rank:
    place = {d.id: i for i, d in enumerate(backend.local_devices())}
    options = copy.deepcopy(compile_options)
    options.device_assignment = jax_compat.xla_client.DeviceAssignment.create(
      np.array([place[d.id] for d in flat]).reshape(
        assignment.replica_count(), assignment.computation_count()
      )
    )
  h = hashlib.sha256()
  jax_compat.hash_program(h, computation, options, backend)
  kind = flat[0].device_kind if flat else ""
  baked = ",".join(f"{s}={config.get(s)!r}" for s in config.BAKED)
  for part in (
    # A per-rank program is the same executable in a job of any size.
    f"devices {kind}: {len(backend.local_devices())} per rank"
    + ("" if per_rank else f", {len(backend.devices())} in the job"),
    f"cpu {_host_cpu()}",
    f"mpijax {_mpijax_build()}",
    f"settings {baked}",
  ):
    h.update(part.encode())
  name = str(jax_compat.ir.StringAttr(computation.operation.attributes["sym_name"]).value)
  return f"{name[:80]}-{h.hexdigest()}"


# --- the hook -------------------------------------------------------------------------


def cache_directory() -> str | None:
  """Where mpijax's entries go (``<jax_compilation_cache_dir>/mpijax``), None when off."""
  import jax

  if config.get("compile_cache") == "off" or not jax.config.jax_enable_compilation_cache:
    return None
  base = jax.config.jax_compilation_cache_dir
  if not base:
    return None
  return os.path.join(os.path.abspath(os.path.expanduser(str(base))), "mpijax")


_identity: tuple[int, str] = (0, "")  # (this rank, its job), given by install()


def _compile(
  original: Callable,
  backend,
  computation,
  devices,
  compile_options,
  host_callbacks,
  executable_devices,
  *args,
  **kwargs,
):
  from mpijax._src import jax_compat

  name = str(jax_compat.ir.StringAttr(computation.operation.attributes["sym_name"]).value)
  flat = list(getattr(devices, "flat", devices))
  spans = len({d.process_index for d in flat}) > 1
  directory = cache_directory()
  start, start_ns = time.monotonic(), _now_ns()
  outcome = None
  pgle = args[0] if args else kwargs.get("pgle_profiler")
  # Host callbacks cannot be serialized; profile-guided recompiles are JAX's to cache.
  key = None
  if directory is not None and not host_callbacks and pgle is None:
    try:
      key = program_key(computation, devices, compile_options, backend)
    except Exception as e:  # noqa: BLE001 -- a program the key cannot read compiles as JAX's
      log.LOGGER.debug("%s: no compile cache key for %s: %r", log.rank_label(), name, e)
  if key is None:
    with _doing(COMPILING, f"compiling {name}"):
      executable = original(
        backend,
        computation,
        devices,
        compile_options,
        host_callbacks,
        executable_devices,
        *args,
        **kwargs,
      )
  else:
    rank, job = _identity
    compiled_s = []

    def compile_here():
      t = time.monotonic()
      with _doing(COMPILING, f"compiling {name}"):
        exe = jax_compat.compiler.backend_compile_and_load(
          backend, computation, executable_devices, compile_options, host_callbacks
        )
      compiled_s.append(time.monotonic() - t)
      return exe

    @contextlib.contextmanager
    def waiting(owner):
      who = owner.describe(job) if owner is not None else "another rank"
      t = _now_ns()
      with _doing(WAITING, f"waiting for {who}'s compile of {name}"):
        yield
      if t:
        _span(f"waiting for {who}'s compile: {name}", t)

    executable, outcome = compile_cache.fetch(
      directory,
      key,
      jaxlib=jax_compat.jaxlib_version(),
      owner=compile_cache.me(rank, job),
      compile=compile_here,
      serialize=backend.serialize_executable,
      load=lambda data: backend.deserialize_executable(data, executable_devices, compile_options),
      waiting=waiting,
      stale_s=_stale_s(),
      meta={"module": name},
    )
    if outcome.warning:
      log.warning(outcome.warning)
    if outcome.unwritable and directory not in _warned_dirs:
      _warned_dirs.add(directory)
      log.warning(
        f"the compile cache directory {directory} cannot be written ({outcome.unwritable}): "
        "programs compile on every rank and are not cached. Fix: make it writable, point "
        "JAX_COMPILATION_CACHE_DIR (or MPIJAX_COMPILE_CACHE) at a writable directory, or set "
        "MPIJAX_COMPILE_CACHE=off"
      )
    log.LOGGER.debug("%s: compile cache: %s %s (%s)", log.rank_label(), outcome.how, name, key)
  seconds = time.monotonic() - start
  with _lock:
    how = "uncached" if outcome is None or outcome.unwritable else outcome.how
    owner = outcome.owner.rank if outcome is not None and outcome.owner is not None else None
    _outcomes.append((name, how, owner))
    _stats.seconds += seconds
    if outcome is None or outcome.unwritable:
      _stats.uncached += 1
    elif outcome.how == "compiled":
      _stats.compiled += 1
    elif outcome.how == "waited":
      _stats.waited += 1
      _stats.wait_s += outcome.waited_s
    else:
      _stats.loaded += 1
    if outcome is None or outcome.how == "compiled":
      _stats.compile_s += seconds if outcome is None else sum(compiled_s)
  if start_ns:
    how = {"loaded": "load", "waited": "load"}.get(outcome.how if outcome else "", "compile")
    _span(f"{how}: {name}", start_ns)
  program = Program(name, executable, devices, compile_options, spans)
  for reader in list(_readers):
    reader(program)
  return executable


def _stale_s() -> float:
  """How long a claim's time may stand still: the stall timeout, within
  [3 heartbeats, compile_cache.STALE_S]."""
  timeout = config.get("timeout") or compile_cache.STALE_S
  return max(3 * compile_cache.HEARTBEAT_S, min(compile_cache.STALE_S, timeout))


def install(rank: int, job: str) -> None:
  """Wraps JAX's compile function (once per process).

  Args:
    rank: this process's rank in the job.
    job: what tells the job from others that share the cache directory (its
      coordinator address).
  """
  global _installed, _identity
  from mpijax._src import jax_compat

  with _lock:
    _identity = (rank, job)
    if _installed:
      return
    compiler = jax_compat.compiler
    original = compiler.compile_or_get_cached

    @functools.wraps(original)
    def compile_or_get_cached(*args, **kwargs):
      return _compile(original, *args, **kwargs)

    compiler.compile_or_get_cached = compile_or_get_cached
    _installed = True
