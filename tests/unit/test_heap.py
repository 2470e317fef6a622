"""The heap settings applied at ``import mpijax`` (mpijax/_src/heap.py).

Each case runs in a fresh interpreter, since glibc settings are per process.
The observable effect: an 8 MiB block that glibc would hand out with its own
``mmap`` comes from the heap (the ``[heap]`` mapping) once mpijax is imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_PROBE = r"""
import ctypes, json, sys
import mpijax
from mpijax._src import heap
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
p = libc.malloc(8 << 20)
in_heap = False
for line in open("/proc/self/maps"):
  if line.rstrip().endswith("[heap]"):
    lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
    in_heap = in_heap or lo <= p < hi
libc.free(p)
print(json.dumps({"applied": heap.configure(), "in_heap": in_heap}))
"""

glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or
                           os.confstr("CS_GNU_LIBC_VERSION") is None,  # type: ignore[arg-type]
                           reason="the heap settings apply to glibc only")


def _probe(**env_changes: str | None) -> dict:
  env = {k: v for k, v in os.environ.items()
         if not k.startswith("MALLOC_") and k != "MPIJAX_HEAP_CACHE_BYTES"}
  env.update({k: v for k, v in env_changes.items() if v is not None})
  out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 0, out.stderr
  return json.loads(out.stdout.strip().splitlines()[-1])


@glibc
def test_import_keeps_large_blocks_in_the_heap():
  got = _probe()
  assert got["applied"] == {"MALLOC_ARENA_MAX": 1, "MALLOC_MMAP_THRESHOLD_": 1 << 30,
                            "MALLOC_TRIM_THRESHOLD_": 1 << 30}
  assert got["in_heap"]


@glibc
def test_zero_keeps_glibc_defaults():
  got = _probe(MPIJAX_HEAP_CACHE_BYTES="0")
  assert got == {"applied": {}, "in_heap": False}


@glibc
def test_user_malloc_variables_win():
  got = _probe(MALLOC_MMAP_THRESHOLD_="131072")
  assert "MALLOC_MMAP_THRESHOLD_" not in got["applied"]
  assert not got["in_heap"]  # the user's 128 KiB threshold still sends 8 MiB to mmap


def test_bad_value_names_the_variable():
  env = {**os.environ, "MPIJAX_HEAP_CACHE_BYTES": "-5"}
  out = subprocess.run([sys.executable, "-c", "import mpijax"], env=env, capture_output=True,
                       text=True, timeout=120)
  assert out.returncode != 0
  assert "MPIJAX_HEAP_CACHE_BYTES=-5" in out.stderr and "0 to keep" in out.stderr
