"""The doctor's judgement: from every rank's facts and the measurements, the report.

Each check gives one :class:`Line`: ``ok``, ``warn`` (worth knowing; the
doctor still passes) or ``FAIL`` (the doctor exits non-zero), a topic and
one line of text; a failure's text names the fix. Pure functions of plain
data, so that each rule is tested without a job (tests/unit/test_doctor.py).

The 50 % rule: an all-reduce path whose bandwidth (NCCL's bus bandwidth,
2 (P-1)/P bytes per rank over the time) at the sweep's largest size is
below half of raw MPI's on the same ranks fails; so does a link between
nodes whose TCP stream carries less than half of what it should (the
smaller of its rated speed and this node's TCP over loopback).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from mpijax._src.doctor.measure import HALF
from mpijax._src.doctor.measure import Cell
from mpijax._src.doctor.measure import path_names

OPEN_MPI_SEGMENT = 16 << 20  # Open MPI's sm btl, per rank
SEGMENT_HEADER = 4096
# A bandwidth says little below this size, where latency rules.
BANDWIDTH_MIN_BYTES = 1024


@dataclasses.dataclass(frozen=True)
class Line:
  """One check's outcome: ``kind`` is ``ok``, ``warn`` or ``FAIL``."""

  kind: str
  topic: str
  text: str

  def __str__(self) -> str:
    return f"  {self.kind:<5} {self.topic}: {self.text}"


def fmt_bytes(n: float) -> str:
  for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if n >= size:
      v = n / size
      return f"{v:.0f} {unit}" if v == int(v) or v >= 100 else f"{v:.1f} {unit}"
  return f"{int(n)} B"


def fmt_rate(bps: float) -> str:
  if bps >= 1e9:
    return f"{bps / 1e9:.2f} GB/s"
  if bps >= 1e6:
    return f"{bps / 1e6:.1f} MB/s"
  return f"{bps / 1e3:.1f} kB/s"


def fmt_time(s: float) -> str:
  if s >= 1:
    return f"{s:.2f} s"
  if s >= 1e-3:
    return f"{s * 1e3:.2f} ms"
  return f"{s * 1e6:.1f} µs"


def ranks_text(ranks: Sequence[int]) -> str:
  from mpijax._src.mpi_util import rank_ranges

  ranks = sorted(ranks)
  return ("rank " if len(ranks) == 1 else "ranks ") + rank_ranges(ranks)


# --- the job ----------------------------------------------------------------------------


def launcher(facts: list[dict[str, Any]]) -> Line:
  names = {f["launcher"] for f in facts}
  if "" in names:
    bad = [f["rank"] for f in facts if not f["launcher"]]
    return Line(
      "FAIL",
      "launcher",
      f"{ranks_text(bad)} found no launcher's variables (their "
      "place on their node is MPI's guess); fix: start the job with mpijax-run, "
      "mpirun, srun or mpiexec",
    )
  if len(names) > 1:
    return Line(
      "FAIL",
      "launcher",
      f"the ranks were started by different launchers "
      f"({', '.join(sorted(names))}); fix: one launcher for the whole job",
    )
  f = facts[0]
  nodes = len({x["node"] for x in facts})
  how = ", under mpijax-run" if f["under_run"] else ""
  return Line(
    "ok",
    "launcher",
    f"{f['launcher']}{how}; {len(facts)} ranks on {nodes} "
    f"node{'s' if nodes > 1 else ''}; variables read: {', '.join(f['variables'])}",
  )


def mpi_library(facts: list[dict[str, Any]]) -> list[Line]:
  out = []
  broken = [f for f in facts if f["ext_error"]]
  if broken:
    out.append(
      Line(
        "FAIL",
        "MPI",
        f"mpijax's extension does not load on "
        f"{ranks_text([f['rank'] for f in broken])}: {broken[0]['ext_error']}; fix: "
        "rebuild it against this MPI: MPICC=$(which mpicc) pip install "
        "--no-build-isolation --no-deps --force-reinstall -e <mpijax checkout>",
      )
    )
  libraries = {f["mpi_library"] for f in facts}
  if len(libraries) > 1:
    out.append(
      Line(
        "FAIL",
        "MPI",
        "the ranks run different MPI libraries ("
        + "; ".join(sorted(libraries))
        + "); fix: the same MPI on every host "
        "(the launcher's, which mpi4py must load too)",
      )
    )
  slow = [f["rank"] for f in facts if not f["thread_multiple"]]
  if slow:
    out.append(
      Line(
        "FAIL",
        "MPI",
        f"{ranks_text(slow)} run MPI below MPI_THREAD_MULTIPLE "
        "(several devices and XLA's threads call MPI at once); fix: import mpijax "
        "before mpi4py.MPI, or set mpi4py.rc.thread_level = 'multiple'",
      )
    )
  if not out:
    f = facts[0]
    where = f" ({f['mpi_path']})" if f["mpi_path"] else ""
    out.append(
      Line(
        "ok",
        "MPI",
        f"{f['mpi_library']}{where}; mpijax's extension, built for "
        f"{f['built_for']}, loads on every rank; MPI_THREAD_MULTIPLE",
      )
    )
  return out


