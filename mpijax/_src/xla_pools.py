"""XLA's CPU thread pools, kept from spinning where ranks oversubscribe a node.

jaxlib's CPU client runs its work on Eigen thread pools built for a process
that owns the machine: a worker that runs out of tasks spins (Eigen's
``ThreadPoolTempl::WorkerLoop`` calls ``GlobalSteal`` about 5000 / threads
times) before it sleeps, and nothing in jaxlib turns that off. Where the
ranks' device threads outnumber the cores, those spins take the cores the
other ranks' device threads need to reach a collective: 2 ranks x 2 devices
on 2 cores spent 52-62 % of both cores in that loop during a jitted 4-byte
all-reduce, and without it the call took 53 instead of 267 us.

:func:`quiet` finds the pools in this process and clears their spinning
switch (``allow_spinning_``) and budget (``spin_count_``), which every
worker reads before each spin; an idle worker then sleeps at once and is
woken by the next task. The pools are found by their C++ type, not guessed:
the type's name in ``libjax_common.so``, its typeinfo, its vtable, then the
heap objects whose first word is that vtable and whose fields hold what
Eigen's constructor stored there. Memory is read and written through
``/proc/self/mem``, which fails instead of faulting. Any mismatch (another
jaxlib's layout) leaves everything as it was.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import numpy as np

# The mangled name of Eigen::ThreadPoolTempl<tsl::thread::EigenEnvironment>,
# as its typeinfo spells it.
_TYPE_NAME = b"N5Eigen15ThreadPoolTemplIN3tsl6thread16EigenEnvironmentEEE"
_LIBRARY = "libjax_common.so"
# Fields of the pool object (jaxlib 0.10, x86-64): num_threads_ (int),
# allow_spinning_ (bool), spin_count_ (int) = 5000 / num_threads_ where
# spinning is allowed, else 0.
_NUM_THREADS, _ALLOW_SPINNING, _SPIN_COUNT = 0x48, 0x4C, 0x50
_SPIN_BUDGET = 5000
_CHUNK = 16 << 20  # bytes read at a time while scanning


@dataclass(frozen=True)
class PoolReport:
  """What :func:`quiet` found and changed."""

  pools: int  # Eigen pools found in this process
  quieted: int  # ... whose spinning this call turned off
  reason: str = ""  # why nothing could be done, else ""


@dataclass(frozen=True)
class _Mapping:
  lo: int
  hi: int
  perms: str
  path: str


def _mappings() -> list[_Mapping]:
  out = []
  with open("/proc/self/maps") as f:
    for line in f:
      parts = line.split(maxsplit=5)
      lo, hi = (int(x, 16) for x in parts[0].split("-"))
      out.append(_Mapping(lo, hi, parts[1], parts[5].strip() if len(parts) > 5 else ""))
  return out


class _Memory:
  """This process's memory through /proc/self/mem: a bad address reads as nothing.

  Every scan reads into one buffer of its own, which the scans skip and which
  is zeroed before it is freed: a copy of a pool object left in freed memory
  would otherwise pass for the pool on a later scan.
  """

  def __init__(self, writable: bool):
    self.fd = os.open("/proc/self/mem", os.O_RDWR if writable else os.O_RDONLY)
    self.buf = np.zeros(_CHUNK + 4096, np.uint8)
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

  def chunks(self, mappings: list[_Mapping], overlap: int = 0):
    """(address, bytes there) over ``mappings``, a buffer at a time; chunks
    overlap by ``overlap`` bytes."""
    view = memoryview(self.buf)
    for m in mappings:
      for at in range(m.lo, m.hi, _CHUNK):
        want = min(_CHUNK + overlap, m.hi - at)
        try:
          got = os.preadv(self.fd, [view[:want]], at)
        except OSError:
          continue
        yield at, self.buf[:got]

  def find_words(self, mappings: list[_Mapping], value: int) -> list[int]:
    """Addresses of the 8-byte-aligned words equal to ``value`` in ``mappings``."""
    hits: list[int] = []
    for at, data in self.chunks(mappings):
      words = data[: len(data) // 8 * 8].view("<u8")
      hits.extend(at + 8 * int(i) for i in np.flatnonzero(words == value))
    lo, hi = self.own
    return [h for h in hits if not lo <= h < hi]

  def find_bytes(self, mappings: list[_Mapping], needle: bytes) -> list[int]:
    """Addresses of ``needle`` in ``mappings``."""
    pattern = re.compile(re.escape(needle))
    hits = {
      at + m.start()
      for at, data in self.chunks(mappings, overlap=len(needle))
      for m in pattern.finditer(memoryview(data))
    }
    return sorted(hits)


def _fields(mem: _Memory, obj: int) -> tuple[int, int, int] | None:
  """(num_threads_, allow_spinning_, spin_count_) where ``obj`` holds what
  Eigen's constructor stores there, else None."""
  b = mem.read(obj + _NUM_THREADS, _SPIN_COUNT + 4 - _NUM_THREADS)
  if len(b) != _SPIN_COUNT + 4 - _NUM_THREADS:
    return None
  threads = int.from_bytes(b[0:4], "little", signed=True)
  allow = b[_ALLOW_SPINNING - _NUM_THREADS]
  spin = int.from_bytes(b[_SPIN_COUNT - _NUM_THREADS :][:4], "little", signed=True)
  if not 1 <= threads <= 1 << 16 or allow not in (0, 1):
    return None
  if spin != (_SPIN_BUDGET // threads if allow else 0):
    return None
  return threads, allow, spin


def _pools(mem: _Memory) -> tuple[list[int], str]:
  """The addresses of this process's Eigen pools, or [] and why."""
  maps = _mappings()
  lib = [m for m in maps if m.path.endswith("/" + _LIBRARY)]
  if not lib:
    return [], f"jaxlib's {_LIBRARY} is not loaded"
  data = [m for m in lib if "x" not in m.perms and m.perms.startswith("r")]
  needle = b"\0" + _TYPE_NAME + b"\0"
  names = [at + 1 for at in mem.find_bytes(data, needle)]
  if not names:
    return [], f"{_LIBRARY} has no Eigen thread pool type (another jaxlib?)"
  # typeinfo: [its own vptr, the name]; vtable: [offset, typeinfo, slots...],
  # an object's first word pointing at the slots.
  typeinfos = [w - 8 for name in names for w in mem.find_words(data, name)]
  vptrs = {w + 8 for ti in typeinfos for w in mem.find_words(data, ti)}
  if not vptrs:
    return [], f"{_LIBRARY}: no vtable of the Eigen thread pool type"
  heap = [m for m in maps if m.path == "[heap]" and m.perms.startswith("rw")]
  anon = [m for m in maps if m.path == "" and m.perms.startswith("rw")]
  for where in (heap, anon):  # the main heap holds them; anonymous maps else
    objs = sorted(
      {o for v in vptrs for o in mem.find_words(where, v) if _fields(mem, o) is not None}
    )
    if objs:
      return objs, ""
  return [], "no Eigen thread pool on the heap"


def pools() -> list[tuple[int, int, int]]:
  """(num_threads, allow_spinning, spin_count) of each Eigen pool in this process."""
  mem = _Memory(writable=False)
  try:
    objs, _ = _pools(mem)
    return [f for f in (_fields(mem, o) for o in objs) if f is not None]
  finally:
    mem.close()


def quiet() -> PoolReport:
  """Turns off the idle spinning of every Eigen thread pool of this process's
  XLA CPU client (see the module's doc). Never raises."""
  try:
    mem = _Memory(writable=True)
  except OSError as e:
    return PoolReport(0, 0, f"/proc/self/mem: {e.strerror}")
  try:
    objs, reason = _pools(mem)
    quieted = 0
    for obj in objs:
      fields = _fields(mem, obj)
      if fields is None or not fields[1]:
        continue
      try:
        os.pwrite(mem.fd, b"\0", obj + _ALLOW_SPINNING)
        os.pwrite(mem.fd, b"\0\0\0\0", obj + _SPIN_COUNT)
      except OSError as e:
        return PoolReport(len(objs), quieted, f"writing a pool's fields: {e.strerror}")
      quieted += 1
    return PoolReport(len(objs), quieted, reason)
  except Exception as e:  # never let this break init()
    return PoolReport(0, 0, f"{type(e).__name__}: {e}")
  finally:
    mem.close()


# The report of the last settle() that quieted the pools (tests, diagnostics).
last: PoolReport | None = None


def settle(mode: str, *, local_ranks: int, local_devices: int, platform: str) -> PoolReport | None:
  """Applies setting ``xla_spin`` (``mode``) for a rank of ``local_ranks`` on
  its node with ``local_devices`` devices: the report of :func:`quiet`, or
  None where the pools keep spinning."""
  global last
  if mode == "on" or platform != "cpu":
    return None
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  if mode == "auto" and local_ranks * local_devices <= (cores or 1):
    return None
  last = quiet()
  return last
