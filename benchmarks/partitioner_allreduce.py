"""The all-reduce XLA's partitioner inserts, over MPI (mpijax's bridge) and over gloo.

The code most JAX users write: a global ``jax.Array`` sharded over the ranks
(``P('x', None)``, one row of SIZE bytes per rank) and a jitted ``x.sum(0)``
with a replicated result, for which XLA inserts a cross-process all-reduce of
SIZE bytes. Rows (median µs per blocking call, max over ranks):

* ``jit x.sum(0)``, XLA's all-reduce over MPI: JAX's distributed runtime as
  ``mpijax.init()`` starts it (XLA's MPI collectives through mpijax's bridge);
* ``mpijax.shard_map`` + ``mpijax.lax.psum`` of the same rows, same job,
  trials interleaved: mpijax's own all-reduce, the target's reference;
* ``jit x.sum(0)`` over gloo (``MPIJAX_XLA_COLLECTIVES=gloo``), in its own
  job (the transport is chosen when JAX's backend starts), with the mpijax
  row timed again in that job.

Every row's result is checked against NumPy before it is timed; the script
exits 1 if any result is wrong.

Run it from a plain shell (it starts one bounded mpirun job per phase and
rank count)::

  python benchmarks/partitioner_allreduce.py            # 2 and 4 ranks
  python benchmarks/partitioner_allreduce.py --np 2 --quick

or as an MPI job (that job measures the MPI phase; rank 0 starts the gloo one)::

  timeout 900 mpirun --allow-run-as-root --oversubscribe -n 2 python benchmarks/partitioner_allreduce.py

Writes ``partitioner_allreduce_np{P}.json``, ``.md`` and ``.png`` to ``--out``
(default ``benchmarks/results/``) and prints the table and the targets.
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
DEFAULT_SIZES = (4, 4 << 10, 256 << 10, 4 << 20, 16 << 20, 64 << 20)
QUICK_SIZES = (4, 4 << 10, 256 << 10)

# key -> label, in table order.
LABELS = {
    "xla_mpi": "jit x.sum(0): XLA's all-reduce over MPI (mpijax bridge)",
    "mpijax_psum": "mpijax.shard_map + mpijax.lax.psum",
    "xla_gloo": "jit x.sum(0): XLA's all-reduce over gloo",
    "mpijax_psum_gloojob": "mpijax.shard_map + mpijax.lax.psum [gloo job]",
}
# phase -> (its rows, its environment)
PHASES = {
    "mpi": (("xla_mpi", "mpijax_psum"), {}),
    "gloo": (("xla_gloo", "mpijax_psum_gloojob"), {"MPIJAX_XLA_COLLECTIVES": "gloo"}),
}


def _check(got, want: float, what: str) -> None:
  _common.check_close(got, want, what, rtol=1e-6)  # raises _common.WrongResult


def _rows(n_global: int, nbytes: int):
  """This rank's rows of the global (devices, SIZE) array: device g's row is g + 1."""
  import jax
  import numpy as np
  L = jax.local_device_count()
  first = jax.process_index() * L
  return np.stack([np.full(nbytes // 4, first + l + 1, np.float32) for l in range(L)])


def _xla_factory(hc: HarnessComm, transport: str):
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import mpijax
  rt = mpijax.init()
  if rt.xla_collectives != transport:
    raise ar.Skip(f"XLA's collectives run over {rt.xla_collectives or 'nothing'} in this job, "
                  f"not {transport} (see mpijax's warning above)")
  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("x",))
  rows = NamedSharding(mesh, P("x", None))
  f = jax.jit(lambda x: x.sum(0), out_shardings=NamedSharding(mesh, P()))

  def build(nbytes: int):
    host = _rows(n, nbytes)
    shards = [jax.device_put(host[i:i + 1], d) for i, d in enumerate(jax.local_devices())]
    x = jax.make_array_from_single_device_arrays((n, nbytes // 4), rows, shards)
    _check(f(x).addressable_shards[0].data, n * (n + 1) / 2, f"jit x.sum(0) over {transport}")
    return (lambda: f(x).block_until_ready()), 1
  return build


def _mpijax_factory(hc: HarnessComm):
  import jax
  from jax.sharding import PartitionSpec as P

  import mpijax
  import mpijax.lax as mlax
  mpijax.init()
  n = jax.device_count() if jax.process_count() > 1 else mpijax.process_count() * \
      mpijax.local_device_count()
  mesh = mpijax.make_mesh((n,), ("x",))
  f = jax.jit(mpijax.shard_map(lambda v: mlax.psum(v.sum(0), "x"), mesh=mesh,
                               in_specs=P("x"), out_specs=P()))

  def build(nbytes: int):
    x = jax.device_put(_rows(n, nbytes))
    _check(f(x), n * (n + 1) / 2, "mpijax.shard_map psum")
    return (lambda: f(x).block_until_ready()), 1
  return build


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
  factories = {"xla_mpi": lambda: _xla_factory(hc, "mpi"),
               "xla_gloo": lambda: _xla_factory(hc, "gloo"),
               "mpijax_psum": lambda: _mpijax_factory(hc),
               "mpijax_psum_gloojob": lambda: _mpijax_factory(hc)}
  return ar._measure(hc, [(k, LABELS[k], phase, guarded(factories[k])) for k in keys], sizes,
                     args)


def check_targets(rows: list[Row], sizes: list[int], nprocs: int) -> list[str]:
  """The targets as PASS / FAIL / N/A lines."""
  t = _common.Targets(rows)
  get, line, out = t.get, t.line, t.lines

  for s in sizes:
    mpi, gloo = get("xla_mpi", s), get("xla_gloo", s)
    need = None
    if nprocs == 2 and s <= 256 << 10:
      need = 10
    elif nprocs == 2 and s == 4 << 20:
      need = 3
    elif nprocs == 4 and s <= 256 << 10:
      need = 5
    if need is not None:
      if mpi is None or gloo is None:
        line(None, f"{_common.fmt_size(s)} MPI >= {need}x faster than gloo: missing")
      else:
        line(gloo >= need * mpi, f"{_common.fmt_size(s)} MPI >= {need}x faster than gloo: "
             f"{gloo:.1f} / {mpi:.1f} us = {gloo / mpi:.1f}x")
    ref = get("mpijax_psum", s)
    if nprocs == 2 and s >= 256 << 10:
      if mpi is None or ref is None:
        line(None, f"{_common.fmt_size(s)} MPI <= 1.5x mpijax.shard_map psum (same job): missing")
      else:
        line(mpi <= 1.5 * ref, f"{_common.fmt_size(s)} MPI <= 1.5x mpijax.shard_map psum "
             f"(same job): {mpi:.1f} / {ref:.1f} us = {mpi / ref:.2f}x")
    # The two transports run in separate jobs; the mpijax row, timed in both,
    # shows how far the machine drifted between them.
    a, b = get("mpijax_psum", s), get("mpijax_psum_gloojob", s)
    if a is not None and b is not None:
      out.append(f"info  {_common.fmt_size(s)} mpijax psum, gloo job / MPI job: {b:.1f} / "
                 f"{a:.1f} us = {b / a:.2f}x")
  if nprocs not in (2, 4):
    out.append(f"(targets are stated for 2 and 4 ranks; this run has {nprocs})")
  return out


def report(rows: list[Row], sizes: list[int], nprocs: int, args, meta: dict[str, Any]) -> int:
  order = list(LABELS)
  rows = sorted(rows, key=lambda r: order.index(r.key))
  by = {r.key: r for r in rows}
  title = (f"XLA's cross-process all-reduce (jit x.sum(0), P('x', None)), {nprocs} ranks: "
           "median µs per call (max over ranks)")
  parts = [f"### {title}", "", _common.markdown_table(rows, sizes)]
  if by.get("xla_mpi"):
    parts += ["", "Ratio to XLA's all-reduce over MPI:", "",
              _common.markdown_table(rows, sizes, ratio_to=by["xla_mpi"])]
  parts += ["", "Fastest trial instead of the median (µs, max over ranks):", "",
            _common.markdown_table(rows, sizes, stat="best")]
  notes = _common.skip_notes(rows)
  if notes:
    parts += ["", "Not measured:", ""] + notes
  targets = check_targets(rows, sizes, nprocs)
  parts += ["", "Targets:", "", "```"] + targets + ["```", "", _common.load_note()]
  text = "\n".join(parts)
  print("\n" + text, flush=True)
  _common.write_report(args.out, f"partitioner_allreduce_np{nprocs}", text,
                       {"benchmark": "partitioner_allreduce", "nprocs": nprocs, "sizes": sizes,
                        "meta": meta, "targets": targets, "rows": [r.to_json() for r in rows]}, rows, sizes, title)
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
  res = _common.run_phase(SCRIPT, nprocs, phase, _phase_args(args, sizes),
                          env=PHASES[phase][1], timeout=args.phase_timeout)
  if isinstance(res, str):
    return _failed_rows(phase, res, sizes), {}
  return res[0], res[1]


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--sizes", default=None,
                 help="comma-separated bytes per rank (default 4,4KiB,256KiB,4MiB,16MiB,64MiB)")
  p.add_argument("--np", default="2,4",
                 help="rank counts to run from a plain shell, comma-separated (default 2,4)")
  p.add_argument("--trials", type=int, default=None,
                 help="trials per cell (default 30 below 1 MiB, 10 from 1 MiB; 5 with --quick)")
  p.add_argument("--trial-seconds", type=float, default=0.005,
                 help="target length of one trial (default 0.005)")
  p.add_argument("--quick", action="store_true", help="smoke test: 4 B, 4 KiB, 256 KiB; 5 trials")
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
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  sizes = (_common.parse_sizes(args.sizes) if args.sizes
           else list(QUICK_SIZES if args.quick else DEFAULT_SIZES))

  if args.phase is not None:  # one sub-job of an orchestrated run
    if args.phase not in PHASES:
      raise SystemExit(f"unknown --phase {args.phase!r}")
    rows = phase_rows(args.phase, args, sizes)
    return _common.finish_phase(args.phase_out, rows)

  if _common.under_mpi_launcher():
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
    rows, meta = [], {}
    for phase in PHASES:
      phase_rows_, phase_meta = _run_phase(args, sizes, nprocs, phase)
      rows += phase_rows_
      meta = meta or phase_meta
    status = report(rows, sizes, nprocs, args, meta) or status
  return status


if __name__ == "__main__":
  sys.exit(main())
