"""XLA's CPU thread pools, kept from spinning where a node's ranks oversubscribe its cores.

jaxlib's CPU client runs its work on Eigen thread pools built for a process
that owns the machine: a worker that runs out of tasks spins (Eigen's
``ThreadPoolTempl::WorkerLoop`` polls every queue about 5000 / threads
times) before it sleeps. XLA builds its pools so (``low_latency_hint``), and
no client option, flag or environment variable changes that. Where a node's
ranks x local devices exceed the cores its ranks may use, those spins take
the cores the other ranks' device threads need to reach a collective
(``benchmarks/xla_spin.py`` measures a jitted all-reduce with and without).

:func:`settle` then clears each pool's spinning switch (``allow_spinning_``)
and budget (``spin_count_``), which a worker reads before it spins; an idle
worker sleeps at once and the next task wakes it. That writes into jaxlib's
memory, so it is done only

* on a jaxlib build it was verified on (:data:`VERIFIED`: jaxlib's version
  and the sha256 of ``libjax_common.so``, which has no build id; the digest
  is kept per file in the user's cache directory), where the vtable and the
  fields are at offsets read from that build's symbol table and constructor;
* on objects in the ``[heap]`` mapping whose first word is that vtable and
  whose fields hold what Eigen's constructor stored; no other mapping is
  searched;
* through ``/proc/self/mem``, which fails instead of faulting; what was
  written is read back, and restored where it does not hold.

Anything else leaves the pools as built, and the report says why.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import time
from dataclasses import dataclass

import numpy as np

from mpijax._src import mpi_util

# The mangled name of Eigen::ThreadPoolTempl<tsl::thread::EigenEnvironment>,
# as its typeinfo spells it.
_TYPE_NAME = b"N5Eigen15ThreadPoolTemplIN3tsl6thread16EigenEnvironmentEEE"
_LIBRARY = "libjax_common.so"
_SPIN_BUDGET = 5000  # Eigen's kSpinCount: spin_count_ = 5000 / num_threads_
_CHUNK = 16 << 20  # bytes read at a time while scanning the heap
_LOCK_SECONDS = 60.0  # hashing the library takes seconds; another rank's lock longer is stuck


@dataclass(frozen=True)
class Layout:
  """Where a verified build keeps the pool's parts, in bytes."""

  vtable: int  # the vtable's address point, from the library's load address
  num_threads: int  # int num_threads_
  allow_spinning: int  # bool allow_spinning_
  spin_count: int  # int spin_count_


# (jaxlib version, sha256 of libjax_common.so) -> Layout; every other build is
# left as built. jaxlib 0.10.2, manylinux_2_27 x86-64: .symtab puts the vtable
# _ZTVN5Eigen15ThreadPoolTemplIN3tsl6thread16EigenEnvironmentEEE at 0xe3b3dd0
# (address point + 16), and ThreadPoolTempl(int, bool, Env) (at 0x7987c50)
# stores num_threads_, allow_spinning_ and spin_count_ at 0x48, 0x4c, 0x50.
VERIFIED: dict[tuple[str, str], Layout] = {
  ("0.10.2", "2e0ff3956f5d8e24368171568cc9f8a2465bd875f33ff427ce2b418fbb735f85"): Layout(
    vtable=0xE3B3DE0, num_threads=0x48, allow_spinning=0x4C, spin_count=0x50
  ),
}


@dataclass(frozen=True)
class PoolReport:
  """What :func:`settle`, :func:`quiet` or :func:`spin` found and changed."""

  pools: int  # Eigen pools found in this process
  changed: int  # ... whose spinning this call turned off (or on)
  reason: str = ""  # why the pools were left as built, else ""
  wanted: bool = True  # False where the setting or the node did not ask for a change


@dataclass(frozen=True)
class _Mapping:
  lo: int
  hi: int
  perms: str
  offset: int
  inode: int
  path: str


def _mappings() -> list[_Mapping]:
  out = []
  with open("/proc/self/maps") as f:
    for line in f:
      parts = line.split(maxsplit=5)
      lo, hi = (int(x, 16) for x in parts[0].split("-"))
      path = parts[5].strip() if len(parts) > 5 else ""
      out.append(_Mapping(lo, hi, parts[1], int(parts[2], 16), int(parts[4]), path))
  return out


# --- the build ----------------------------------------------------------------


def _cache_file() -> str:
  base = os.environ.get("XDG_CACHE_HOME", "")
  if not os.path.isabs(base):  # XDG: a relative value is ignored
    base = os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "mpijax", "jaxlib-sha256.json")


