"""The doctor: ``mpijax-run -n N --doctor`` and ``python -m mpijax doctor``.

Every rank of a job started as the real job would be runs :func:`main`: it
reads its own setup (:mod:`facts`), starts the runtime, gathers every rank's
facts, checks a jitted sum across the ranks, measures an all-reduce sweep on
each path and the links between nodes (:mod:`measure`), and rank 0 prints
one line per check (:mod:`verdicts`): the launcher and its variables, the
MPI library and the extension and bridge built for it, ranks and devices
against each node's cores and their binding, ``/dev/shm`` and cross-memory
attach, the compile cache, JAX's distributed runtime and XLA's collectives,
then each path's latency and bandwidth against the expected figure. Every
rank exits with the same status: 0, or :data:`FAILED` when a check failed
(each failure one line that names the fix).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Sequence

from mpijax._src import config
from mpijax._src import mpi_util
from mpijax._src.doctor import facts
from mpijax._src.doctor import measure
from mpijax._src.doctor import verdicts
from mpijax._src.run.common import DOCTOR_FAILED

FAILED = DOCTOR_FAILED  # the exit status of a doctor that found a failure
# The doctor's own waits: a stall in its measurements is reported this soon.
TIMEOUT_S = 60.0
USAGE = "usage: python -m mpijax doctor (under mpirun/srun/mpiexec; or mpijax-run -n N --doctor)"


def _global_sum(rt) -> str:
  """Collective: a jitted sum over a global array that spans every rank; '' or the error."""
  import jax
  import numpy as np
  from jax.sharding import Mesh
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec

  if not rt.jax_distributed:
    return ""
  try:
    mesh = Mesh(np.array(jax.devices()), ("x",))
    local = np.full((rt.local_device_count,), rt.rank + 1.0, np.float32)
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec("x")), local)
    total = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, PartitionSpec()))(x)
    got = float(np.asarray(total))
  except Exception as e:  # noqa: BLE001 -- reported as the check's failure
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
  want = rt.local_device_count * rt.size * (rt.size + 1) / 2
  return "" if got == want else f"got {got:g}, expected {want:g}"


def _cells(data: str) -> list[measure.Cell]:
  return [measure.Cell(**c) for c in json.loads(data)] if data else []


def _dump(cells: list[measure.Cell]) -> str:
  return json.dumps([dataclasses.asdict(c) for c in cells])


def _allowed_cpus() -> int:
  """The CPUs this process's cgroup allows (cpuset, cgroup v2), else the online ones."""
  import os

  try:
    with open("/proc/self/cgroup") as f:
      path = next(line.split(":", 2)[2].strip() for line in f if line.startswith("0::"))
    with open(f"/sys/fs/cgroup{path}/cpuset.cpus.effective") as f:
      text = f.read().strip()
    count = 0
    for part in text.split(","):
      lo, _, hi = part.partition("-")
      count += int(hi or lo) - int(lo) + 1
    return count
  except (OSError, StopIteration, ValueError):
    return os.cpu_count() or 0


