"""One mpi4jax program on mpi4jax and on mpijax.compat.mpi4jax, measured three ways.

Each program is written once against mpi4jax's API and run with the module
``m`` being ``mpi4jax`` (when importable; installed as in benchmarks/README.md)
and ``mpijax.compat.mpi4jax``:

1. one operation per ``jax.jit`` call: ``m.allreduce(x, op=MPI.SUM,
   comm=comm)``, ten chained in one call (time per all-reduce), and
   ``m.sendrecv(x, x, source=prev, dest=next, comm=comm)`` (a ring);
2. the same ``sendrecv`` ring inside a jitted ``jax.lax.fori_loop``
   (``LOOP`` exchanges per call; time per exchange): no dispatch between them;
3. an application: a 2-D heat-diffusion solver whose grid's rows are split
   over the ranks, with a halo exchange (two ``m.sendrecv``, the block's
   first row up and its last row down, periodic) before each 5-point stencil
   step, ``STEPS`` steps in a jitted ``fori_loop`` (time per step), written as
   mpi4jax's own shallow-water example exchanges its halos. Beside it, the
   same step without the exchange (each block wraps around by itself): the
   compute alone, which no transport can speed up.

Each module runs in an MPI job of its own (mpi4jax's never loads mpijax,
whose import replaces some of JAX's lowering rules); the two jobs alternate
``--repeats`` times (default 3). A cell is the median over its jobs; the
speed-up, mpi4jax's time / the compat module's, is the median over the pairs
of jobs run one after the other, each pair's given too. Every program's
result is checked before it is timed (inputs vary along the buffer; the
solver against the same steps on the whole grid in one process); a wrong
one is never timed, shows as WRONG RESULT, and the run exits with status 1.

From a plain shell (it starts each job with ``mpirun``)::

  python benchmarks/mpi4jax_compat.py --np 2            # 4 B to 4 MiB; grids 128 x 1024, 128 x 4096
  python benchmarks/mpi4jax_compat.py --np 2 --quick    # 4 B to 256 KiB, one grid, 1 pair of jobs

Writes ``mpi4jax_compat_np{P}.json``, ``.md`` and ``.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
from _common import HarnessComm  # noqa: E402
from _common import Row  # noqa: E402

SCRIPT = os.path.abspath(__file__)
CHAIN = 10
LOOP = 100  # sendrecv exchanges per call in the loop
STEPS = 20  # solver steps per call
GRID_ROWS = 128  # each rank's rows; the columns make the halo: 4 bytes each
PROGRAMS = {
  "allreduce": "allreduce, 1 per jit call",
  "allreduce10": f"allreduce, {CHAIN} chained in 1 jit call (per op)",
  "sendrecv": "sendrecv ring, 1 per jit call",
  "sendrecv_loop": f"sendrecv ring, {LOOP} in a jitted fori_loop (per op)",
}
APP = {
  "halo": "heat diffusion, halo exchange + stencil (per step)",
  "stencil": "heat diffusion, the stencil alone (per step)",
}
IMPLS = {"mpi4jax": "mpi4jax", "compat": "mpijax.compat.mpi4jax"}


def _module(impl: str):
  if impl == "compat":
    import mpijax.compat.mpi4jax as m

    return m
  try:
    import mpi4jax as m
  except Exception as e:
    return f"mpi4jax not importable: {type(e).__name__}: {e}"
  if "mpijax" in getattr(m, "__file__", ""):
    return "'import mpi4jax' gives mpijax.compat.mpi4jax here (a shim on PYTHONPATH?)"
  return m


def _program(name: str, m, comm, hc: HarnessComm) -> Callable[[int], tuple]:
  """nbytes -> (jitted function, its input, the expected result, operations per call).

  Inputs vary along the buffer, so a misplaced block is a wrong result too.
  """
  import jax
  import jax.numpy as jnp

  MPI, r, n = hc.MPI, hc.rank, hc.size
  nxt, prv = (r + 1) % n, (r - 1) % n

  def build(nbytes: int):
    k = jnp.arange(nbytes // 4, dtype=jnp.float32) % 7
    if name == "allreduce":
      f = jax.jit(lambda x: m.allreduce(x, op=MPI.SUM, comm=comm))
      return f, k + r + 1, n * k + n * (n + 1) / 2, 1
    if name == "allreduce10":

      def chain(x):
        for _ in range(CHAIN):
          x = m.allreduce(x, op=MPI.SUM, comm=comm)
        return x

      return jax.jit(chain), k + 1, float(n) ** CHAIN * (k + 1), CHAIN
    if name == "sendrecv":
      f = jax.jit(lambda x: m.sendrecv(x, x, source=prv, dest=nxt, comm=comm))
      return f, k + r + 1, k + prv + 1, 1

    def body(i, x):
      return m.sendrecv(x, x, source=prv, dest=nxt, comm=comm)

    f = jax.jit(lambda x: jax.lax.fori_loop(0, LOOP, body, x))
    return f, k + r + 1, k + (r - LOOP) % n + 1, LOOP

  return build


def _laplacian(up, u, down):
  """The 5-point stencil's sum around each point: rows above and below given."""
  import jax.numpy as jnp

  return up + down + jnp.roll(u, 1, axis=1) + jnp.roll(u, -1, axis=1) - 4 * u


