"""Host heap settings that let XLA reuse freed buffer memory.

Every jitted call writes its results into fresh XLA buffers. glibc serves a
large request (from 128 KiB, dynamically up to 32 MiB) with its own ``mmap``
and gives it back with ``munmap`` when the array dies, and it trims the heap
when its free top grows past a threshold. The next call then page-faults the
whole buffer again: the kernel zeroes every 4 KiB page on first touch. For an
all-reduce of 64 MiB on this class of machine that costs about as much as the
reduction itself, while a NumPy user who reuses an output array never pays it.

So, like the caching allocators of GPU frameworks, mpijax asks glibc to keep
freed memory for reuse: requests below ``MPIJAX_HEAP_CACHE_BYTES`` come from
the heap, the heap is not trimmed below that much free space, and all threads
share the main arena (a thread's own arena is limited to 64 MiB heaps, so its
large requests would go back to ``mmap``). Threads that already have an arena
keep it, which is why this runs when mpijax is imported (before MPI starts its
progress threads and before JAX creates its CPU thread pool), and why
``mpijax-run`` also exports the equivalent ``MALLOC_*`` variables to every rank
so they apply from the first instruction.

The cost is memory: up to ``MPIJAX_HEAP_CACHE_BYTES`` of freed memory stays
mapped in each rank. ``MPIJAX_HEAP_CACHE_BYTES=0`` keeps glibc's defaults.
Other C libraries (musl, macOS) are left alone.

Huge pages: NumPy backs its large arrays with transparent huge pages, XLA's
buffers come from the heap in 4 KiB pages, and MPI streaming through 4 KiB
pages is measurably slower (4 MiB all-reduce, 2 ranks: about 1.2x). glibc
can ``madvise(MADV_HUGEPAGE)`` the heap as it grows, but only when told at
process start (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``), so this part is
the launcher's: ``mpijax-run`` exports it unless ``MPIJAX_HUGE_PAGES=0``.
"""

from __future__ import annotations

import ctypes
import os

from mpijax._src import config

# The environment variable glibc reads at process start for each setting, and
# the <malloc.h> parameter number mallopt() takes for it later.
_MALLOPT = {"MALLOC_ARENA_MAX": -8, "MALLOC_MMAP_THRESHOLD_": -3, "MALLOC_TRIM_THRESHOLD_": -1}
MALLOC_ENV_NAMES = tuple(_MALLOPT)


def _wanted(limit: int) -> dict[str, int]:
  """The settings for a heap cache of ``limit`` bytes: one arena, no mmap or
  trim below ``limit``."""
  return {"MALLOC_ARENA_MAX": 1, "MALLOC_MMAP_THRESHOLD_": limit,
          "MALLOC_TRIM_THRESHOLD_": limit}

_applied: dict[str, int] | None = None


def _glibc() -> ctypes.CDLL | None:
  try:
    libc = ctypes.CDLL(None)
    libc.gnu_get_libc_version  # noqa: B018  (raises AttributeError outside glibc)
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc
  except (OSError, AttributeError):
    return None


def _cache_bytes(env: dict[str, str] | None = None) -> int:
  value = int(config.get("heap_cache_bytes", env))
  if value < 0:
    raise ValueError(f"MPIJAX_HEAP_CACHE_BYTES={value} is negative; give a byte count "
                     "(e.g. 1073741824) or 0 to keep the C library's defaults.")
  # mallopt takes an int; glibc caps the mmap threshold at what an int holds.
  return min(value, 2**31 - 1)


def configure() -> dict[str, int]:
  """Applies the heap settings once per process; returns what was set.

  Variables the user exported (``MALLOC_ARENA_MAX`` and friends) win: glibc
  already applied them at start-up and mpijax does not override them.
  """
  global _applied
  if _applied is not None:
    return _applied
  applied: dict[str, int] = {}
  limit = _cache_bytes()
  libc = _glibc() if limit > 0 else None
  if libc is not None:
    for env_name, value in _wanted(limit).items():
      if env_name in os.environ:
        continue
      if libc.mallopt(_MALLOPT[env_name], value) == 1:
        applied[env_name] = value
  _applied = applied
  return applied


_HUGETLB = "glibc.malloc.hugetlb"


def launcher_env(env: dict[str, str]) -> list[tuple[str, str]]:
  """The glibc variables ``mpijax-run`` exports to every rank.

  ``env`` is the launcher's environment: the user's settings there win.
  """
  return _malloc_env(env) + _tunables_env(env)


def _tunables_env(env: dict[str, str]) -> list[tuple[str, str]]:
  """``GLIBC_TUNABLES`` with ``glibc.malloc.hugetlb=1`` added to the user's tunables.

  Empty with ``MPIJAX_HUGE_PAGES=0`` or when the user's ``GLIBC_TUNABLES``
  already says what to do with huge pages.
  """
  try:
    on = config.get("huge_pages", env)
  except ValueError:
    return []  # the ranks report the bad value when they import mpijax
  existing = env.get("GLIBC_TUNABLES", "")
  if not on or _HUGETLB in existing:
    return []
  return [("GLIBC_TUNABLES", f"{existing}:{_HUGETLB}=1" if existing else f"{_HUGETLB}=1")]


def _malloc_env(env: dict[str, str]) -> list[tuple[str, str]]:
  """The ``MALLOC_*`` variables: empty when the user set any of them, or
  turned the cache off with ``MPIJAX_HEAP_CACHE_BYTES=0``."""
  if any(name in env for name in MALLOC_ENV_NAMES):
    return []
  try:
    limit = _cache_bytes(env)
  except ValueError:
    return []  # the ranks report the bad value when they import mpijax
  if limit == 0:
    return []
  return [(name, str(value)) for name, value in _wanted(limit).items()]