def _process_seconds() -> float:
  """Seconds since this process started (the doctor's report counts the start-up)."""
  import os

  try:
    with open("/proc/self/stat") as f:
      start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
      uptime = float(f.read().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
  except (OSError, ValueError, IndexError):
    return 0.0


def machine_turn(everyone: list[dict], host: str) -> tuple[int, int]:
  """(this node's turn, the number of turns) for the sweeps within the nodes.

  Nodes that are one machine (one kernel boot id: containers, network
  namespaces) sweep in turn, so that they do not compete for its cores;
  nodes of their own sweep at once.
  """
  machines: dict[str, list[str]] = {}
  for f in everyone:
    hosts = machines.setdefault(f["boot_id"] or f["host"], [])
    if f["host"] not in hosts:
      hosts.append(f["host"])
  mine = next(hosts for hosts in machines.values() if host in hosts)
  return mine.index(host), max(len(hosts) for hosts in machines.values())


def _barrier(comm, timeout: float, rank: int, what: str) -> None:
  """Every rank waits here, sleeping, for the ones measuring; a stall ends the job."""
  if measure.quiet_barrier(comm, timeout):
    return
  print(
    f"mpijax doctor: rank {rank} waited {timeout:g} s for the other ranks to finish {what} "
    "(MPIJAX_TIMEOUT); ending the job: a rank is stuck in MPI, or its traffic between the "
    "nodes does not get through; fix: the firewall and the interfaces between the nodes "
    "(Open MPI's btl_tcp_if_include and oob_tcp_if_include)",
    file=sys.stderr,
    flush=True,
  )
  comm.Abort(FAILED)


def report(
  everyone: list[dict],
  *,
  sum_error: str,
  node_sweeps: dict[str, list[measure.Cell]],
  across: list[measure.Cell],
  links: list[dict],
  fabric: bool,
  shm_required: int,
) -> list[verdicts.Line | str]:
  """The report's lines (checks, and the sweeps' tables as plain strings)."""
  out: list[verdicts.Line | str] = [verdicts.launcher(everyone)]
  out += verdicts.mpi_library(everyone)
  out += verdicts.cores(everyone)
  out.append(verdicts.devices(everyone))
  out += verdicts.shm(everyone, shm_required)
  out.append(verdicts.cache(everyone))
  out += verdicts.xla(everyone, sum_error)
  out += verdicts.node_transport(everyone)
  local_sizes = {f["node"]: f["local_size"] for f in everyone}
  for host, cells in node_sweeps.items():
    ranks = next(f["local_size"] for f in everyone if f["host"] == host)
    out += verdicts.node_paths(everyone, cells)
    lines, table = verdicts.sweep(f"within {host}", cells, ranks)
    out += lines + table
  if len(local_sizes) > 1:
    out += verdicts.cross_transport(everyone, fabric)
    lines, table = verdicts.sweep("across nodes", across, len(local_sizes))
    out += lines + table
    out += verdicts.link_lines(links)
  elif not node_sweeps:
    out.append(verdicts.Line("ok", "all-reduce", "one rank: nothing to measure"))
  return out


def main(argv: Sequence[str]) -> None:
  """``python -m mpijax doctor``: runs on every rank of the job; exits 0 or :data:`FAILED`."""
  if list(argv):
    sys.exit(USAGE)
  started = time.monotonic()
  config.update("timeline", "")  # the doctor drains the timeline itself
  config.update("stragglers", False)  # its report is about the job, not the doctor
  if not 0 < float(config.get("timeout")) <= TIMEOUT_S:
    config.update("timeout", TIMEOUT_S)
  mine = facts.before_init()
  mine["allowed"] = _allowed_cpus()

  from mpijax._src.runtime import state as runtime

  rt = runtime.init()
  MPI = mpi_util.import_mpi()
  comm = rt.comm
  mine.update(facts.after_init(rt))
  if mine["cache"]["error"]:
    import jax

    # Reported below; the doctor's own programs compile without it (no warning per entry).
    jax.config.update("jax_enable_compilation_cache", False)
  everyone = [json.loads(t) for t in mpi_util.allgather_str(comm, json.dumps(mine))]
  sum_error = _global_sum(rt)
  sizes = tuple(config.get("doctor_sizes"))

  wait = float(config.get("timeout"))
  node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rt.rank)
  within: list[measure.Cell] = []
  turn, turns = machine_turn(everyone, mine["host"])
  for k in range(turns):
    if k == turn and node.Get_size() > 1:
      within = measure.sweep(node, sizes)
    _barrier(comm, wait, rt.rank, "the sweeps within the nodes")
  node.Free()
  leaders = comm.Split(0 if rt.topology.local_rank == 0 else MPI.UNDEFINED, key=rt.rank)
  across: list[measure.Cell] = []
  links: list[dict] = []
  if leaders != MPI.COMM_NULL:
    if leaders.Get_size() > 1:
      across = measure.sweep(leaders, sizes)
      hosts = [f["host"] for f in everyone if f["local_rank"] == 0]
      links = measure.links(leaders, hosts)
    leaders.Free()
  _barrier(comm, wait, rt.rank, "the sweep across the nodes and the links")
  # Rank 0 reports: each node's sweep from its first rank, the rest from node 0's.
  shared = mpi_util.allgather_str(
    comm,
    json.dumps(
      {"host": mine["host"], "within": _dump(within), "across": _dump(across), "links": links}
    )
    if rt.topology.local_rank == 0
    else "",
  )
  from mpijax._src.run.situation import has_fabric

  fabric = has_fabric()
  status = 0
  if rt.rank == 0:
    node_sweeps: dict[str, list[measure.Cell]] = {}
    for text in shared:
      if text:
        got = json.loads(text)
        if got["within"] != "[]":
          node_sweeps[got["host"]] = _cells(got["within"])
    first = json.loads(shared[0])
    lines = report(
      everyone,
      sum_error=sum_error,
      node_sweeps=node_sweeps,
      across=_cells(first["across"]),
      links=first["links"],
      fabric=fabric,
      shm_required=int(config.get("doctor_shm_bytes")),
    )
    checks = [x for x in lines if isinstance(x, verdicts.Line)]
    failed = sum(1 for x in checks if x.kind == "FAIL")
    warned = sum(1 for x in checks if x.kind == "warn")
    nodes = sorted({f["host"] for f in everyone})
    print(
      f"mpijax doctor: {rt.size} rank{'s' if rt.size > 1 else ''} on {len(nodes)} "
      f"node{'s' if len(nodes) > 1 else ''} ({', '.join(nodes)})",
      flush=True,
    )
    for x in lines:
      print(str(x), flush=True)
    print(
      f"mpijax doctor: {failed} failed, {warned} warning{'s' if warned != 1 else ''}, "
      f"{len(checks) - failed - warned} ok ({max(_process_seconds(), time.monotonic() - started):.1f} s "
      "on rank 0)",
      flush=True,
    )
    status = FAILED if failed else 0
  status = int(mpi_util.bcast_str(comm, str(status), root=0))
  runtime.shutdown()
  sys.exit(status)
