"""The same mpi4jax program on mpi4jax and on mpijax.compat.mpi4jax.

Run it as an MPI job::

  timeout 900 mpijax-run -n 2 python benchmarks/mpi4jax_compat.py

or from a plain shell (it starts ``mpijax-run -n --np`` itself)::

  python benchmarks/mpi4jax_compat.py --np 2 --quick

Each program is written once against mpi4jax's API and run with the module
``m`` being ``mpi4jax`` (when importable; installed as in benchmarks/README.md)
and ``mpijax.compat.mpi4jax`` in the same job, their trials interleaved:

* ``allreduce``: ``jax.jit(lambda x: m.allreduce(x, op=MPI.SUM, comm=comm))``;
* ``allreduce x10``: ten chained in one jitted call (time per all-reduce);
* ``sendrecv ring``: ``m.sendrecv(x, x, source=prev, dest=next, comm=comm)``
  in ``jax.jit``, each rank sending to the next.

Every program's result is checked against the expected values before it is
timed (its inputs vary along the buffer); a wrong one is never timed, shows
as WRONG RESULT in the table, and the run exits with status 1. Writes
``mpi4jax_compat_np{P}.json``, ``.md`` and ``.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
from _common import HarnessComm  # noqa: E402
from _common import Row  # noqa: E402

CHAIN = 10
PROGRAMS = {"allreduce": "allreduce", "allreduce10": f"allreduce x{CHAIN} chained (per op)",
            "sendrecv": "sendrecv ring"}
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
    f = jax.jit(lambda x: m.sendrecv(x, x, source=prv, dest=nxt, comm=comm))
    return f, k + r + 1, k + prv + 1, 1
  return build


def measure(args, sizes: list[int]) -> tuple[list[Row], HarnessComm]:
  """Every row checked at every size, then the right ones timed, interleaved."""
  hc = HarnessComm()
  modules = {impl: _module(impl) for impl in IMPLS}
  rows, builders = [], {}
  for prog, plabel in PROGRAMS.items():
    for impl, ilabel in IMPLS.items():
      row = Row(f"{impl}:{prog}", f"{plabel}, {ilabel}", "main")
      rows.append(row)
      m = modules[impl]
      if isinstance(m, str):
        row.cells = {s: m for s in sizes}
        continue
      builders[row.key] = _program(prog, m, hc.comm.Dup(), hc)
  for s in sizes:
    steps = {}
    for row in rows:
      if row.key not in builders:
        continue
      f, x, want, per = builders[row.key](s)
      wrong = None
      try:
        _common.check_close(f(x), want, f"{row.label} @ {_common.fmt_size(s)}", rtol=1e-6)
      except _common.WrongResult as e:
        wrong = str(e)
      wrong = next((w for w in hc.comm.allgather(wrong) if w), None)  # every rank agrees
      if wrong:
        row.cells[s] = _common.WRONG + wrong
        continue
      steps[row.key] = ((lambda f=f, x=x: f(x).block_until_ready()), per)
    trials = args.trials or (5 if args.quick else _common.default_trials(s))
    for key, t in _common.time_interleaved(steps, hc, trials=trials,
                                           trial_seconds=args.trial_seconds).items():
      row = next(r for r in rows if r.key == key)
      row.cells[s] = t
      if hc.rank == 0:
        print(f"{row.label} @ {_common.fmt_size(s)}: {t.median_us:.2f} us", flush=True)
  return rows, hc


def report(rows: list[Row], sizes: list[int], nprocs: int, args) -> None:
  title = f"one mpi4jax program on mpi4jax and on mpijax.compat.mpi4jax, {nprocs} ranks"
  parts = [f"### {title}: median µs per op (max over ranks)", "",
           _common.markdown_table(rows, sizes)]
  by = {r.key: r for r in rows}
  lines = ["| program | " + " | ".join(_common.fmt_size(s) for s in sizes) + " |",
           "|---|" + "---:|" * len(sizes)]
  for prog, plabel in PROGRAMS.items():
    base, compat = by[f"mpi4jax:{prog}"], by[f"compat:{prog}"]
    ratios = [compat.us(s) / base.us(s) if base.us(s) and compat.us(s) else None for s in sizes]
    cells = ["–" if v is None else f"{v:.3f}×" if v < 0.1 else f"{v:.2f}×" for v in ratios]
    lines.append(f"| {plabel} | " + " | ".join(cells) + " |")
  parts += ["", "Time ratio, mpijax.compat.mpi4jax / mpi4jax (below 1: the compat module is "
            "faster):", ""] + lines
  notes = _common.skip_notes(rows)
  if notes:
    parts += ["", "Not measured:", ""] + sorted(set(notes))
  parts += ["", "Every program's result was checked before it was timed.", "",
            _common.load_note()]
  text = "\n".join(parts)
  print("\n" + text, flush=True)
  _common.write_report(args.out, f"mpi4jax_compat_np{nprocs}", text,
                       {"benchmark": "mpi4jax_compat", "nprocs": nprocs, "sizes": sizes,
                        "meta": _common.environment_info(), "rows": [r.to_json() for r in rows]}, rows, sizes, title)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--sizes", default=None, help="sizes per rank, e.g. 4,4KiB,256KiB,4MiB")
  p.add_argument("--quick", action="store_true", help="4 B, 4 KiB, 256 KiB; 5 trials")
  p.add_argument("--trials", type=int, default=None)
  p.add_argument("--trial-seconds", type=float, default=0.005)
  p.add_argument("--np", type=int, default=2, help="ranks when started from a plain shell")
  p.add_argument("--timeout", type=float, default=900, help="seconds, from a plain shell")
  p.add_argument("--out", default=_common.default_out_dir(), help="output directory")
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  if not _common.under_mpi_launcher():
    cmd = [sys.executable, "-m", "mpijax.launch", "-n", str(args.np), "--timeout",
           str(int(args.timeout)), "--", sys.executable, os.path.abspath(__file__)]
    return subprocess.call(cmd + (argv if argv is not None else sys.argv[1:]))
  sizes = (_common.parse_sizes(args.sizes) if args.sizes
           else [4, 4 << 10, 256 << 10] if args.quick else [4, 4 << 10, 256 << 10, 4 << 20])
  rows, hc = measure(args, sizes)
  if hc.rank == 0:
    report(rows, sizes, hc.size, args)
  hc.barrier()
  return _common.exit_status(rows)


if __name__ == "__main__":
  sys.exit(main())
