"""XLA's CPU thread pools found in the process and kept from spinning (xla_pools).

Which nodes get it, and a jaxlib not on the allow-list, are tested from
outside, in real jobs: tests/test_xla_pools_jobs.py.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import mmap
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from mpijax._src import config
from mpijax._src.xla import pools as xla_pools

LAYOUT = xla_pools.Layout(vtable=0, num_threads=0x48, allow_spinning=0x4C, spin_count=0x50)

# A fresh process with 2 CPU devices: the pools before, quiet() twice, the
# pools after, spin(), and a jitted sum over both devices (on XLA's pools).
_PROBE = r"""
import json, jax, jax.numpy as jnp, numpy as np
from mpijax._src.xla import pools as xla_pools
jax.devices()
before = xla_pools.pools()
first, second = xla_pools.quiet(), xla_pools.quiet()
after = xla_pools.pools()
x = jax.device_put(np.arange(8, dtype=np.float32).reshape(2, 4),
                   jax.sharding.NamedSharding(jax.make_mesh((2,), ("d",)),
                                              jax.sharding.PartitionSpec("d")))
total = [float(v) for v in jax.jit(lambda a: a.sum(0))(x)]
again = xla_pools.spin()
restored = xla_pools.pools()
print(json.dumps({"before": before, "after": after, "restored": restored, "total": total,
                  "first": [first.pools, first.changed, first.reason],
                  "second": [second.pools, second.changed, second.reason],
                  "again": [again.pools, again.changed, again.reason]}))
