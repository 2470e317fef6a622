"""The straggler report's parts in a real job: the arrival stamps of mpijax's and XLA's
collectives pair across ranks and devices, and a host's clock offset from the ping-pong.

Rank 0 checks and broadcasts its verdict, so every rank passes or fails together.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mpijax import ops
from mpijax._src import config
from mpijax._src import ffi
from mpijax._src import mpi_util
from mpijax._src.runtime import state as runtime
from mpijax._src.timeline import straggler
from mpijax._src.timeline import straggler_watch


def test_the_report_runs_in_a_job_of_more_than_one_rank(rt):
  assert straggler_watch.active() == (rt.size > 1 and config.get("stragglers"))


@pytest.fixture
def own_stamps(rt):
  """The job's report stopped (its thread drains the stamps too), restarted after the test."""
  was = straggler_watch.active()
  straggler_watch.finish(runtime._drain_at_exit)
  lib = ffi.load()
  lib.arrivals_record(True)
  lib.arrivals_drain()  # the stamps of earlier tests
  yield lib
  lib.arrivals_record(False)
  if was:
    straggler_watch.start(
      rt.comm, hostnames=rt.topology.hostnames, interval=config.get("straggler_interval")
    )


def _drain(lib, want: int | None = None, timeout: float = 10.0) -> np.ndarray:
  """The stamps recorded so far: until ``want`` have come, or else until none has come for
  0.2 s. XLA's device threads can stamp a call just after its result is ready."""
  parts, deadline, last = [], time.monotonic() + timeout, time.monotonic()
  while time.monotonic() < deadline:
    got = np.frombuffer(lib.arrivals_drain(), np.int64).reshape(-1, len(straggler.COLUMNS))
    if len(got):
      parts.append(got)
      last = time.monotonic()
    if (sum(map(len, parts)) >= want) if want is not None else time.monotonic() - last > 0.2:
      break
    time.sleep(0.01)
  return np.concatenate(parts) if parts else np.empty((0, len(straggler.COLUMNS)), np.int64)


def test_stamps_pair_into_collectives_across_ranks_and_devices(rt, own_stamps):
  n, L, r = rt.size, rt.local_device_count, rt.rank
  mesh = Mesh(np.array(rt.local_devices), ("d",))
  f = jax.jit(
    jax.shard_map(
      lambda x: ops.allreduce(x), mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=False
    )
  )
  x = jax.device_put(jnp.ones((L, 4)), NamedSharding(mesh, P("d")))
  xla = jax.process_count() == n > 1
  if xla:  # XLA's all-reduce over every device of every rank, through the bridge
    gmesh = jax.make_mesh((jax.device_count(),), ("x",))
    g = jax.jit(lambda a: a.sum(0), out_shardings=NamedSharding(gmesh, P()))
    arr = jax.make_array_from_process_local_data(
      NamedSharding(gmesh, P("x")), np.ones((L, 4), np.float32)
    )
    jax.block_until_ready(g(arr))
  jax.block_until_ready(f(x))  # compiled: no rank is late for its compile below
  _drain(own_stamps)
  calls, sleep_s = 4, 0.3
  for _ in range(calls if xla else 0):
    out = jax.block_until_ready(g(arr))  # every local device's collective, stamped, before the drain
    np.testing.assert_array_equal(np.asarray(out.addressable_data(0)), n * L)
  for i in range(calls):
    if i == calls - 1:
      rt.comm.Barrier()
      if r == n - 1:
        time.sleep(sleep_s)  # the last rank comes late to the last call
    np.testing.assert_array_equal(np.asarray(f(x)), n)
  rows = _drain(own_stamps, want=calls * L * (2 if xla else 1))  # a stamp per call and member
  everyone = rt.comm.gather(rows, root=0)
  verdict = ""
  if r == 0:
    try:
      pairing = straggler.Pairing()
      for rank, got in enumerate(everyone):
        pairing.add(rank, got)
      done = pairing.complete().collectives()
      keys = {int(k) for got in everyone for k in got[:, 0]}
      if len(pairing):
        verdict += f"\n{len(pairing)} stamps left unpaired"
      ours = [c for c in done if len(c.ranks) == n]
      # mpijax's: one collective per call and device; XLA's: at least one per call.
      want = calls * L + (calls if xla else 0)
      if n > 1 and len(ours) < want:
        verdict += f"\n{len(ours)} collectives of {n} ranks paired, expected >= {want} ({keys})"
      late = [c for c in done if c.late_ns > (sleep_s - 0.15) * 1e9]
      if n > 1 and (len(late) != L or {c.last for c in late} != {n - 1}):
        verdict += f"\nthe late call: {[(c.last, c.late_ns) for c in late]}, expected rank {n - 1}"
    except Exception as e:
      verdict = f"{type(e).__name__}: {e}"
  verdict = mpi_util.bcast_str(rt.comm, verdict)
  assert not verdict, verdict


def test_another_host_s_clock_from_the_ping_pong(rt):
  n, r = rt.size, rt.rank
  if n == 1:
    pytest.skip("a ping-pong needs two ranks")
  # The last rank posing as another host: its clock is rank 0's (one machine), so the
  # offset measured must be zero within the round trip. A ping of an earlier exchange,
  # which rank 0 gave up on, is skipped.
  hosts = ("here",) * (n - 1) + ("there",)
  dup = rt.comm.Dup()
  try:
    dup.Barrier()
    watch = straggler_watch._Watch(dup, hosts, 60.0)
    assert watch.remote_leaders == {n - 1}
    if r == 0:
      dup.Send(np.array([6, 0], np.int64), dest=n - 1, tag=straggler_watch._TAG_PING)
      watch.ping(n - 1, 7)
      offset = watch.offsets.get("there")
    elif r == n - 1:
      watch.serve_pings(7, time.monotonic() + 30)
    offset = dup.bcast(offset if r == 0 else None, root=0)
  finally:
    dup.Free()
  assert offset is not None and abs(offset) < 2_000_000, offset