def xla(facts: list[dict[str, Any]], sum_error: str) -> list[Line]:
  """JAX's distributed runtime and the transport of XLA's collectives."""
  if len(facts) == 1:
    return [Line("ok", "JAX", "one rank: JAX's distributed runtime is not needed")]
  f = facts[0]
  off = [x["rank"] for x in facts if not x["jax_distributed"]]
  if off:
    if not f["jax_setting"]:
      return [
        Line(
          "warn",
          "JAX",
          "JAX's distributed runtime is off (MPIJAX_JAX_DISTRIBUTED=0): "
          "jax.process_count() is 1 on each rank and global jax.Arrays do not span "
          "the ranks",
        )
      ]
    return [
      Line(
        "FAIL",
        "JAX",
        f"JAX's distributed runtime is not up on {ranks_text(off)}; "
        "fix: see their warnings above (MPIJAX_JAX_DISTRIBUTED=1 starts it)",
      )
    ]
  out = []
  if sum_error:
    out.append(
      Line(
        "FAIL",
        "JAX",
        f"a jitted sum over a global array across the ranks failed: "
        f"{sum_error}; fix: see docs/jax-integration.md",
      )
    )
  else:
    out.append(
      Line(
        "ok",
        "JAX",
        f"JAX's distributed runtime is up: {len(facts)} processes, "
        f"coordinator {f['coordinator']}; a jitted sum across the ranks is right",
      )
    )
  kinds = {x["xla_collectives"] for x in facts}
  if kinds == {"mpi"} and all(x["bridge_loaded"] for x in facts):
    out.append(
      Line(
        "ok",
        "XLA",
        "XLA's cross-process collectives run over MPI through "
        "mpijax's bridge, which jaxlib loaded on every rank",
      )
    )
  elif kinds == {"gloo"} and f["xla_setting"] == "gloo":
    out.append(
      Line(
        "warn",
        "XLA",
        "XLA's cross-process collectives run over gloo (TCP), as MPIJAX_XLA_COLLECTIVES=gloo asks",
      )
    )
  else:
    unloaded = [x["rank"] for x in facts if not x["bridge_loaded"]]
    why = (
      f"jaxlib did not load mpijax's bridge on {ranks_text(unloaded)} "
      f"(MPITRAMPOLINE_LIB={f['mpitrampoline_lib'] or 'unset'})"
      if unloaded
      else "see the ranks' warning above"
    )
    out.append(
      Line(
        "FAIL",
        "XLA",
        f"XLA's cross-process collectives fall back to "
        f"{'/'.join(sorted(kinds))} (TCP) instead of MPI: {why}; fix: launch with "
        "mpijax-run, or import mpijax before jax, or export "
        f"MPITRAMPOLINE_LIB={f['bridge_installed'] or '<mpijax>/_src/ffi/libmpijax_bridge.so'}",
      )
    )
  return out


def devices(facts: list[dict[str, Any]]) -> Line:
  f = facts[0]
  n = f["devices"]
  if f["platform"] != "cpu":
    return Line(
      "warn",
      "devices",
      f"{n} {f['platform']} device(s) per rank: mpijax's own "
      "operations run on CPU devices only (JAX_PLATFORMS=cpu)",
    )
  return Line(
    "ok", "devices", f"{n} CPU device{'s' if n > 1 else ''} per rank, {n * len(facts)} in all"
  )