"""


def _probe(cache: str) -> dict:
  env = dict(
    os.environ,
    XLA_FLAGS="--xla_force_host_platform_device_count=2",
    JAX_PLATFORMS="cpu",
    XDG_CACHE_HOME=cache,
  )
  out = subprocess.run(
    [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120
  )
  assert out.returncode == 0, out.stderr[-2000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_quiet_turns_off_the_spinning_of_every_pool_and_jax_still_computes(tmp_path):
  import jaxlib

  r = _probe(str(tmp_path))
  if not any(v == jaxlib.__version__ for v, _ in xla_pools.VERIFIED):
    # Not a verified build: nothing is read or written, and the report says why.
    assert (
      r["first"][:2] == [0, 0] and "not a build the pool patch was verified on" in (r["first"][2])
    ), r
    assert r["total"] == [4.0, 6.0, 8.0, 10.0]
    return
  # jaxlib's CPU client has at least its intra-op and its client pool, and
  # builds them spinning: spin_count_ = 5000 / num_threads_.
  assert len(r["before"]) >= 2
  assert all(allow == 1 and spin == 5000 // n for n, allow, spin in r["before"])
  assert r["first"] == [len(r["before"]), len(r["before"]), ""]
  assert r["second"] == [len(r["before"]), 0, ""]  # found again, nothing left to do
  assert sorted(r["after"]) == sorted([n, 0, 0] for n, _, _ in r["before"])
  assert r["total"] == [4.0, 6.0, 8.0, 10.0]
  # spin() gives back what Eigen's constructor stored, to those quiet() changed
  # (a pool the jitted sum made since spins as built).
  assert r["again"] == [len(r["restored"]), len(r["before"]), ""]
  assert all(allow == 1 and spin == 5000 // n for n, allow, spin in r["restored"])
  # The library's digest was remembered, keyed by the file it hashed.
  (entry,) = json.loads((tmp_path / "mpijax" / "jaxlib-sha256.json").read_text()).values()
  assert (jaxlib.__version__, entry["sha256"]) in xla_pools.VERIFIED


def _fake_pool(threads: int, allow: int, spin: int) -> np.ndarray:
  """The bytes of a pool object whose fields say so."""
  obj = np.zeros(0x60, np.uint8)
  obj[0x48:0x4C] = np.frombuffer(np.int32(threads).tobytes(), np.uint8)
  obj[0x4C] = allow
  obj[0x50:0x54] = np.frombuffer(np.int32(spin).tobytes(), np.uint8)
  return obj


def _read(obj) -> tuple[int, int, int]:
  b = bytes(obj)
  return (
    int.from_bytes(b[0x48:0x4C], "little"),
    b[0x4C],
    int.from_bytes(b[0x50:0x54], "little"),
  )


@pytest.mark.parametrize(
  "fields, valid",
  [
    ((4, 1, 1250), True),
    ((3, 1, 1666), True),
    ((4, 0, 0), True),  # already quiet
    ((4, 1, 1249), False),  # not Eigen's budget
    ((4, 0, 1250), False),
    ((4, 2, 1250), False),  # not a bool
    ((0, 1, 0), False),
    ((-4, 1, 0), False),
  ],
)
def test_fields_accept_only_what_eigens_constructor_stores(fields, valid):
  obj = _fake_pool(*fields)
  mem = xla_pools._Memory(writable=False)
  try:
    got = xla_pools._fields(mem, obj.ctypes.data, LAYOUT)
  finally:
    mem.close()
  assert (got == fields) if valid else got is None


def test_a_write_that_fails_leaves_every_pool_as_it_was(tmp_path):
  """Pools in this process's memory; the second in a read-only shared file
  mapping, which /proc/self/mem cannot write: the first is restored."""
  first = _fake_pool(4, 1, 1250)
  path = tmp_path / "pool"
  path.write_bytes(_fake_pool(2, 1, 2500).tobytes())
  with open(path, "rb") as f:
    ro = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
  second = np.frombuffer(ro, np.uint8)
  mem = xla_pools._Memory(writable=True)
  try:
    report = xla_pools._apply(mem, LAYOUT, [first.ctypes.data, second.ctypes.data], False)
  finally:
    mem.close()
  assert report.changed == 0 and "1 of the 2 pools changed restored" in report.reason, report
  assert "an error" in report.reason, report
  assert _read(first) == (4, 1, 1250) and _read(second) == (2, 1, 2500)
  # Both writable: both quieted, and read back so.
  second = _fake_pool(2, 1, 2500)
  mem = xla_pools._Memory(writable=True)
  try:
    report = xla_pools._apply(mem, LAYOUT, [first.ctypes.data, second.ctypes.data], False)
  finally:
    mem.close()
  assert (report.pools, report.changed, report.reason) == (2, 2, "")
  assert _read(first) == (4, 0, 0) and _read(second) == (2, 0, 0)


def test_a_field_that_does_not_read_back_as_written_undoes_every_pool():
  """A layout whose switch is the budget's first byte, as a layout that does
  not fit the build could have it: what spin() writes to the second pool does
  not read back, and the first pool, already changed, is restored too."""
  overlapping = xla_pools.Layout(vtable=0, num_threads=0x48, allow_spinning=0x4C, spin_count=0x4C)
  # 3000 threads: a budget of 1, whose first byte is the switch itself, reads back.
  first, second = _fake_pool(3000, 0, 0), _fake_pool(4, 0, 0)
  mem = xla_pools._Memory(writable=True)
  try:
    report = xla_pools._apply(mem, overlapping, [first.ctypes.data, second.ctypes.data], True)
  finally:
    mem.close()
  # 1250 = 0x4e2; the switch then overwrites its first byte: 0x401.
  assert "read back (4, 1, 1025) after mpijax wrote (4, 1, 1250)" in report.reason, report
  assert "2 of the 2 pools changed restored" in report.reason and report.changed == 0
  assert _read(first) == (3000, 0, 0) and _read(second) == (4, 0, 0)
  assert not first[0x4C:0x50].any() and not second[0x4C:0x50].any()


def test_settle_leaves_the_pools_where_the_node_has_the_cores_or_the_setting_says_on():
  report = xla_pools.settle("auto", local_ranks=2, local_devices=1, node_cpus=2, platform="cpu")
  assert not report.wanted and report.changed == 0
  assert (
    report.reason == "this node's 2 ranks x 1 CPU device do not exceed the 2 cores they may use"
  )
  report = xla_pools.settle("on", local_ranks=4, local_devices=2, node_cpus=2, platform="cpu")
  assert (report.wanted, report.reason) == (False, "MPIJAX_XLA_SPIN=on")
  report = xla_pools.settle("off", local_ranks=1, local_devices=1, node_cpus=2, platform="gpu")
  assert (report.wanted, report.reason) == (False, "this rank's devices are gpu, not CPU")
  assert xla_pools.last is report


def test_the_librarys_digest_is_remembered_per_file(tmp_path, monkeypatch):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
  lib = tmp_path / "libjax_common.so"
  lib.write_bytes(b"one build" * 1000)
  want = hashlib.sha256(lib.read_bytes()).hexdigest()
  assert xla_pools.sha256(str(lib)) == want
  cache = tmp_path / "cache" / "mpijax" / "jaxlib-sha256.json"
  entry = json.loads(cache.read_text())[str(lib)]
  st = os.stat(lib)
  assert entry == {"key": [st.st_ino, st.st_size, st.st_mtime_ns], "sha256": want}
  # The remembered digest is what a second call returns, unread...
  cache.write_text(json.dumps({str(lib): {**entry, "sha256": "remembered"}}))
  assert xla_pools.sha256(str(lib)) == "remembered"
  # ... until the file changes: then it is hashed again.
  lib.write_bytes(b"another build" * 1000)
  assert xla_pools.sha256(str(lib)) == hashlib.sha256(lib.read_bytes()).hexdigest()
  # Another file at the path than the one a process loaded (replaced on disk): no digest.
  with pytest.raises(OSError, match="not the file this process loaded"):
    xla_pools.sha256(str(lib), inode=os.stat(lib).st_ino + 1)
  # A relative XDG_CACHE_HOME is ignored (XDG), and an unwritable cache only costs the hashing.
  monkeypatch.setenv("XDG_CACHE_HOME", "relative")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert xla_pools.sha256(str(lib)) == hashlib.sha256(lib.read_bytes()).hexdigest()
  assert (tmp_path / "home" / ".cache" / "mpijax" / "jaxlib-sha256.json").exists()
  (tmp_path / "ro").write_text("a file where the cache directory would be")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "ro"))
  assert xla_pools.sha256(str(lib)) == hashlib.sha256(lib.read_bytes()).hexdigest()


def test_ranks_that_start_together_hash_the_library_once(tmp_path, monkeypatch):
  """While another process hashes (holds the lock), a rank waits and then
  takes the digest it remembered; a lock held too long is not waited for."""
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
  lib = tmp_path / "libjax_common.so"
  lib.write_bytes(b"one build" * 1000)
  cache = tmp_path / "cache" / "mpijax" / "jaxlib-sha256.json"
  cache.parent.mkdir(parents=True)
  st = os.stat(lib)
  other = os.open(str(cache) + ".lock", os.O_RDWR | os.O_CREAT)
  fcntl.flock(other, fcntl.LOCK_EX)

  def other_rank_finishes():
    time.sleep(0.3)
    entry = {"key": [st.st_ino, st.st_size, st.st_mtime_ns], "sha256": "the other rank's"}
    cache.write_text(json.dumps({str(lib): entry}))
    os.close(other)  # releases the lock

  thread = threading.Thread(target=other_rank_finishes)
  thread.start()
  try:
    assert xla_pools.sha256(str(lib)) == "the other rank's"
  finally:
    thread.join()
  cache.unlink()
  other = os.open(str(cache) + ".lock", os.O_RDWR)
  fcntl.flock(other, fcntl.LOCK_EX)
  monkeypatch.setattr(xla_pools, "_LOCK_SECONDS", 0.2)
  got = []
  waiter = threading.Thread(target=lambda: got.append(xla_pools.sha256(str(lib))), daemon=True)
  try:
    waiter.start()
    waiter.join(timeout=20)
    assert not waiter.is_alive(), "sha256() still waits for a lock held too long"
  finally:
    os.close(other)
  assert got == [hashlib.sha256(lib.read_bytes()).hexdigest()]


def test_the_setting_names_its_values():
  with pytest.raises(
    ValueError, match="MPIJAX_XLA_SPIN='sometimes' is not valid: expected auto, on or off"
  ):
    config.parse("xla_spin", "sometimes")
  assert config.parse("xla_spin", " OFF ") == "off"
