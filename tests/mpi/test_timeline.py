"""The collective timeline, recorded for part of the run on every rank and device.

Rank 0 checks the merged file and broadcasts its verdict, so every rank
passes or fails together.
"""

from __future__ import annotations

import collections
import json
import os
import re
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mpijax import ops
from mpijax import timeline
from mpijax._src import ffi
from mpijax._src import mpi_util


def _problems(trace: dict, n: int, L: int, calls_per_device: int) -> list[str]:
  problems = []
  calls = [e for e in trace["traceEvents"] if e.get("cat") == "mpijax"]
  rows = collections.Counter((e["pid"], e["tid"]) for e in calls)
  want = {(r, 1 + d) for r in range(n) for d in range(L)}
  if set(rows) != want:
    problems.append(f"rows {sorted(rows)}, expected every (rank, device) {sorted(want)}")
  counts = set(rows.values())
  if counts != {calls_per_device}:
    problems.append(f"calls per (rank, device): {dict(rows)}, expected {calls_per_device} each")
  by_call = collections.defaultdict(set)
  for e in calls:
    a = e["args"]
    if min(a["wait_ns"], a["transfer_ns"]) < 0:  # a wait never exceeds the call
      problems.append(f"negative wait or transfer: {a}")
    if abs(e["dur"] * 1000 - a["duration_ns"]) > 1:
      problems.append(f"slice duration {e['dur']} us vs {a['duration_ns']} ns")
    if a["waited_for_rank"] is not None and not 0 <= a["waited_for_rank"] < n:
      problems.append(f"waited for rank {a['waited_for_rank']}")
    by_call[(a["communicator"], e["tid"], a["call_number"])].add((e["pid"], a["op"], a["bytes"]))
  for key, members in by_call.items():
    if len({p for p, _, _ in members}) != n or len({(o, b) for _, o, b in members}) != 1:
      problems.append(f"collective {key} is not one call on every rank: {sorted(members)}")
  # Every collective has a last arrival: at least one rank of it did not wait.
  for key in by_call:
    waits = [e["args"]["wait_ns"] for e in calls
             if (e["args"]["communicator"], e["tid"], e["args"]["call_number"]) == key]
    if n > 1 and min(waits) != 0:
      problems.append(f"collective {key}: every rank waited {waits}")
  paths = {e["args"]["path"] for e in calls}
  if not paths or "none" in paths:
    problems.append(f"paths {paths}")
  if any(not re.search(r" at test_timeline\.py:\d+$", e["args"]["call_site"]) for e in calls):
    problems.append("call sites: " + str({e["args"]["call_site"] for e in calls}))
  return problems


def test_timeline_of_ops_on_every_rank_and_device(rt):
  n, L, r = rt.size, rt.local_device_count, rt.rank
  mesh = Mesh(np.array(rt.local_devices), ("d",))
  directory = mpi_util.bcast_str(rt.comm, tempfile.mkdtemp() if r == 0 else None)
  path = os.path.join(directory, "trace.json")

  def body(*xs):  # (1, k) per device, per size
    return tuple(y for x in xs for y in (ops.allreduce(x), ops.allgather(x[0])[None],
                                           ops.bcast(x, root=0)))

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P("d")),
                            out_specs=(P("d"),) * 6, check_vma=False))
  # 4 B per device (shared memory or MPI) and 256 KiB (cross-memory attach or MPI).
  xs = [jax.device_put(jnp.stack([jnp.full((k,), 10.0 * d + r) for d in range(L)]),
                       NamedSharding(mesh, P("d"))) for k in (1, 65536)]
  timeline.start(path)
  assert timeline.active()
  steps = 2
  for _ in range(steps):
    out = [np.asarray(y) for y in f(*xs)]
    for s, g, b in (out[:3], out[3:]):
      for d in range(L):
        np.testing.assert_array_equal(s[d], n * 10.0 * d + sum(range(n)))
        np.testing.assert_array_equal(g[d][:, 0], 10.0 * d + np.arange(n))
        np.testing.assert_array_equal(b[d], 10.0 * d)
  written = timeline.finish()
  assert not timeline.active()
  verdict = ""
  if r == 0:  # any failure here must reach the other ranks, waiting in the bcast below
    try:
      with open(path) as fh:
        trace = json.load(fh)
      verdict = "\n".join(_problems(trace, n, L, calls_per_device=3 * 2 * steps))
      meta = trace["otherData"]["mpijax"]
      if written != path or meta["ranks_merged"] != list(range(n)) or \
          any(meta["lost_events"].values()):
        verdict += f"\nwritten {written!r}, metadata {meta}"
    except Exception as e:
      verdict = f"{type(e).__name__}: {e}"
  verdict = mpi_util.bcast_str(rt.comm, verdict)
  assert not verdict, verdict
  # Off again: calls leave no events.
  jax.block_until_ready(f(*xs))
  assert ffi.load().timeline_drain() == ([], 0)


def test_a_late_rank_is_what_the_others_waited_for(rt):
  # An independent check of the split: the last rank sleeps a known time before one
  # all-reduce; every other rank's recorded wait for that call must cover the sleep,
  # less the few milliseconds by which the ranks leave the barrier apart.
  n, r = rt.size, rt.rank
  late, sleep_s, slack_s = n - 1, 0.6, 0.2
  directory = mpi_util.bcast_str(rt.comm, tempfile.mkdtemp() if r == 0 else None)
  path = os.path.join(directory, "late.json")
  f = jax.jit(ops.allreduce)
  x = jnp.ones(4)
  jax.block_until_ready(f(x))  # compiled before: the sleep is the only difference
  timeline.start(path)
  rt.comm.Barrier()
  if r == late:
    time.sleep(sleep_s)
  np.testing.assert_array_equal(np.asarray(f(x)), n)
  timeline.finish()
  verdict = ""
  if r == 0:
    try:
      with open(path) as fh:
        calls = [e for e in json.load(fh)["traceEvents"] if e.get("cat") == "mpijax"]
      waits = {e["pid"]: (e["args"]["wait_ns"] / 1e9, e["args"]["waited_for_rank"]) for e in calls}
      if sorted(waits) != list(range(n)):
        verdict = f"one call per rank expected: {sorted(waits)}"
      for rank, (wait, waited_for) in sorted(waits.items()):
        if rank == late and wait > slack_s:
          verdict += f"\nrank {rank}, which slept {sleep_s} s before the call, waited {wait:.3f} s"
        if rank != late and (wait < sleep_s - slack_s or waited_for != late):
          verdict += (f"\nrank {rank} waited {wait:.3f} s for rank {waited_for}; rank {late} "
                      f"slept {sleep_s} s before the call")
    except Exception as e:
      verdict = f"{type(e).__name__}: {e}"
  verdict = mpi_util.bcast_str(rt.comm, verdict)
  assert not verdict, verdict