def _read_cache(path: str) -> dict:
  try:
    with open(path) as f:
      data = json.load(f)
    return data if isinstance(data, dict) else {}
  except (OSError, ValueError):
    return {}


def _file_key(st: os.stat_result) -> list[int]:
  return [st.st_ino, st.st_size, st.st_mtime_ns]


def sha256(path: str, *, inode: int | None = None) -> str:
  """The sha256 of the file at ``path``, remembered per (path, inode, size,
  mtime_ns) in the user's cache directory: hashing libjax_common.so (350 MB)
  takes seconds. Ranks that start together hash it once, under a lock.
  OSError where the file is not ``inode`` (another file than the one loaded)."""
  cache = _cache_file()
  with open(path, "rb") as f:
    key = _file_key(os.fstat(f.fileno()))
    if inode is not None and key[0] != inode:
      raise OSError(errno.ESTALE, "not the file this process loaded (replaced on disk)")
    known = _cached(cache, path, key)
    if known:
      return known
    lock = None
    try:
      try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        lock = os.open(cache + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        _flock(lock)
      except OSError:
        pass  # an unwritable home, or a lock held too long: hash it here too
      known = _cached(cache, path, key)  # another rank may have hashed it meanwhile
      if known:
        return known
      digest = hashlib.sha256()
      buf = bytearray(4 << 20)
      view = memoryview(buf)
      while n := f.readinto(buf):
        digest.update(view[:n])
      text = digest.hexdigest()
      _remember(cache, path, key, text)
      return text
    finally:
      if lock is not None:
        os.close(lock)  # releases the lock


def _flock(fd: int) -> None:
  """Takes the lock on ``fd``, waiting at most _LOCK_SECONDS (a stopped
  process that holds it must not stop init()); OSError after that."""
  deadline = time.monotonic() + _LOCK_SECONDS
  while True:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      return
    except BlockingIOError:
      if time.monotonic() > deadline:
        raise
      time.sleep(0.05)


def _cached(cache: str, path: str, key: list[int]) -> str:
  entry = _read_cache(cache).get(path)
  if isinstance(entry, dict) and entry.get("key") == key and isinstance(entry.get("sha256"), str):
    return entry["sha256"]
  return ""


def _remember(cache: str, path: str, key: list[int], digest: str) -> None:
  data = {p: e for p, e in _read_cache(cache).items() if os.path.exists(p)}
  data[path] = {"key": key, "sha256": digest}
  tmp = f"{cache}.{os.getpid()}.tmp"
  try:
    with open(tmp, "w") as f:
      json.dump(data, f, indent=1)
    os.replace(tmp, cache)  # atomic: a reader sees the old file or the new one
  except OSError:
    pass


def _build(maps: list[_Mapping]) -> tuple[Layout | None, int, str]:
  """The verified layout of the loaded jaxlib and the library's load address,
  or (None, 0, why not)."""
  import jaxlib

  version = str(getattr(jaxlib, "__version__", "?"))
  if not any(v == version for v, _ in VERIFIED):
    return None, 0, f"jaxlib {version} is not a build the pool patch was verified on"
  lib = [m for m in maps if m.path.endswith("/" + _LIBRARY)]
  first = min(lib, key=lambda m: m.lo) if lib else None
  if first is None or first.offset != 0:
    return None, 0, f"jaxlib's {_LIBRARY} is not loaded"
  try:
    digest = sha256(first.path, inode=first.inode)
  except OSError as e:
    return None, 0, f"{first.path}: {e.strerror}"
  layout = VERIFIED.get((version, digest))
  if layout is None:
    return (
      None,
      0,
      f"jaxlib {version}'s {_LIBRARY} (sha256 {digest}) is not a build the pool "
      "patch was verified on",
    )
  return layout, first.lo, ""


# --- the pools ----------------------------------------------------------------


class _Memory:
  """This process's memory through /proc/self/mem: a bad address reads as nothing.

  The scan reads into one buffer of its own, which it skips and which is
  zeroed before it is freed: a copy of a pool object left in freed memory
  would otherwise pass for the pool on a later scan.
  """

  def __init__(self, writable: bool):
    self.fd = os.open("/proc/self/mem", os.O_RDWR if writable else os.O_RDONLY)
    self.buf = np.zeros(_CHUNK, np.uint8)
    self.own = (self.buf.ctypes.data, self.buf.ctypes.data + self.buf.nbytes)

  def close(self) -> None:
    self.buf.fill(0)
    os.close(self.fd)

  def read(self, addr: int, n: int) -> bytes:
    if not 0 < addr < 1 << 62:
      return b""
    try:
      return os.pread(self.fd, n, addr)
    except OSError:
      return b""

  def word(self, addr: int) -> int | None:
    b = self.read(addr, 8)
    return int.from_bytes(b, "little") if len(b) == 8 else None

  def find_words(self, mappings: list[_Mapping], value: int) -> list[int]:
    """Addresses of the 8-byte-aligned words equal to ``value`` in ``mappings``."""
    hits: list[int] = []
    view = memoryview(self.buf)
    for m in mappings:
      for at in range(m.lo, m.hi, _CHUNK):
        try:
          got = os.preadv(self.fd, [view[: min(_CHUNK, m.hi - at)]], at)
        except OSError:
          continue
        words = self.buf[: got // 8 * 8].view("<u8")
        hits.extend(at + 8 * int(i) for i in np.flatnonzero(words == value))
    lo, hi = self.own
    return [h for h in hits if not lo <= h < hi]


def _raw(mem: _Memory, obj: int, layout: Layout) -> tuple[int, int, int] | None:
  """(num_threads_, allow_spinning_, spin_count_) as ``obj`` holds them, or None."""
  threads = mem.read(obj + layout.num_threads, 4)
  allow = mem.read(obj + layout.allow_spinning, 1)
  spin = mem.read(obj + layout.spin_count, 4)
  if (len(threads), len(allow), len(spin)) != (4, 1, 4):
    return None
  return (
    int.from_bytes(threads, "little", signed=True),
    allow[0],
    int.from_bytes(spin, "little", signed=True),
  )


def _fields(mem: _Memory, obj: int, layout: Layout) -> tuple[int, int, int] | None:
  """(num_threads_, allow_spinning_, spin_count_) where ``obj`` holds what
  Eigen's constructor stores there (or what :func:`quiet` leaves), else None."""
  fields = _raw(mem, obj, layout)
  if fields is None:
    return None
  threads, allow, spin = fields
  if not 1 <= threads <= 1 << 16 or allow not in (0, 1):
    return None
  if spin != (_SPIN_BUDGET // threads if allow else 0):
    return None
  return fields


def _find(mem: _Memory, maps: list[_Mapping], layout: Layout, base: int) -> tuple[list[int], str]:
  """The addresses of this process's Eigen pools, or [] and why."""
  vptr = base + layout.vtable
  # The build was verified; this only confirms the library is mapped as that
  # build lays it out: vtable[-1] is the typeinfo, whose second word names the type.
  typeinfo = mem.word(vptr - 8)
  name = mem.word(typeinfo + 8) if typeinfo else None
  if not name or mem.read(name, len(_TYPE_NAME) + 1) != _TYPE_NAME + b"\0":
    return [], f"{_LIBRARY}: no Eigen thread pool vtable at {vptr:#x}"
  heap = [m for m in maps if m.path == "[heap]" and m.perms.startswith("rw")]
  if not heap:
    return [], "this process has no [heap] mapping"
  objs = sorted(o for o in mem.find_words(heap, vptr) if _fields(mem, o, layout) is not None)
  if not objs:
    return [], "no Eigen thread pool on [heap] (no other mapping is searched)"
  return objs, ""


def _locate(mem: _Memory) -> tuple[Layout | None, list[int], str]:
  maps = _mappings()
  layout, base, reason = _build(maps)
  if layout is None:
    return None, [], reason
  objs, reason = _find(mem, maps, layout, base)
  return layout, objs, reason


def pools() -> list[tuple[int, int, int]]:
  """(num_threads, allow_spinning, spin_count) of each Eigen pool in this
  process; [] on a build that was not verified."""
  mem = _Memory(writable=False)
  try:
    layout, objs, _ = _locate(mem)
    if layout is None:
      return []
    return [f for f in (_fields(mem, o, layout) for o in objs) if f is not None]
  finally:
    mem.close()


def _put(mem: _Memory, obj: int, layout: Layout, allow: int, spin: int) -> None:
  # A worker reads both before it spins: the switch goes off before the
  # budget, and the budget is back before the switch goes on.
  writes = [
    (layout.allow_spinning, bytes([allow])),
    (layout.spin_count, spin.to_bytes(4, "little", signed=True)),
  ]
  for at, data in writes if not allow else writes[::-1]:
    if os.pwrite(mem.fd, data, obj + at) != len(data):
      raise OSError(0, f"a short write at {obj + at:#x}")


def _set(spinning: bool) -> PoolReport:
  try:
    mem = _Memory(writable=True)
  except OSError as e:
    return PoolReport(0, 0, f"/proc/self/mem: {e.strerror}")
  try:
    layout, objs, reason = _locate(mem)
    if layout is None or not objs:
      return PoolReport(0, 0, reason)
    return _apply(mem, layout, objs, spinning)
  except Exception as e:  # never let this break init()
    return PoolReport(0, 0, f"{type(e).__name__}: {e}")
  finally:
    mem.close()


def _apply(mem: _Memory, layout: Layout, objs: list[int], spinning: bool) -> PoolReport:
  """Sets the spinning of the pools at ``objs``: all of them, each read back, or none."""
  done: list[tuple[int, int, int]] = []  # (pool, allow_spinning_, spin_count_ before)
  try:
    for obj in objs:
      before = _fields(mem, obj, layout)
      if before is None:
        raise _Undo(f"the pool at {obj:#x} changed under mpijax")
      threads = before[0]
      want = (threads, 1, _SPIN_BUDGET // threads) if spinning else (threads, 0, 0)
      if before == want:
        continue
      done.append((obj, before[1], before[2]))
      try:
        _put(mem, obj, layout, *want[1:])
        after = _raw(mem, obj, layout)
      except OSError as e:
        after = f"an error ({e.strerror})"
      if after != want:
        raise _Undo(f"the pool at {obj:#x} read back {after} after mpijax wrote {want}")
    return PoolReport(len(objs), len(done))
  except Exception as e:
    undone = 0
    for obj, allow, spin_count in done:
      try:
        _put(mem, obj, layout, allow, spin_count)
        undone += 1
      except OSError:
        pass
    what = str(e) if isinstance(e, _Undo) else f"{type(e).__name__}: {e}"
    if done:
      what += f"; {undone} of the {len(done)} pools changed restored"
    return PoolReport(0, 0, what)


class _Undo(Exception):
  """A pool did not hold what mpijax read or wrote."""


def quiet() -> PoolReport:
  """Turns off the idle spinning of every Eigen thread pool of this process's
  XLA CPU client on a verified build (see the module's doc). Never raises."""
  return _set(False)


def spin() -> PoolReport:
  """Gives every pool :func:`quiet` found its spinning back, as Eigen's
  constructor set it (``benchmarks/xla_spin.py`` compares both). Never raises."""
  return _set(True)


# --- the setting --------------------------------------------------------------


def count_node_cpus(node_comm) -> int:
  """Collective over ``node_comm`` (the ranks of one node): how many CPUs the
  union of the ranks' affinity masks holds.

  The cores the job may use on the node, not this rank's own: a launcher
  that binds each rank to one core (Open MPI at 2 ranks or fewer, srun's
  task binding) still lets the node's ranks use one core each, and a rank's
  mask alone would call that node oversubscribed. The union, not the online
  CPUs: a cpuset or a shared node may give the job fewer.
  """
  if hasattr(os, "sched_getaffinity"):
    mask = sum(1 << c for c in os.sched_getaffinity(0))
  else:
    mask = (1 << (os.cpu_count() or 1)) - 1
  union = 0
  for text in mpi_util.allgather_str(node_comm, format(mask, "x")):
    union |= int(text, 16)
  return bin(union).count("1")


# The report of the last settle() (tests, diagnostics).
last: PoolReport | None = None


def settle(
  mode: str, *, local_ranks: int, local_devices: int, node_cpus: int, platform: str
) -> PoolReport:
  """Applies setting ``xla_spin`` (``mode``) for a rank of a node with
  ``local_ranks`` ranks of ``local_devices`` devices each, whose ranks may
  use ``node_cpus`` CPUs: the report of :func:`quiet`, or why the pools keep
  spinning. Never raises."""
  global last
  if mode == "on":
    last = PoolReport(0, 0, "MPIJAX_XLA_SPIN=on", wanted=False)
  elif platform != "cpu":
    last = PoolReport(0, 0, f"this rank's devices are {platform}, not CPU", wanted=False)
  elif mode == "auto" and local_ranks * local_devices <= node_cpus:
    last = PoolReport(
      0,
      0,
      f"this node's {_n(local_ranks, 'rank')} x {_n(local_devices, 'CPU device')} do not "
      f"exceed the {_n(node_cpus, 'core')} they may use",
      wanted=False,
    )
  else:
    last = quiet()
  return last


def _n(count: int, what: str) -> str:
  return f"{count} {what}" + ("" if count == 1 else "s")