def _nodes(facts: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
  out: dict[int, list[dict[str, Any]]] = {}
  for f in facts:
    out.setdefault(f["node"], []).append(f)
  return out


def cores(facts: list[dict[str, Any]]) -> list[Line]:
  """Ranks times devices against the cores of each node, and the ranks' binding."""
  out = []
  for ranks in _nodes(facts).values():
    host = ranks[0]["host"]
    union = set()
    for f in ranks:
      union |= set(f["affinity"])
    allowed = max(len(union), max(f.get("allowed", 0) for f in ranks))
    threads = len(ranks) * ranks[0]["devices"]
    share = max(1, allowed // len(ranks))
    narrow = [
      f
      for f in ranks
      if len(f["affinity"]) < min(share, ranks[0]["devices"] + 1) and not f["oversubscribed"]
    ]
    if narrow:
      got = len(narrow[0]["affinity"])
      out.append(
        Line(
          "FAIL",
          "cores",
          f"on {host}, {ranks_text([f['rank'] for f in narrow])} "
          f"may run on {got} core{'s' if got > 1 else ''} each of the {allowed} the "
          f"node allows (a share of {share}): its launcher bound it, and XLA's and "
          f"MPI's threads queue there; fix: mpirun --bind-to none (mpijax-run "
          f"does it), srun --cpus-per-task={share} or --cpu-bind=none",
        )
      )
    elif threads > len(union):
      bound = all(len(f["affinity"]) == 1 for f in ranks) and ranks[0]["cpu_bind"] == "auto"
      how = (
        "mpijax binds each rank to one core (MPIJAX_CPU_BIND=auto) and its waits yield the core"
        if bound
        else "mpijax's waits yield the core"
      )
      out.append(
        Line(
          "warn",
          "cores",
          f"{host} runs {len(ranks)} ranks x "
          f"{ranks[0]['devices']} device{'s' if ranks[0]['devices'] > 1 else ''} "
          f"on {len(union)} core{'s' if len(union) > 1 else ''}: oversubscribed "
          f"{threads / len(union):.3g}x; {how}; a core per rank and device "
          "runs faster",
        )
      )
    else:
      out.append(
        Line(
          "ok",
          "cores",
          f"{host}: {len(ranks)} ranks x {ranks[0]['devices']} "
          f"device{'s' if ranks[0]['devices'] > 1 else ''} on {len(union)} cores, "
          "unbound",
        )
      )
  return out


def shm_needed(ranks: list[dict[str, Any]]) -> int:
  """Bytes of /dev/shm the node's ranks need: Open MPI's segment per rank, and
  mpijax's node-local segments (the runtime's and XLA's communicators) per rank
  and device."""
  f = ranks[0]
  per_rank = 2 * f["devices"] * (f["shm_max_bytes"] + SEGMENT_HEADER)
  if "Open MPI" in f["mpi_library"]:
    per_rank += OPEN_MPI_SEGMENT
  return len(ranks) * per_rank


def shm(facts: list[dict[str, Any]], required: int) -> list[Line]:
  """``required``: MPIJAX_DOCTOR_SHM_BYTES (0: :func:`shm_needed`)."""
  out = []
  for ranks in _nodes(facts).values():
    host = ranks[0]["host"]
    got = ranks[0]["shm"]
    if "error" in got:
      out.append(
        Line(
          "FAIL",
          "/dev/shm",
          f"{host}: {got['error']}; fix: mount a tmpfs on /dev/shm (docker run --shm-size=1g)",
        )
      )
      continue
    need = required or shm_needed(ranks)
    why = "MPIJAX_DOCTOR_SHM_BYTES" if required else "what the job's ranks map there"
    held = max(f["segment_bytes"] for f in ranks)
    have = got["free"] + held
    if have < need:
      out.append(
        Line(
          "FAIL",
          "/dev/shm",
          f"{host} has {fmt_bytes(have)} for the job "
          f"({fmt_bytes(got['free'])} free of {fmt_bytes(got['size'])}), less than "
          f"the {fmt_bytes(need)} needed ({why}); fix: a larger /dev/shm (docker "
          "run --shm-size=1g; mount -o remount,size=1G /dev/shm)",
        )
      )
    else:
      out.append(
        Line("ok", "/dev/shm", f"{host}: {fmt_bytes(got['free'])} free, {fmt_bytes(need)} needed")
      )
  return out


def _tcp_only(btl: str) -> bool:
  """Whether Open MPI's btl selection leaves no shared-memory btl."""
  items = [b.strip() for b in btl.split(",") if b.strip()]
  if not items:
    return False
  if items[0].startswith("^"):
    excluded = {items[0][1:]} | set(items[1:])
    return bool({"sm", "vader"} & excluded)
  return not ({"sm", "vader"} & set(items))


def node_transport(facts: list[dict[str, Any]]) -> list[Line]:
  """MPI's own path between the ranks of a node: shared memory, or TCP."""
  out = []
  for ranks in _nodes(facts).values():
    if len(ranks) < 2:
      continue
    host, f = ranks[0]["host"], ranks[0]
    if "Open MPI" not in f["mpi_library"] or f["pml"] not in ("", "ob1"):
      continue  # UCX's or another library's shared memory maps no sm_segment file
    unmapped = [x["rank"] for x in ranks if x["segments"] < 2]
    if _tcp_only(f["btl"]) or unmapped:
      said = f"OMPI_MCA_btl={f['btl']}; " if f["btl"] else ""
      out.append(
        Line(
          "FAIL",
          "MPI in a node",
          f"MPI's traffic between the ranks of {host} "
          f"falls back to TCP where shared memory should serve ({said}"
          f"{ranks_text(unmapped or [x['rank'] for x in ranks])} map no Open MPI "
          "shared-memory segment of their node): every MPI call between them, "
          "XLA's through the bridge too, crosses the TCP stack; fix: let Open MPI "
          "use its sm btl (drop --mca btl tcp,self; --mca btl sm,tcp,self)",
        )
      )
  return out


def _sweep_lines(title: str, cells: list[Cell], ranks: int) -> list[str]:
  rows = [
    f"    {title}",
    f"      {'size':>8}  {'mpijax':>10}  {'path':<8} {'bus bw':>10}  "
    f"{'raw MPI':>10} {'bus bw':>10}",
  ]
  for c in cells:
    # A bandwidth says little below 1 KiB: latency rules there.
    bw, raw = (
      (fmt_rate(c.busbw(ranks, c.mpijax_s)), fmt_rate(c.busbw(ranks, c.raw_s)))
      if c.nbytes >= BANDWIDTH_MIN_BYTES
      else ("-", "-")
    )
    rows.append(
      f"      {fmt_bytes(c.nbytes):>8}  {fmt_time(c.mpijax_s):>10}  "
      f"{path_names(c.paths):<8} {bw:>10}  {fmt_time(c.raw_s):>10} {raw:>10}"
    )
  return rows


def sweep(where: str, cells: list[Cell], ranks: int) -> tuple[list[Line], list[str]]:
  """The verdict on one path's sweep, and its table (lines to print below it)."""
  if not cells:
    return [], []
  table = _sweep_lines(
    f"all-reduce {where}, {ranks} ranks, float32 sum: jitted "
    "mpijax.ops.allreduce and raw MPI (mpi4py Allreduce), per call",
    cells,
    ranks,
  )
  wrong = [fmt_bytes(c.nbytes) for c in cells if not c.correct]
  if wrong:
    return [
      Line(
        "FAIL",
        f"all-reduce {where}",
        f"wrong results at {', '.join(wrong)}; fix: "
        "report it (MPIJAX_CHECK=1 compares every call across ranks)",
      )
    ], table
  small, big = cells[0], cells[-1]
  latency = (
    f"latency {fmt_time(small.mpijax_s)} at {fmt_bytes(small.nbytes)} (raw MPI "
    f"{fmt_time(small.raw_s)})"
  )
  if big.nbytes < BANDWIDTH_MIN_BYTES:
    return [
      Line(
        "ok",
        f"all-reduce {where}",
        f"{latency}; no bandwidth judged: the sweep's largest size is below "
        f"{fmt_bytes(BANDWIDTH_MIN_BYTES)} (MPIJAX_DOCTOR_SIZES)",
      )
    ], table
  bw, raw = big.busbw(ranks, big.mpijax_s), big.busbw(ranks, big.raw_s)
  share = bw / raw if raw > 0 else 1.0
  text = (
    f"{latency}; bandwidth {fmt_rate(bw)} at {fmt_bytes(big.nbytes)}, "
    f"{share:.0%} of raw MPI's {fmt_rate(raw)} on the same ranks"
  )
  if share < HALF:
    return [
      Line(
        "FAIL",
        f"all-reduce {where}",
        f"{text}: below half; fix: see the path column, and docs/transport.md for its settings",
      )
    ], table
  return [Line("ok", f"all-reduce {where}", text)], table


def node_paths(facts: list[dict[str, Any]], cells: list[Cell]) -> list[Line]:
  """Whether mpijax's node-local paths served the within-node sweep."""
  if not cells:
    return []
  f = facts[0]
  out = []
  shm_max, cma_min = f["shm_max_bytes"], f["cma_min_bytes"]
  small = [c for c in cells if c.nbytes <= shm_max and (not cma_min or c.nbytes < cma_min)]
  missed = [c for c in small if not c.paths & 4]
  if shm_max and missed:
    out.append(
      Line(
        "warn",
        "node-local paths",
        f"all-reduces of {fmt_bytes(missed[0].nbytes)} "
        f"within a node took {path_names(missed[0].paths)}, not mpijax's shared "
        "memory, which could not be set up (/dev/shm full or not writable); fix: "
        "room in /dev/shm",
      )
    )
  if cma_min:
    large = [c for c in cells if c.nbytes >= cma_min]
    if large and not all(c.paths & 8 for c in large):
      scope = f["ptrace_scope"]
      yama = f" (Yama ptrace_scope={scope})" if scope not in (None, 0, 1) else ""
      out.append(
        Line(
          "warn",
          "cross-memory attach",
          f"refused between the ranks{yama}: "
          f"all-reduces from {fmt_bytes(cma_min)} within a node take "
          f"{path_names(large[-1].paths)} instead; fix: let the ranks ptrace each "
          "other: sysctl kernel.yama.ptrace_scope=1, docker run --cap-add "
          "SYS_PTRACE, one PID namespace for the node's ranks",
        )
      )
    elif large:
      out.append(
        Line(
          "ok",
          "cross-memory attach",
          f"allowed: all-reduces from {fmt_bytes(cma_min)} within a node take it",
        )
      )
  return out


def cross_transport(facts: list[dict[str, Any]], fabric: bool) -> list[Line]:
  """MPI over TCP between nodes where an RDMA fabric is there."""
  if len(_nodes(facts)) < 2 or not fabric:
    return []
  f = facts[0]
  if "Open MPI" in f["mpi_library"] and f["pml"] in ("", "ob1") and _tcp_only(f["btl"]):
    return [
      Line(
        "FAIL",
        "MPI across nodes",
        f"MPI runs over TCP between the nodes "
        f"(OMPI_MCA_btl={f['btl']}), although this node has an RDMA fabric; fix: drop "
        "the btl restriction, or use --mca pml ucx",
      )
    ]
  return []


def link_lines(links: list[dict[str, Any]]) -> list[Line]:
  """Each link's TCP stream against what it should carry."""
  out = []
  for k in links:
    name = f"link {k['from']} -> {k['to']}"
    if k["error"] or not k["rate"]:
      out.append(
        Line(
          "FAIL",
          name,
          f"no stream got through ({k['error'] or 'nothing arrived'}); "
          "fix: a firewall between the nodes, or the wrong interface (Open MPI's "
          "btl_tcp_if_include and oob_tcp_if_include)",
        )
      )
      continue
    expected, why = k["loopback"], "this node's TCP over loopback"
    if k["rated"] and k["rated"] < expected:
      expected, why = k["rated"], f"{k['interface']}'s rated speed"
    share = k["rate"] / expected if expected else 1.0
    text = (
      f"{fmt_rate(k['rate'])} over TCP, {share:.0%} of the {fmt_rate(expected)} expected ({why})"
    )
    if share < HALF:
      out.append(
        Line(
          "FAIL",
          name,
          f"{text}: below half; fix: a slow or shaped link (tc qdisc "
          f"show dev {k['interface'] or 'IF'}), a NIC at a lower speed (ethtool), or "
          "another job's traffic on it",
        )
      )
    else:
      out.append(Line("ok", name, text))
  return out


def cache(facts: list[dict[str, Any]]) -> Line:
  bad = [f for f in facts if f["cache"]["error"]]
  if bad:
    c = bad[0]["cache"]
    return Line(
      "FAIL",
      "compile cache",
      f"{c['dir']} cannot be written on "
      f"{ranks_text([f['rank'] for f in bad])} ({c['error']}): every rank compiles "
      "every program itself; fix: point MPIJAX_COMPILE_CACHE (or "
      "JAX_COMPILATION_CACHE_DIR) at a writable directory, or MPIJAX_COMPILE_CACHE=off",
    )
  d = facts[0]["cache"]["dir"]
  if d is None:
    return Line("ok", "compile cache", "off")
  return Line("ok", "compile cache", f"{d}, writable on every rank")