def _solver(name: str, m, comm, hc: HarnessComm) -> Callable[[int], tuple]:
  """halo bytes -> (jitted solver, this rank's block, its expected block, steps per call)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  r, n = hc.rank, hc.size
  below, above = (r + 1) % n, (r - 1) % n

  def halo_step(u):
    # This block's last row goes to the rank below, which holds the next rows;
    # its first row to the rank above.
    from_above = m.sendrecv(u[-1], u[-1], source=above, dest=below, comm=comm)
    from_below = m.sendrecv(u[0], u[0], source=below, dest=above, comm=comm)
    up = jnp.concatenate([from_above[None], u[:-1]])
    down = jnp.concatenate([u[1:], from_below[None]])
    return u + 0.1 * _laplacian(up, u, down)

  def alone_step(u):  # the same stencil, the block wrapping around by itself
    return u + 0.1 * _laplacian(jnp.roll(u, 1, axis=0), u, jnp.roll(u, -1, axis=0))

  step = halo_step if name == "halo" else alone_step

  def build(nbytes: int):
    cols = nbytes // 4
    rng = np.random.default_rng(0)
    whole = rng.random((n * GRID_ROWS, cols), dtype=np.float32)
    mine = whole[r * GRID_ROWS : (r + 1) * GRID_ROWS]
    f = jax.jit(lambda u: jax.lax.fori_loop(0, STEPS, lambda i, u: step(u), u))
    ref = jax.jit(lambda u: jax.lax.fori_loop(0, STEPS, lambda i, u: alone_step(u), u))
    if name == "halo":  # the whole grid in this process: its rows wrap around the ranks
      want = np.asarray(ref(jnp.asarray(whole)))[r * GRID_ROWS : (r + 1) * GRID_ROWS]
    else:
      want = np.asarray(ref(jnp.asarray(mine)))
    return f, jnp.asarray(mine), want, STEPS

  return build


def measure(impl: str, args, sizes: list[int], grids: list[int]) -> list[Row]:
  """This job's rows: every program and solver of one module, checked, then timed
  interleaved."""
  hc = HarnessComm(plain=impl == "mpi4jax")
  m = _module(impl)
  rows, builders = [], {}
  for name, label in list(PROGRAMS.items()) + list(APP.items()):
    app = name in APP
    row = Row(f"{impl}:{name}", f"{label}, {IMPLS[impl]}", impl)
    rows.append(row)
    at = grids if app else sizes
    if isinstance(m, str):
      row.cells = {s: m for s in at}
      continue
    make = _solver if app else _program
    builders[row.key] = (make(name, m, hc.comm.Dup(), hc), at)
  for s in sorted({s for _, at in builders.values() for s in at}):
    steps = {}
    for row in rows:
      if row.key not in builders or s not in builders[row.key][1]:
        continue
      f, x, want, per = builders[row.key][0](s)
      wrong = None
      try:
        _common.check_close(f(x), want, f"{row.label} @ {_common.fmt_size(s)}", rtol=1e-5)
      except _common.WrongResult as e:
        wrong = str(e)
      wrong = next((w for w in hc.comm.allgather(wrong) if w), None)  # every rank agrees
      if wrong:
        row.cells[s] = _common.WRONG + wrong
        continue
      steps[row.key] = ((lambda f=f, x=x: f(x).block_until_ready()), per)
    trials = args.trials or (5 if args.quick else _common.default_trials(s))
    timed = _common.time_interleaved(steps, hc, trials=trials, trial_seconds=args.trial_seconds)
    for key, t in timed.items():
      row = next(r for r in rows if r.key == key)
      row.cells[s] = t
      if hc.rank == 0:
        print(f"{row.label} @ {_common.fmt_size(s)}: {t.median_us:.2f} us", flush=True)
  return _common.without_mpijax(rows) if impl == "mpi4jax" else rows


def speedups(jobs: list[list[Row]], name: str, size: int) -> list[float]:
  """mpi4jax's time / the compat module's, in each pair of jobs run one after the other."""
  out = []
  for a, b in zip(jobs[0::2], jobs[1::2]):
    by = {r.key: r for r in a + b}
    base, compat = by.get(f"mpi4jax:{name}"), by.get(f"compat:{name}")
    v, w = (base.us(size) if base else None), (compat.us(size) if compat else None)
    if v and w:
      out.append(v / w)
  return out


def _grid(nbytes: int) -> str:
  return f"{GRID_ROWS} x {nbytes // 4} per rank"


def report(jobs: list[list[Row]], sizes: list[int], grids: list[int], nprocs: int, args) -> int:
  rows = _common.combine_jobs([list(a) + list(b) for a, b in zip(jobs[0::2], jobs[1::2])])
  pairs = len(jobs) // 2
  ops = [r for r in rows if r.key.split(":")[1] in PROGRAMS]
  app = [r for r in rows if r.key.split(":")[1] in APP]
  title = f"one mpi4jax program on mpi4jax and on mpijax.compat.mpi4jax, {nprocs} ranks"
  parts = [
    f"### {title}: median µs per op (max over ranks)",
    "",
    f"Each module in jobs of its own, {pairs} of each, alternating; each cell is the median "
    "over its jobs.",
    "",
    _common.markdown_table(ops, sizes),
    "",
    f"The heat-diffusion solver, µs per step ({STEPS} steps per jit call; the column is the "
    "halo, one row of the grid, sent each way per step):",
    "",
    "| method | " + " | ".join(f"{_grid(g)} ({_common.fmt_size(g)})" for g in grids) + " |",
    "|---|" + "---:|" * len(grids),
  ] + [f"| {r.label} | " + " | ".join(_common._fmt_us(r.us(g)) for g in grids) + " |" for r in app]
  lines = [
    "| program | " + " | ".join(_common.fmt_size(s) for s in sizes) + " |",
    "|---|" + "---:|" * len(sizes),
  ]
  for name, label in PROGRAMS.items():
    cells = []
    for s in sizes:
      v = speedups(jobs, name, s)
      cells.append(f"{statistics.median(v):.2f}×" if v else "–")
    lines.append(f"| {label} | " + " | ".join(cells) + " |")
  cells = []
  for g in grids:
    v = speedups(jobs, "halo", g)
    cells.append(f"{statistics.median(v):.2f}×" if v else "–")
  parts += [
    "",
    "Speed-up, mpi4jax's time / the compat module's (the median over the pairs of jobs; "
    "above 1: the compat module is faster):",
    "",
  ] + lines
  parts += [
    "",
    "| solver | " + " | ".join(_grid(g) for g in grids) + " |",
    "|---|" + "---:|" * len(grids),
    "| halo exchange + stencil | " + " | ".join(cells) + " |",
  ]
  # What the solver's communication leaves to gain: its step against the stencil alone.
  share = []
  for g in grids:
    by = {r.key: r for r in app}
    h, c = by["mpi4jax:halo"].us(g), by["mpi4jax:stencil"].us(g)
    h2 = by["compat:halo"].us(g)
    if h and c and h2:
      share.append(
        f"- {_grid(g)}: a step takes {h:.1f} µs on mpi4jax and {h2:.1f} µs on the compat "
        f"module; the stencil alone {c:.1f} µs, so at most {h / c:.2f}× is there to gain "
        f"(communication {100 * (h - c) / h:.0f} % of mpi4jax's step)."
      )
  if share:
    parts += ["", "The solver's communication share:", ""] + share
  # One line per way, at the smallest message (the headline's figures).
  s0, g0 = sizes[0], grids[0]
  summary = []
  for name, label in (
    ("allreduce", f"{_common.fmt_size(s0)} allreduce, 1 per jit call"),
    ("sendrecv", f"{_common.fmt_size(s0)} sendrecv, 1 per jit call"),
    ("sendrecv_loop", f"{_common.fmt_size(s0)} sendrecv in a jitted fori_loop"),
    ("halo", f"heat diffusion, {_grid(g0)}"),
  ):
    at = g0 if name == "halo" else s0
    v = speedups(jobs, name, at)
    by = {r.key: r for r in rows}
    a, b = by[f"mpi4jax:{name}"].us(at), by[f"compat:{name}"].us(at)
    if v and a and b:
      summary.append(
        f"- {label}: {a:.1f} µs on mpi4jax, {b:.1f} µs on the compat module: "
        f"{statistics.median(v):.2f}× (pairs: {', '.join(f'{x:.2f}' for x in v)})"
      )
  if summary:
    parts += ["", "Summary (the same program, three ways):", ""] + summary
  notes = _common.skip_notes(rows)
  if notes:
    parts += ["", "Not measured:", ""] + sorted(set(notes))
  parts += ["", "Every program's result was checked before it was timed.", "", _common.load_note()]
  text = "\n".join(parts)
  print("\n" + text, flush=True)
  _common.write_report(
    args.out,
    f"mpi4jax_compat_np{nprocs}",
    text,
    {
      "benchmark": "mpi4jax_compat",
      "nprocs": nprocs,
      "sizes": sizes,
      "grids": grids,
      "loop": LOOP,
      "steps": STEPS,
      "grid_rows": GRID_ROWS,
      "meta": _common.environment_info(),
      "jobs": [[r.to_json() for r in job] for job in jobs],
      "rows": [r.to_json() for r in rows],
    },
    ops,
    sizes,
    title,
  )
  return _common.exit_status(rows)


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("--sizes", default=None, help="sizes per rank, e.g. 4,4KiB,256KiB,4MiB")
  p.add_argument(
    "--grids",
    default=None,
    help=f"the solver's halo (grid columns x 4 bytes; {GRID_ROWS} rows per rank), e.g. 4KiB,16KiB",
  )
  p.add_argument("--quick", action="store_true", help="4 B to 256 KiB, one grid, 5 trials, 1 pair")
  p.add_argument("--repeats", type=int, default=None, help="pairs of jobs (default 3; --quick 1)")
  p.add_argument("--trials", type=int, default=None)
  p.add_argument("--trial-seconds", type=float, default=0.005)
  p.add_argument("--np", type=int, default=2, help="ranks of each job")
  p.add_argument("--phase-timeout", type=float, default=900, help="seconds per job")
  p.add_argument("--out", default=_common.default_out_dir(), help="output directory")
  p.add_argument("--phase", default=None, help=argparse.SUPPRESS)
  p.add_argument("--phase-out", default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.repeats is None:
    args.repeats = 1 if args.quick else 3
  if args.repeats < 1:
    p.error(f"--repeats wants at least 1, got {args.repeats}")
  return args


def _phase_args(args, sizes, grids) -> list[str]:
  out = [
    "--sizes",
    ",".join(map(str, sizes)),
    "--grids",
    ",".join(map(str, grids)),
    "--trial-seconds",
    str(args.trial_seconds),
  ]
  if args.trials:
    out += ["--trials", str(args.trials)]
  if args.quick:
    out += ["--quick"]
  return out


def main(argv=None) -> int:
  args = parse_args(argv)
  sizes = (
    _common.parse_sizes(args.sizes)
    if args.sizes
    else [4, 4 << 10, 256 << 10]
    if args.quick
    else [4, 4 << 10, 256 << 10, 4 << 20]
  )
  grids = (
    _common.parse_sizes(args.grids)
    if args.grids
    else [4 << 10]
    if args.quick
    else [4 << 10, 16 << 10]
  )
  if args.phase is not None:  # one job of the run
    if args.phase not in IMPLS:
      raise SystemExit(f"unknown --phase {args.phase!r}")
    return _common.finish_phase(args.phase_out, measure(args.phase, args, sizes, grids))
  if _common.under_mpi_launcher():
    raise SystemExit(
      "run benchmarks/mpi4jax_compat.py from a plain shell (--np N): each module needs jobs "
      "of its own"
    )
  jobs = []
  for _ in range(args.repeats):
    for impl in IMPLS:
      res = _common.run_phase(
        SCRIPT, args.np, impl, _phase_args(args, sizes, grids), timeout=args.phase_timeout
      )
      if isinstance(res, str):
        res = (
          [
            Row(f"{impl}:{n}", f"{lab}, {IMPLS[impl]}", impl, {s: res for s in sizes})
            for n, lab in PROGRAMS.items()
          ]
          + [
            Row(f"{impl}:{n}", f"{lab}, {IMPLS[impl]}", impl, {g: res for g in grids})
            for n, lab in APP.items()
          ],
          {},
        )
      jobs.append(res[0])
  return report(jobs, sizes, grids, args.np, args)


if __name__ == "__main__":
  sys.exit(main())
