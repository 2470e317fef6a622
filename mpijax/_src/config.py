"""Every ``MPIJAX_*`` environment variable, read in this one module.

Each setting is declared once with its type, default and a one-line doc; the
table in docs/configuration.md is written from the same facts. Values are
read from the environment when first asked for and can be overridden in code
with ``mpijax.config.update(name, value)`` (before ``mpijax.init()`` for
settings that ``init`` consumes).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Callable, Mapping
from typing import Any


def _parse_bool(text: str) -> bool:
  low = text.strip().lower()
  if low in ("1", "true", "yes", "on"):
    return True
  if low in ("0", "false", "no", "off", ""):
    return False
  raise ValueError(f"expected a boolean (1/0, true/false, yes/no, on/off), got {text!r}")


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _parse_log_level(text: str) -> str:
  name = text.strip().upper()
  name = "WARNING" if name == "WARN" else name
  if name and name not in _LOG_LEVELS:
    raise ValueError(f"expected a logging level: {', '.join(_LOG_LEVELS)}")
  return name


def _parse_seconds(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    raise ValueError("expected a number of seconds >= 0 (0 or inf: never)") from None
  if value != value or value < 0:  # NaN, or negative
    raise ValueError("expected a number of seconds >= 0 (0 or inf: never)")
  return 0.0 if value == float("inf") else value


def _parse_interval(text: str) -> float:
  value = _parse_seconds(text)
  if 0 < value < 1:
    raise ValueError("expected 0 (no periodic report) or a period of at least 1 second")
  return value


def _parse_address(text: str) -> str:
  text = text.strip()
  host, sep, port = text.rpartition(":")
  if text and not (sep and host and port.isdigit() and 0 < int(port) < 65536):
    raise ValueError("expected 'host:port' with a port in 1..65535, e.g. '10.0.0.1:12345'")
  return text


def _parse_int(text: str) -> int:
  try:
    return int(text)
  except ValueError:
    raise ValueError("expected an integer, e.g. 65536") from None


def _parse_float(text: str) -> float:
  try:
    return float(text)
  except ValueError:
    raise ValueError("expected a number, e.g. 50 or 2.5") from None


def _parse_optional_int(text: str) -> int | None:
  return None if text.strip() == "" else _parse_int(text)


def _parse_count(text: str) -> int:
  value = _parse_int(text)
  if value < 0:
    raise ValueError("expected an integer >= 0")
  return value


_SIZE_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "kb": 1 << 10, "k": 1 << 10,
               "mib": 1 << 20, "mb": 1 << 20, "m": 1 << 20}


def _parse_sizes(text: str) -> tuple[int, ...]:
  out = []
  for part in text.replace(" ", "").split(","):
    digits = part.rstrip("bBkKmMiI")
    unit = part[len(digits):].lower()
    if not digits.isdigit() or unit not in _SIZE_UNITS or int(digits) * _SIZE_UNITS[unit] < 4:
      raise ValueError("expected sizes of 4 bytes or more, comma-separated, e.g. 8,4KiB,4MiB")
    out.append(int(digits) * _SIZE_UNITS[unit] // 4 * 4)
  return tuple(sorted(set(out)))


def _parse_collectives(text: str) -> str:
  value = text.strip().lower()
  if value not in ("auto", "mpi", "gloo"):
    raise ValueError("expected auto, mpi or gloo")
  return value


def _parse_spin(text: str) -> str:
  value = text.strip().lower()
  if value not in ("auto", "on", "off"):
    raise ValueError("expected auto, on or off")
  return value


def _parse_dispatch(text: str) -> str:
  value = text.strip().lower()
  if value not in ("inline", "async"):
    raise ValueError("expected inline or async")
  return value


def _parse_stall_action(text: str) -> str:
  value = text.strip().lower()
  if value not in ("abort", "warn"):
    raise ValueError("expected abort (report the stall, then end the job) or warn")
  return value


# The launcher detectors' names (mpijax/_src/cluster/).
_LAUNCHERS = ("openmpi4", "prrte", "slurm", "mpich", "mpi", "single")


def _parse_launcher(text: str) -> str:
  value = text.strip()
  if value and value not in _LAUNCHERS:
    raise ValueError(f"expected one of {', '.join(_LAUNCHERS)} (or unset: detect it)")
  return value


def _parse_cpu_bind(text: str) -> str:
  value = text.strip().lower()
  if value not in ("auto", "none"):
    raise ValueError("expected auto or none")
  return value


def _parse_compile_cache(text: str) -> str:
  value = text.strip()
  if value.lower() in ("auto", "off", ""):
    return value.lower() or "auto"
  if not os.path.isabs(os.path.expanduser(value)):
    raise ValueError("expected auto, off or an absolute directory path")
  return value


@dataclasses.dataclass(frozen=True)
class Setting:
  name: str  # without the MPIJAX_ prefix, lower case
  parse: Callable[[str], Any]
  default: Any
  doc: str
  env: str | None = None  # a variable of another project's convention, read as is

  @property
  def env_var(self) -> str:
    return self.env or "MPIJAX_" + self.name.upper()


_SETTINGS: dict[str, Setting] = {}
_OVERRIDES: dict[str, Any] = {}


def _define(name: str, parse: Callable[[str], Any], default: Any, doc: str,
            env: str | None = None) -> Setting:
  setting = Setting(name, parse, default, doc, env)
  _SETTINGS[name] = setting
  return setting


# --- runtime -------------------------------------------------------------
_define("devices_per_process", _parse_optional_int, None,
        "CPU devices per rank. Unset: keep the user's XLA_FLAGS / "
        "jax_num_cpu_devices, else 1.")
_define("jax_distributed", _parse_bool, True,
        "In a job of more than one rank, init() starts JAX's distributed "
        "runtime (jax.distributed.initialize with mpijax's coordinator), so "
        "jax.process_index(), jax.process_count() and jax.devices() see every "
        "rank and global jax.Arrays span them. 0: JAX sees this process only.")
_define("xla_collectives", _parse_collectives, "auto",
        "Transport of the cross-process collectives XLA itself inserts (jit "
        "over global jax.Arrays) when JAX's distributed runtime is on. auto: "
        "MPI, through mpijax's bridge library, wherever XLA's MPI collectives "
        "can serve (any number of CPU devices per rank; a jaxlib that accepts "
        "the bridge), else gloo with a warning; mpi: the same, but an error "
        "where they cannot; gloo: JAX's TCP collectives (MPITRAMPOLINE_LIB is "
        "then not set).")
_define("xla_dispatch", _parse_dispatch, "inline",
        "Where XLA runs a jitted program when its collectives go over MPI. "
        "inline: on the thread that calls it, as XLA already does for programs "
        "of under 1,000 flops (jax_cpu_enable_async_dispatch=False); async: on "
        "XLA's thread pool, which costs two thread hand-offs per call (a jitted "
        "4 KiB all-reduce, 2 ranks: about 47 us instead of 8) and lets Python run "
        "ahead of the computation.")
_define("xla_spin", _parse_spin, "auto",
        "Whether the idle workers of XLA's CPU thread pools spin before they "
        "sleep, as jaxlib has them do for a process that owns the machine. "
        "auto: not where this node's ranks times local CPU devices exceed the "
        "cores the node's ranks may use together (the union of their affinity "
        "masks); off: no spinning on any node; on: jaxlib's spinning everywhere. "
        "init() clears the pools' spinning switch, only on a jaxlib build it "
        "was verified on (docs/jax-integration.md); elsewhere they keep "
        "spinning and MPIJAX_LOG_LEVEL=DEBUG says why (with off: a warning).")
_define("coordinator_port", _parse_optional_int, None,
        "Port for the coordinator. Unset: rank 0 asks the OS for a free port.")
_define("coordinator_host", str, "",
        "Address the coordinator binds and advertises. Unset: rank 0's "
        "address on the interface that routes to the other ranks.")
_define("heap_cache_bytes", _parse_int, 1 << 30,
        "Freed host memory below this size stays in the process heap for reuse "
        "(glibc: one malloc arena, mmap and trim thresholds at this value), so "
        "XLA's output buffers are not page-faulted afresh on every call. Set "
        "when mpijax is imported; 0 keeps glibc's defaults.")
_define("huge_pages", _parse_bool, True,
        "mpijax-run asks glibc to back the heap with transparent huge pages "
        "(it exports GLIBC_TUNABLES=glibc.malloc.hugetlb=1, added to the user's "
        "GLIBC_TUNABLES unless that already sets it): fewer TLB misses when MPI "
        "and XLA stream through large buffers. Needs THP 'madvise' or 'always' in "
        "/sys/kernel/mm/transparent_hugepage/enabled. Read by the launcher only.")
_define("cpu_bind", _parse_cpu_bind, "auto",
        "auto: where a node runs more ranks than it has cores (what the "
        "launcher's local rank and size say, against the cores the rank may "
        "use), each rank binds itself to one core, round robin, when mpijax is "
        "imported: ranks that wait for each other are then not queued behind "
        "one another by the kernel (4 ranks on 2 cores: jitted collectives of "
        "4 B to 256 KiB 1-5x faster and steady from job to job; of 4 MiB up "
        "to 1.5x slower). With a core or more per rank, for a rank its "
        "launcher (or a cpuset) already bound to fewer than all cores, or with "
        "MPIJAX_XLA_COLLECTIVES=gloo (whose threads need the cores), nothing "
        "is bound. none: never.")
_define("compile_cache", _parse_compile_cache, "auto",
        "The compile cache (docs/long-jobs.md). auto: mpijax-run gives the job "
        "JAX's persistent compilation cache in $XDG_CACHE_HOME/mpijax/jax (else "
        "~/.cache/mpijax/jax) unless JAX_COMPILATION_CACHE_DIR is set; a path: that "
        "directory instead (init() applies it too, under any launcher); off: none "
        "from mpijax, and JAX's own cache, if set, works as JAX has it (process 0 "
        "writes). With a cache directory every rank reads and writes it, a program "
        "each rank jits on its own devices has one key on every rank, and one rank "
        "compiles a program while the others that need it wait and load it.")
_define("abort_on_exception", _parse_bool, True,
        "init() installs a hook that aborts the whole job when any rank "
        "has an uncaught exception.")
_define("launcher", _parse_launcher, "",
        "Force a launcher detector by name (openmpi4, prrte, slurm, mpich, mpi, single).")
_define("jax_coordinator_address", _parse_address, "",
        "JAX's own variable: the coordinator address ('host:port') init() uses "
        "instead of rank 0 picking one, as jax.distributed.initialize() does. "
        "init(coordinator_address=...) beats it. Must be the same on every rank.",
        env="JAX_COORDINATOR_ADDRESS")

# --- transport and safety (layers 3 and 8) -----------------------------------
_define("timeout", _parse_seconds, 300.0,
        "Seconds a collective may wait before the stall inspector reports "
        "the missing ranks, and init() for the ranks that have not called it "
        "(docs/troubleshooting.md). 0 (or inf) disables both.")
_define("stall_action", _parse_stall_action, "abort",
        "What a stall does after reporting: 'abort' the job or only 'warn'.")
_define("check", _parse_bool, False,
        "Compare every collective call's signature across ranks (slower); "
        "by default each call site of a compiled program is compared once, "
        "on its first run. Also makes GlobalArray.from_process_local and "
        "from_global hash and compare every byte of the copies that must be "
        "equal across ranks (by default up to 64 sampled elements). Must be "
        "the same on every rank.")
_define("max_chunk_bytes", _parse_int, 1 << 30,
        "Largest single MPI message; bigger buffers are sent in chunks.")
_define("blocking_min_bytes", _parse_int, 0,
        "From this message size on, a collective runs MPI's blocking "
        "algorithm, guarded against stalls by the watchdog thread; smaller "
        "ones are polled nonblocking calls, which were slower at every size "
        "measured (default 0: every call blocks). Without the stall inspector's "
        "watchdog, blocking calls start at 64 KiB and first wait for every rank "
        "in a polled MPI_Ibarrier. With several local devices per rank every "
        "call is polled: their threads blocked in MPI at once slow each other "
        "down.")
_define("ring_min_bytes", _parse_int, 128 * 1024,
        "From this many bytes per rank (message size / ranks) on, an all-reduce "
        "runs mpijax's ring (reduce-scatter then allgather by neighbour "
        "exchange, no copy of the input) instead of MPI_Allreduce. 0 turns "
        "the ring off. Must be the same on every rank.")
_define("ring_in_place_min_bytes", _parse_int, 4 << 20,
        "The same threshold for an all-reduce in place (a donated or "
        "intermediate operand), where the ring saves no input copy and MPI's "
        "blocking algorithm is as fast up to a few MiB (with several local "
        "devices per rank MPI's call is polled, and MPIJAX_RING_MIN_BYTES "
        "applies). 0 turns it off.")
_define("shm_max_bytes", _parse_int, 1 << 20,
        "All-reduces of up to this many bytes that run neither by cross-memory "
        "attach nor the ring, on a communicator whose ranks all run on one node, "
        "go through node-local shared memory (one POSIX shm file per "
        "communicator and local device, unlinked as soon as every rank has mapped it) instead "
        "of MPI: no MPI message, rendezvous or kernel copy. Also each rank's "
        "segment size (per device in a reduction over every local device), fixed "
        "at the communicator's first such all-reduce. 0 "
        "turns it off. Must be the same on every rank.")
_define("cma_min_bytes", _parse_int, 64 * 1024,
        "All-reduces of at least this many bytes, on a communicator whose ranks "
        "all run on one node, are reduced by "
        "cross-memory attach: each rank reads its block of the others' inputs "
        "and writes the result into their outputs (process_vm_readv/writev: "
        "one kernel copy, no MPI message). Goes before the ring and shared "
        "memory. 0 turns it off; it is also off, by itself, where the kernel "
        "refuses cross-memory attach between the ranks (ptrace restrictions, "
        "container seccomp profiles). Must be the same on every rank.")
_define("wait_spin_us", _parse_float, 50.0,
        "Microseconds a rank waiting for the others (a node-local all-reduce, "
        "a polled MPI request) spins before it sleeps: node-local waits until "
        "the rank it waits for wakes it (a futex in the shared segment), MPI "
        "waits between polls that grow with the time waited (up to 1 ms, a "
        "sixteenth of the wait so far; the waiting thread's timer slack is "
        "set to 1 us so a nap ends on time). A spinning waiter holds a core that "
        "a rank still computing its step may need: with as many ranks per "
        "node as cores, each rank's XLA threads use them all. Where a node runs "
        "more ranks than it has cores, a polled MPI wait spins at least 1 ms "
        "and yields the core after every poll, as MPI's own waits do there: "
        "the rank it waits for may need that very core (4 ranks on 2 cores: "
        "a jitted 256 KiB collective-permute 1.6x faster). Negative: never "
        "sleep (spin, yielding now and then), for a core per rank and the "
        "last microseconds of latency. Must be the same on every rank only "
        "for the same timing.")
_define("hierarchical_min_bytes", _parse_int, 64 * 1024,
        "From this size on, psum over several local devices reduce-scatters "
        "locally before the MPI step (where the node-local all-reduce over "
        "every device does not apply).")
_define("device_allreduce", _parse_bool, True,
        "psum/pmax/pmin over a mesh axis that spans every local device of "
        "every rank, with the ranks on one node: every (rank, device) takes "
        "part in one node-local all-reduce (cross-memory attach from "
        "MPIJAX_CMA_MIN_BYTES, shared memory below), instead of a local XLA "
        "collective around an MPI all-reduce per device. Read when a program "
        "is traced. 0 turns it off.")

# --- messages ----------------------------------------------------------------
_define("log_level", _parse_log_level, "",
        "Level of the 'mpijax' logger (DEBUG, INFO, WARNING, ERROR, CRITICAL), "
        "set when mpijax is imported. Unset: INFO (every rank's warnings, rank "
        "0's notices) unless the program set the logger's level first. DEBUG "
        "also shows the other ranks' notices.")

_define("timeline", str, "",
        "File for the collective timeline: every rank's mpijax calls (split "
        "into waiting for the other ranks and moving data) and training steps, "
        "merged by rank 0 at exit into one Chrome-trace / Perfetto JSON (see "
        "docs/timeline.md). init(timeline=...) beats it. Unset: off.")

_define("stragglers", _parse_bool, True,
        "The straggler report (docs/troubleshooting.md): every collective, mpijax's "
        "and XLA's over the bridge, stamps when each rank entered it; rank 0 finds "
        "the rank that arrived last and logs one line at the end of the job, and "
        "one every MPIJAX_STRAGGLER_INTERVAL seconds while one rank is consistently "
        "late. 0 turns it off.")
_define("straggler_interval", _parse_interval, 60.0,
        "Seconds between the straggler report's exchanges, at least 1 (a line comes "
        "only for a period with a straggler). 0 (or inf): only the report at the end "
        "of the job.")

# --- training ------------------------------------------------------------
_define("bucket_bytes", _parse_int, 64 << 20,
        "Default size of a fused gradient all-reduce bucket.")
_define("overlap", _parse_bool, False,
        "mpijax.train all-reduces each gradient bucket with its own call as "
        "soon as the backward pass has computed it (buckets in reverse layer "
        "order, as PyTorch DDP), instead of every bucket in one call after "
        "the backward pass. The same result bit for bit. Must be the same on "
        "every rank.")
_define("overlap_bucket_bytes", _parse_int, 4 << 20,
        "Largest gradient bucket when the all-reduce overlaps the backward "
        "pass (MPIJAX_OVERLAP): smaller buckets start earlier, larger ones "
        "make fewer calls.")
_define("fuse_leaf_bytes", _parse_int, 256 << 10,
        "Gradient leaves of at least this many bytes are all-reduced on their "
        "own, without the packing copy; smaller leaves share buckets.")
_define("job_files", str, "",
        "Set by mpijax-run on every rank: a directory of the job's own in which each "
        "rank notes its process id and the shared-memory files it maps, so that "
        "mpijax-run removes what a job that ended abnormally leaves in /dev/shm. "
        "Unset: nothing is noted.")
_define("arrivals", str, "",
        "Set by mpijax-run on every rank: where mpijax-run listens for each rank's word "
        "that it started and entered init(), so that ranks waiting in init() for one "
        "that never calls it name that rank and say where it is (its Python stack). "
        "Unset: init() reports such a wait without the names.")
_define("restart_attempt", _parse_count, 0,
        "Which run of a restarted job this is: 0 on the first run, 1 on the first "
        "restart, ... Set on every rank by mpijax-run --max-restarts; read with "
        "mpijax.train.restart_attempt().")
_define("run", _parse_bool, False,
        "Set by mpijax-run on every rank: mpijax-run starts each line of the rank's "
        "output with [rankN]: and has checked the MPIJAX_* settings before the launch, "
        "so mpijax's own messages leave out their rank tag and init() does not check "
        "the settings' names again.")

# --- the doctor (mpijax-run --doctor, python -m mpijax doctor) ----------------
_define("doctor_sizes", _parse_sizes, (8, 4096, 262144, 4194304),
        "Bytes per rank of the doctor's all-reduce sweep, comma-separated (KiB and MiB "
        "suffixes allowed), within a node and across nodes: the smallest gives the "
        "latency, the largest the bandwidth compared with the expected figure.")
_define("doctor_shm_bytes", _parse_count, 0,
        "The /dev/shm space the doctor requires on each node, in bytes. 0: what the "
        "job's ranks need there (Open MPI's 16 MiB per rank, mpijax's node-local "
        "segments at MPIJAX_SHM_MAX_BYTES per rank and device).")

# --- building ----------------------------------------------------------------
_define("mpicc", str, "",
        "The MPI compiler wrapper (mpicc) whose MPI the C++ extension is built "
        "against, by pip install (CMakeLists.txt). Unset: $MPICC, else the mpicc "
        "of the MPI mpi4py loads, else the one on PATH. Not read at run time.")

# Names of the test suite's and the benchmarks' own variables: not settings of
# mpijax, and not reported as unknown.
RESERVED_PREFIXES = ("MPIJAX_TEST_", "MPIJAX_BENCH_")


# Settings read while a program is traced or lowered: they shape the compiled
# program, so the compile cache's key holds them (compile_hook.program_key).
BAKED = (
  "device_allreduce",
  "hierarchical_min_bytes",
  "shm_max_bytes",
  "cma_min_bytes",
  "bucket_bytes",
  "overlap",
  "overlap_bucket_bytes",
  "fuse_leaf_bytes",
)


def settings() -> list[Setting]:
  """All declared settings, in declaration order."""
  return list(_SETTINGS.values())


def get(name: str, env: Mapping[str, str] | None = None) -> Any:
  """The value of setting ``name``: an override, else the environment, else the default.

  ``env`` replaces ``os.environ``: the launcher reads the settings its ranks
  will see.
  """
  try:
    setting = _SETTINGS[name]
  except KeyError:
    raise KeyError(f"mpijax has no setting {name!r}; known: {sorted(_SETTINGS)}") from None
  if name in _OVERRIDES:
    return _OVERRIDES[name]
  raw = (os.environ if env is None else env).get(setting.env_var)
  if raw is None:
    return setting.default
  try:
    return setting.parse(raw)
  except ValueError as e:
    raise ValueError(
        f"{setting.env_var}={raw!r} is not valid: {e}. {setting.doc}") from None


def parse(name: str, value: Any) -> Any:
  """``value`` (a string or an already typed value) checked as setting ``name`` is."""
  setting = _SETTINGS[name]
  try:
    return setting.parse(str(value))
  except ValueError as e:
    raise ValueError(f"{setting.env_var}={value!r} is not valid: {e}. {setting.doc}") from None


def update(name: str, value: Any) -> None:
  """Overrides setting ``name`` for this process (beats the environment)."""
  if name not in _SETTINGS:
    raise KeyError(f"mpijax has no setting {name!r}; known: {sorted(_SETTINGS)}")
  _OVERRIDES[name] = value


def reset(name: str | None = None) -> None:
  """Drops overrides made with :func:`update` (all of them when ``name`` is None)."""
  if name is None:
    _OVERRIDES.clear()
  else:
    _OVERRIDES.pop(name, None)


def unknown(env: Mapping[str, str] | None = None) -> list[tuple[str, str | None]]:
  """(name, closest known name or None) of each ``MPIJAX_*`` variable set in
  ``env`` (default ``os.environ``) that is no setting of mpijax."""
  env = os.environ if env is None else env
  known = [s.env_var for s in _SETTINGS.values()]
  out = []
  for name in sorted(env):
    if not name.startswith("MPIJAX_") or name in known or name.startswith(RESERVED_PREFIXES):
      continue
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    out.append((name, close[0] if close else None))
  return out


def unknown_message(name: str, closest: str | None) -> str:
  """One line on an unknown ``MPIJAX_*`` variable: that it is ignored, and the fix."""
  fix = (f"did you mean {closest}?" if closest
         else "the settings are listed in docs/configuration.md")
  return f"{name} is not an mpijax setting and is ignored ({fix})"


def problems(env: Mapping[str, str] | None = None) -> list[str]:
  """Why each setting set in ``env`` (default ``os.environ``) does not parse:
  the variable, its value and the expected form; empty when all do."""
  env = os.environ if env is None else env
  out = []
  for s in _SETTINGS.values():
    raw = env.get(s.env_var)
    if raw is None:
      continue
    try:
      s.parse(raw)
    except ValueError as e:
      out.append(f"{s.env_var}={raw!r} is not valid: {e}")
  return out


def markdown_table() -> str:
  """The table of docs/configuration.md (``python -m mpijax._src.config_table``)."""
  rows = ["| variable | default | meaning |", "|---|---|---|"]
  for s in settings():
    default = "unset" if s.default in (None, "") else repr(s.default)
    rows.append(f"| `{s.env_var}` | {default} | {s.doc} |")
  return "\n".join(rows)

