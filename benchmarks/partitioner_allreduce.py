"""XLA's cross-process collectives over MPI (mpijax's bridge) and over gloo.

The code most JAX users write: global ``jax.Array``s sharded over the ranks,
whose collectives XLA runs itself. Rows (µs per blocking call: p10 / median
/ p90 of single calls, max over ranks; SIZE is the bytes each rank puts in):

* ``jit x.sum(0)`` of rows sharded ``P('x', None)``, one row of SIZE bytes per
  rank: the all-reduce XLA's partitioner inserts, over MPI (JAX's distributed
  runtime as ``mpijax.init()`` starts it, XLA's MPI collectives through
  mpijax's bridge);
* the same with ``mpijax.shard_map`` + ``mpijax.lax.psum``, same job, calls
  interleaved: mpijax's own all-reduce, the targets' reference;
* ``jax.lax.all_gather``, ``psum_scatter``, ``all_to_all`` and ``ppermute``
  (a ring) in a jitted ``jax.shard_map`` over the same rows: XLA's other
  collectives, each beside ``mpijax.lax``'s equivalent in
  ``mpijax.shard_map``;
* every XLA row again over gloo (``MPIJAX_XLA_COLLECTIVES=gloo``), in its own
  job (the transport is chosen when JAX's backend starts), with the mpijax
  all-reduce timed again in that job.

``--devices L`` gives every rank L CPU devices
(``--xla_force_host_platform_device_count``): the rows then span every
device of every rank, each (rank, local device) a member of XLA's
communicators, and the target's two references join them in the same job,
their calls interleaved with the rest: XLA's all-reduce between the L
devices of each rank alone (every rank at once), and the all-reduce of the
same rows over one device of each rank (MPI, P members).

Every row's result is checked against NumPy before it is timed; the script
exits 1 if any result is wrong.

Run it from a plain shell (it starts one bounded mpirun job per phase and
rank count)::

  python benchmarks/partitioner_allreduce.py            # 2 and 4 ranks
  python benchmarks/partitioner_allreduce.py --np 2 --quick
  python benchmarks/partitioner_allreduce.py --np 2 --devices 2   # 2 x 2
  python benchmarks/partitioner_allreduce.py --np 2 --devices 2 --repeats 3   # 3 jobs each

or as an MPI job (that job measures the MPI phase; rank 0 starts the gloo one)::

  timeout 900 mpirun --allow-run-as-root --oversubscribe -n 2 python benchmarks/partitioner_allreduce.py

Writes ``partitioner_allreduce_np{P}.json`` (``..._np{P}x{L}`` with ``--devices``), ``.md`` and ``.png`` to ``--out``
(default ``benchmarks/results/``) and prints the tables and the targets.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import allreduce as ar  # noqa: E402
from _common import HarnessComm  # noqa: E402
from _common import Row  # noqa: E402

SCRIPT = os.path.abspath(__file__)
DEFAULT_SIZES = (4, 4 << 10, 64 << 10, 256 << 10, 4 << 20, 16 << 20)
QUICK_SIZES = (4, 4 << 10, 256 << 10)
# With several devices per rank: the targets name 4 KiB and 1 MiB.
DEVICES_SIZES = (4, 4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
CALLS = 300  # blocking calls timed per row and size (QUICK_CALLS with --quick)
QUICK_CALLS = 60

KINDS = ("all_gather", "psum_scatter", "all_to_all", "ppermute")
# key -> label, in table order.
LABELS = {
  "xla_mpi": "jit x.sum(0): XLA's all-reduce over MPI (mpijax bridge)",
  "mpijax_psum": "mpijax.shard_map + mpijax.lax.psum",
  **{f"xla_{k}_mpi": f"jax.lax.{k} in jax.shard_map, over MPI" for k in KINDS},
  **{f"mpijax_{k}": f"mpijax.lax.{k} in mpijax.shard_map" for k in KINDS},
  "xla_gloo": "jit x.sum(0): XLA's all-reduce over gloo",
  **{f"xla_{k}_gloo": f"jax.lax.{k} in jax.shard_map, over gloo" for k in KINDS},
  "mpijax_psum_gloojob": "mpijax.shard_map + mpijax.lax.psum [gloo job]",
  "xla_mpi_check": "jit x.sum(0) over MPI, MPIJAX_CHECK=1",
  "mpijax_psum_checkjob": "mpijax.shard_map + mpijax.lax.psum [MPIJAX_CHECK=1 job]",
  "xla_local": "jit x.sum(0) between each rank's own devices, every rank at once (same job)",
  "xla_mpi_flat": "jit x.sum(0) over MPI, one device of each rank (same job)",
  "xla_add1": "jit x + 1 over the same rows: reads and writes what any all-reduce must",
}
# phase -> (its rows, its environment)
PHASES = {
  "mpi": (
    ("xla_mpi", "mpijax_psum")
    + tuple(f"xla_{k}_mpi" for k in KINDS)
    + tuple(f"mpijax_{k}" for k in KINDS),
    {},
  ),
  "gloo": (
    ("xla_gloo",) + tuple(f"xla_{k}_gloo" for k in KINDS) + ("mpijax_psum_gloojob",),
    {"MPIJAX_XLA_COLLECTIVES": "gloo"},
  ),
  # What comparing every call in a message of its own would cost, against
  # the default, which compares the ranks' operations inside the exchange.
  "check": (("xla_mpi_check", "mpijax_psum_checkjob"), {"MPIJAX_CHECK": "1"}),
}
# With --devices L, in the MPI phase: the target's references and the floor.
DEVICES_KEYS = ("xla_local", "xla_mpi_flat", "xla_add1")


def phase_plan(nprocs: int, devices: int) -> dict[str, tuple[int, dict[str, str]]]:
  """phase -> (ranks, environment) of a run at ``nprocs`` x ``devices``."""
  if devices == 1:
    return {p: (nprocs, env) for p, (_, env) in PHASES.items()}
  dev = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
  return {"mpi": (nprocs, dev), "gloo": (nprocs, {**PHASES["gloo"][1], **dev})}


def _check(got, want: float, what: str) -> None:
  _common.check_close(got, want, what, rtol=1e-6)  # raises _common.WrongResult


def _rows(n_global: int, nbytes: int):
  """This rank's rows of the global (devices, SIZE) array: device g's row is g + 1."""
  import jax
  import numpy as np

  L = jax.local_device_count()
  first = jax.process_index() * L
  return np.stack([np.full(max(nbytes // 4, 1), first + l + 1, np.float32) for l in range(L)])


def _elements(n: int, nbytes: int) -> int:
  """Elements per row: SIZE bytes, rounded to a multiple of the device count
  (the blocks psum_scatter and all_to_all hand each device)."""
  return max(n, (nbytes // 4) // n * n)


def _full(n: int, m: int):
  """The global (n, m) array the kind rows use: row g holds g * m + 0 .. m - 1, mod 251."""
  import numpy as np

  return np.arange(n * m, dtype=np.float32).reshape(n, m) % 251


def _expected(kind: str, full, g: int, n: int):
  """Device g's block of the result of `kind` over the rows of `full`."""
  m = full.shape[1]
  if kind == "all_gather":
    return full
  if kind == "psum_scatter":
    return full.sum(0)[g * m // n : (g + 1) * m // n][None]
  if kind == "all_to_all":
    return full.reshape(n, n, m // n)[:, g, :].reshape(n, m // n)
  return full[(g - 1) % n][None]  # ppermute: the ring i -> i + 1


def _body(lax, kind: str, n: int):
  if kind == "all_gather":
    return lambda b: lax.all_gather(b, "x", tiled=True)
  if kind == "psum_scatter":
    return lambda b: lax.psum_scatter(b, "x", scatter_dimension=1, tiled=True)
  if kind == "all_to_all":
    return lambda b: lax.all_to_all(b.reshape(n, -1), "x", 0, 0, tiled=True)
  ring = [(i, (i + 1) % n) for i in range(n)]
  return lambda b: lax.ppermute(b, "x", ring)


def _xla_factory(hc: HarnessComm, transport: str, kind: str = "sum", over: str = "all"):
  """XLA's ``kind`` over the rows of every device (``over="all"``), of this rank's devices
  alone (``"local"``) or of the first device of every rank (``"flat"``)."""
  import jax
  import numpy as np
  from jax.sharding import Mesh
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import mpijax

  rt = mpijax.init()
  if rt.xla_collectives != transport:
    raise ar.Skip(
      f"XLA's collectives run over {rt.xla_collectives or 'nothing'} in this job, "
      f"not {transport} (see mpijax's warning above)"
    )
  if over == "local":  # this rank's devices alone
    mine = list(jax.local_devices())
  elif over == "flat":  # the first device of every rank
    mine = [
      min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
      for p in range(jax.process_count())
    ]
  else:
    mine = None
  if mine is None:
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("x",))
  else:
    n = len(mine)
    mesh = Mesh(np.array(mine), ("x",))
  rows = NamedSharding(mesh, P("x", None))
  if kind == "sum":
    f = jax.jit(lambda x: x.sum(0), out_shardings=NamedSharding(mesh, P()))
  elif kind == "add1":
    f = jax.jit(lambda x: x + 1)
  else:
    f = jax.jit(
      jax.shard_map(
        _body(jax.lax, kind, n), mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False
      )
    )

  def build(nbytes: int):
    if kind in ("sum", "add1"):
      host = _rows(n, nbytes)
      if over == "local":  # device g of the job holds g + 1: this rank's rows
        want = sum(float(v) for v in host[:, 0])
      elif over == "flat":  # one row per rank: rank r's first device, g = r * L
        L = jax.local_device_count()
        host = host[:1]
        want = sum(p * L + 1 for p in range(n))
      else:
        want = n * (n + 1) / 2
      local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
      shards = [jax.device_put(host[i : i + 1], d) for i, d in enumerate(local)]
      x = jax.make_array_from_single_device_arrays((n, host.shape[1]), rows, shards)
      if kind == "add1":
        _check(f(x).addressable_shards[0].data, host[0, 0] + 1, "jit x + 1")
      else:
        _check(f(x).addressable_shards[0].data, want, f"jit x.sum(0) over {transport} ({over})")
    else:
      full = _full(n, _elements(n, nbytes))
      x = jax.make_array_from_callback(full.shape, rows, lambda i: full[i])
      y = f(x)
      for s in y.addressable_shards:
        g = s.device.id if n == 1 else list(mesh.devices.flat).index(s.device)
        got, want = np.asarray(s.data), _expected(kind, full, g, n)
        if got.shape != want.shape or not np.array_equal(got, want):
          raise _common.WrongResult(f"jax.lax.{kind} over {transport} on device {g}")
    return (lambda: f(x).block_until_ready()), 1

  return build


def _mpijax_factory(hc: HarnessComm, kind: str = "sum"):
  import jax
  import numpy as np
  from jax.sharding import Mesh
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import mpijax
  import mpijax.lax as mlax

  mpijax.init()
  n = (
    jax.device_count()
    if jax.process_count() > 1
    else mpijax.process_count() * mpijax.local_device_count()
  )
  L, r = mpijax.local_device_count(), mpijax.process_index()
  mesh = mpijax.make_mesh((n,), ("x",))
  if kind == "sum":
    f = jax.jit(
      mpijax.shard_map(
        lambda v: mlax.psum(v.sum(0), "x"), mesh=mesh, in_specs=P("x"), out_specs=P()
      )
    )
  else:
    f = jax.jit(
      mpijax.shard_map(_body(mlax, kind, n), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    )

  # This rank's rows, row l on local device l: the layout mpijax.shard_map
  # splits its input into, so that no call starts with a copy between devices.
  local_rows = NamedSharding(Mesh(np.array(jax.local_devices()), ("l",)), P("l"))

  def build(nbytes: int):
    if kind == "sum":
      x = jax.device_put(_rows(n, nbytes), local_rows)
      _check(f(x), n * (n + 1) / 2, "mpijax.shard_map psum")
    else:
      full = _full(n, _elements(n, nbytes))
      x = jax.device_put(full[r * L : (r + 1) * L], local_rows)
      got = np.asarray(f(x))
      want = np.concatenate([_expected(kind, full, r * L + l, n) for l in range(L)])
      if got.shape != want.shape or not np.array_equal(got, want):
        raise _common.WrongResult(f"mpijax.lax.{kind}")
    return (lambda: f(x).block_until_ready()), 1

  return build


def _time_calls(args):
  calls = QUICK_CALLS if args.quick else CALLS
  return lambda steps, hc, nbytes: _common.time_calls(steps, hc, calls=calls)


def phase_rows(phase: str, args, sizes: list[int]) -> list[Row]:
  import mpijax  # before jax: names mpijax's bridge for XLA (see docs/jax-integration.md)

  init_error = None
  try:
    mpijax.init()
  except Exception as e:
    init_error = f"mpijax.init() failed: {type(e).__name__}: {e}"
  hc = HarnessComm()
  if init_error:
    ar._log(hc, init_error)

  def guarded(factory):
    def wrapped():
      if init_error:
        raise ar.Skip(init_error)
      return factory()

    return wrapped

  keys = PHASES[phase][0]
  if phase == "mpi" and not init_error and mpijax.local_device_count() > 1:
    keys += DEVICES_KEYS
  factories = {
    "xla_mpi": lambda: _xla_factory(hc, "mpi"),
    "xla_gloo": lambda: _xla_factory(hc, "gloo"),
    "mpijax_psum": lambda: _mpijax_factory(hc),
    "mpijax_psum_gloojob": lambda: _mpijax_factory(hc),
    "xla_mpi_check": lambda: _xla_factory(hc, "mpi"),
    "mpijax_psum_checkjob": lambda: _mpijax_factory(hc),
    "xla_local": lambda: _xla_factory(hc, "mpi", over="local"),
    "xla_mpi_flat": lambda: _xla_factory(hc, "mpi", over="flat"),
    "xla_add1": lambda: _xla_factory(hc, "mpi", "add1"),
  }
  for k in KINDS:
    factories[f"xla_{k}_mpi"] = lambda k=k: _xla_factory(hc, "mpi", k)
    factories[f"xla_{k}_gloo"] = lambda k=k: _xla_factory(hc, "gloo", k)
    factories[f"mpijax_{k}"] = lambda k=k: _mpijax_factory(hc, k)
  return ar._measure(
    hc,
    [(k, LABELS[k], phase, guarded(factories[k])) for k in keys],
    sizes,
    args,
    time_fn=_time_calls(args),
  )


def _per_job(t: _common.Targets, s: int, key: str, parts: tuple[str, ...]) -> str:
  """The ratio key / sum(parts) in each job, where the rows were combined over jobs."""
  num, dens = t.jobs(key, s), [t.jobs(p, s) for p in parts]
  if not num or any(not d or len(d) != len(num) for d in dens):
    return ""
  ratios = [n / sum(d[j] for d in dens) for j, n in enumerate(num)]
  return " (each job: " + ", ".join(f"{r:.3f}x" for r in ratios) + ")"


def check_devices_targets(rows: list[Row], sizes: list[int], devices: int) -> list[str]:
  """The targets at several devices per rank, as PASS / FAIL / N/A lines."""
  t = _common.Targets(rows)
  get, out = t.get, t.lines
  for s in sizes:
    size = _common.fmt_size(s)
    mpi, gloo, own = get("xla_mpi", s), get("xla_gloo", s), get("mpijax_psum", s)
    local, flat = get("xla_local", s), get("xla_mpi_flat", s)
    if s in (4 << 10, 1 << 20):
      t.ratio(f"{size} all-reduce over MPI >= 3x faster than gloo", gloo, mpi, 3, at_least=True)
    # Both parts timed in this job, their calls interleaved with the whole's.
    t.ratio(
      f"{size} all-reduce <= 1.3x (local + 1 device per rank, same job)",
      mpi,
      None if local is None or flat is None else local + flat,
      1.3,
      extra=""
      if local is None or flat is None
      else f" ({local:.1f} + {flat:.1f})"
      + _per_job(t, s, "xla_mpi", ("xla_local", "xla_mpi_flat")),
    )
    floor = get("xla_add1", s)
    if floor is not None and mpi is not None:
      out.append(
        f"info  {size} floor, jit x + 1 over the same rows: {floor:.1f} us; all-reduce / floor "
        f"= {mpi / floor:.3f}x"
      )
    if s >= 256 << 10:
      t.ratio(f"{size} all-reduce no slower than mpijax's psum over the same devices", mpi, own, 1)
    for k in KINDS:
      km, kg, mine = get(f"xla_{k}_mpi", s), get(f"xla_{k}_gloo", s), get(f"mpijax_{k}", s)
      if km is not None and kg is not None:
        out.append(f"info  {size} {k}, gloo / MPI: {kg:.1f} / {km:.1f} us = {kg / km:.1f}x")
      if km is not None and mine is not None:
        out.append(
          f"info  {size} {k}, XLA over MPI / mpijax.lax: {km:.1f} / {mine:.1f} us = "
          f"{km / mine:.2f}x"
        )
  out.append(f"({devices} devices per rank: the targets of 1 device per rank do not apply)")
  return out


def check_targets(rows: list[Row], sizes: list[int], nprocs: int) -> list[str]:
  """The targets as PASS / FAIL / N/A lines."""
  t = _common.Targets(rows)
  get, line, out = t.get, t.line, t.lines
  by = {r.key: r for r in rows}

  def stat(key, s, which):
    return by[key].us(s, which) if key in by else None

  for s in sizes:
    size = _common.fmt_size(s)
    mpi, ref = get("xla_mpi", s), get("mpijax_psum", s)
    if mpi is None or ref is None:
      line(None, f"{size} all-reduce against mpijax's psum: missing")
    elif s <= 64 << 10:
      t.ratio(f"{size} all-reduce median <= 1.5x mpijax's psum", mpi, ref, 1.5)
      t.ratio(f"{size} all-reduce p90 <= 2x its median", stat("xla_mpi", s, "p90"), mpi, 2)
    else:
      t.ratio(f"{size} all-reduce median <= 1.2x mpijax's psum", mpi, ref, 1.2)
    gloo = get("xla_gloo", s)
    if mpi is not None and gloo is not None:
      out.append(
        f"info  {size} all-reduce, gloo / MPI: {gloo:.1f} / {mpi:.1f} us = {gloo / mpi:.1f}x"
      )
    for k in KINDS:
      km, kg, own = get(f"xla_{k}_mpi", s), get(f"xla_{k}_gloo", s), get(f"mpijax_{k}", s)
      if 4 << 10 <= s <= 256 << 10:
        t.ratio(f"{size} {k} over MPI >= 5x faster than gloo", kg, km, 5, at_least=True)
      if km is not None and own is not None:
        out.append(
          f"info  {size} {k}, XLA over MPI / mpijax.lax: {km:.1f} / {own:.1f} us = {km / own:.2f}x"
        )
    # The two transports run in separate jobs; the mpijax row, timed in both,
    # shows how far the machine drifted between them.
    a, b = get("mpijax_psum", s), get("mpijax_psum_gloojob", s)
    if a is not None and b is not None:
      out.append(
        f"info  {size} mpijax psum, gloo job / MPI job: {b:.1f} / {a:.1f} us = {b / a:.2f}x"
      )
    checked = get("xla_mpi_check", s)
    if mpi is not None and checked is not None:
      out.append(
        f"info  {size} all-reduce, MPIJAX_CHECK=1 / default: {checked:.1f} / {mpi:.1f} us "
        f"(+{checked - mpi:.1f} us)"
      )
  if nprocs not in (2, 4):
    out.append(f"(targets are stated for 2 and 4 ranks; this run has {nprocs})")
  return out


def report(rows: list[Row], sizes: list[int], nprocs: int, args, meta: dict[str, Any]) -> int:
  order = list(LABELS)
  rows = sorted(rows, key=lambda r: order.index(r.key))
  by = {r.key: r for r in rows}
  devices = getattr(args, "devices", 1)
  layout = f"{nprocs} ranks" + (f" x {devices} devices" if devices > 1 else "")
  title = f"XLA's cross-process collectives, {layout}: median µs per blocking call (max over ranks)"
  parts = [f"### {title}", ""]
  repeats = getattr(args, "repeats", 1)
  if repeats > 1:
    parts += [
      f"Every phase ran {repeats} times, the phases in round robin; each figure is the "
      "median over those jobs of each job's figure.",
      "",
    ]
  parts += [_common.markdown_table(rows, sizes)]
  if by.get("xla_mpi"):
    parts += [
      "",
      "Ratio to XLA's all-reduce over MPI:",
      "",
      _common.markdown_table(rows, sizes, ratio_to=by["xla_mpi"]),
    ]
  for which in ("p10", "p90"):
    parts += [
      "",
      f"{which} of single calls (µs, max over ranks):",
      "",
      _common.markdown_table(rows, sizes, stat=which),
    ]
  notes = _common.skip_notes(rows)
  if notes:
    parts += ["", "Not measured:", ""] + notes
  targets = (
    check_devices_targets(rows, sizes, devices)
    if devices > 1
    else check_targets(rows, sizes, nprocs)
  )
  parts += ["", "Targets:", "", "```"] + targets + ["```", "", _common.load_note()]
  text = "\n".join(parts)
  print("\n" + text, flush=True)
  name = f"partitioner_allreduce_np{nprocs}" + (f"x{devices}" if devices > 1 else "")
  _common.write_report(
    args.out,
    name,
    text,
    {
      "benchmark": "partitioner_allreduce",
      "nprocs": nprocs,
      "devices": devices,
      "sizes": sizes,
      "meta": meta,
      "targets": targets,
      "rows": [r.to_json() for r in rows],
    },
    rows,
    sizes,
    title,
  )
  return _common.exit_status(rows)


def _failed_rows(phase: str, reason: str, sizes) -> list[Row]:
  return [Row(k, LABELS[k], phase, {s: reason for s in sizes}) for k in PHASES[phase][0]]


def _phase_args(args, sizes: list[int]) -> list[str]:
  out = ["--sizes", ",".join(str(s) for s in sizes), "--trial-seconds", str(args.trial_seconds)]
  if args.trials:
    out += ["--trials", str(args.trials)]
  if args.quick:
    out += ["--quick"]
  return out


def _run_phase(args, sizes, nprocs, phase) -> tuple[list[Row], dict[str, Any]]:
  ranks, env = phase_plan(nprocs, args.devices)[phase]
  res = _common.run_phase(
    SCRIPT, ranks, phase, _phase_args(args, sizes), env=env, timeout=args.phase_timeout
  )
  if isinstance(res, str):
    return _failed_rows(phase, res, sizes), {}
  return res[0], res[1]


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument(
    "--sizes",
    default=None,
    help="comma-separated bytes per rank (default 4,4KiB,64KiB,256KiB,4MiB,16MiB)",
  )
  p.add_argument(
    "--np",
    default="2,4",
    help="rank counts to run from a plain shell, comma-separated (default 2,4)",
  )
  p.add_argument("--trials", type=int, default=None, help=argparse.SUPPRESS)
  p.add_argument("--trial-seconds", type=float, default=0.005, help=argparse.SUPPRESS)
  p.add_argument(
    "--devices",
    type=int,
    default=1,
    help="CPU devices per rank (default 1); more adds the several-devices references and targets",
  )
  p.add_argument(
    "--quick",
    action="store_true",
    help=f"smoke test: 4 B, 4 KiB, 256 KiB; {QUICK_CALLS} calls per cell",
  )
  p.add_argument(
    "--repeats",
    type=int,
    default=1,
    help="run every phase this many times, in round robin, and report the medians over "
    "the jobs (default 1); the targets' lines give each job's ratio too",
  )
  p.add_argument("--out", default=_common.default_out_dir(), help="output directory")
  p.add_argument("--phase-timeout", type=float, default=900, help="seconds per sub-job")
  p.add_argument("--verbose", action="store_true")
  p.add_argument("--phase", default=None, help=argparse.SUPPRESS)
  p.add_argument("--phase-out", default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  try:
    args.np = [int(v) for v in str(args.np).split(",") if v.strip()]
  except ValueError:
    p.error(f"--np wants rank counts like 2,4, got {args.np!r}")
  if any(v < 2 for v in args.np):
    p.error("--np: a cross-process all-reduce needs at least 2 ranks")
  if args.devices < 1:
    p.error(f"--devices wants a device count of at least 1, got {args.devices}")
  if args.repeats < 1:
    p.error(f"--repeats wants a count of at least 1, got {args.repeats}")
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  sizes = (
    _common.parse_sizes(args.sizes)
    if args.sizes
    else list(QUICK_SIZES if args.quick else DEVICES_SIZES if args.devices > 1 else DEFAULT_SIZES)
  )

  if args.phase is not None:  # one sub-job of an orchestrated run
    if args.phase not in PHASES:
      raise SystemExit(f"unknown --phase {args.phase!r}")
    rows = phase_rows(args.phase, args, sizes)
    return _common.finish_phase(args.phase_out, rows)

  if _common.under_mpi_launcher():
    if args.devices > 1:
      raise SystemExit("--devices runs from a plain shell (its phases have other rank counts)")
    if args.repeats > 1:
      raise SystemExit("--repeats runs from a plain shell (it starts each phase's job itself)")
    # This job measures the MPI phase; rank 0 then runs the gloo phase as a
    # fresh mpirun job of the same size while the others wait.
    rows = phase_rows("mpi", args, sizes)
    hc = HarnessComm()
    meta = _common.environment_info()
    status = None
    if hc.rank == 0:
      rows += _run_phase(args, sizes, hc.size, "gloo")[0]
      status = report(rows, sizes, hc.size, args, meta)
    hc.idle_barrier()
    return hc.bcast(status)

  status = 0
  for nprocs in args.np:
    jobs, meta = [], {}
    for _ in range(args.repeats):
      rows = []
      for phase in phase_plan(nprocs, args.devices):
        phase_rows_, phase_meta = _run_phase(args, sizes, nprocs, phase)
        rows += phase_rows_
        meta = meta or phase_meta
      jobs.append(rows)
    status = report(_common.combine_jobs(jobs), sizes, nprocs, args, meta) or status
  return status


if __name__ == "__main__":
  sys.exit(main())
