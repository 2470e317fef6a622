"""What the collective timeline costs per call: a 4 B all-reduce with it off and on.

Both rows run in the same job, their trials interleaved (``_common``); each
step sets the timeline's switch first (one call into the extension in both
rows), so the difference is what recording adds: two clock reads and one
event written into the ring. Results are checked: a wrong sum exits 1.

  timeout 600 mpijax-run -n 2 python benchmarks/timeline_overhead.py
  python benchmarks/timeline_overhead.py --np 2        # from a plain shell
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
from _common import HarnessComm  # noqa: E402
from _common import Row  # noqa: E402
from _common import WrongResult  # noqa: E402

SCRIPT = os.path.abspath(__file__)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--sizes", default="4", help="comma-separated sizes (default 4 B)")
  p.add_argument("--trials", type=int, default=31)
  p.add_argument("--trial-seconds", type=float, default=0.02)
  p.add_argument("--np", type=int, default=2, help="ranks, when started from a plain shell")
  p.add_argument("--out", default=_common.default_out_dir(), help="output directory")
  p.add_argument("--timeout", type=float, default=600, help="seconds for the job")
  return p.parse_args(argv)


def measure(args) -> list[Row]:
  import jax
  import jax.numpy as jnp

  import mpijax
  from mpijax import ops
  from mpijax._src import ffi

  rt = mpijax.init()
  hc = HarnessComm()
  lib = ffi.load()
  f = jax.jit(lambda x: ops.allreduce(x, "sum"))
  rows = [Row("off", "timeline off", "main"), Row("on", "timeline on", "main")]
  for nbytes in _common.parse_sizes(args.sizes):
    x = jnp.full((nbytes // 4,), float(rt.rank + 1), jnp.float32)
    want = rt.size * (rt.size + 1) / 2

    def off():
      lib.timeline_stop()
      return f(x).block_until_ready()

    def on():
      lib.timeline_start(1 << 12)
      return f(x).block_until_ready()

    errors = []
    for row, step in zip(rows, (off, on)):
      try:
        _common.check_close(step(), want, f"{row.label} @ {_common.fmt_size(nbytes)}", rtol=0)
      except WrongResult as e:
        errors.append((row, str(e)))
    for row, e in errors:
      row.cells[nbytes] = _common.WRONG + e
    bad = hc.comm.allgather(bool(errors))
    if any(bad):
      for row in rows:
        row.cells.setdefault(nbytes, _common.WRONG + "another rank's result was wrong")
      continue
    timings = _common.time_interleaved({"off": (off, 1), "on": (on, 1)}, hc, trials=args.trials,
                                       trial_seconds=args.trial_seconds)
    lib.timeline_stop()
    lib.timeline_drain()
    for row in rows:
      row.cells[nbytes] = timings[row.key]
  return rows


def report(rows: list[Row], sizes: list[int], nprocs: int, args) -> None:
  table = _common.markdown_table(rows, sizes, title=f"µs per call, {nprocs} ranks")
  deltas = []
  for s in sizes:
    a, b = rows[0].us(s), rows[1].us(s)
    if a is not None and b is not None:
      deltas.append(f"{_common.fmt_size(s)}: on - off = {b - a:+.2f} µs per call "
                    f"(fastest trials: {rows[1].us(s, 'best') - rows[0].us(s, 'best'):+.2f} µs)")
  text = table + "\n\n" + "\n".join(deltas)
  print(text, flush=True)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, f"timeline_overhead_{nprocs}ranks.json"), "w") as fh:
    json.dump({"rows": [r.to_json() for r in rows], "meta": _common.environment_info()}, fh,
              indent=1)


def main(argv=None) -> int:
  args = parse_args(argv)
  sizes = _common.parse_sizes(args.sizes)
  if not _common.under_mpi_launcher():
    import subprocess
    cmd = _common.mpirun_command(args.np, [sys.executable, SCRIPT] + (argv or sys.argv[1:]),
                                 timeout=args.timeout)
    return subprocess.run(cmd, env=_common.launcher_free_env(), timeout=args.timeout + 60).returncode
  rows = measure(args)
  hc = HarnessComm()
  if hc.rank == 0:
    report(rows, sizes, hc.size, args)
  return hc.bcast(_common.exit_status(rows) if hc.rank == 0 else None)


if __name__ == "__main__":
  sys.exit(main())
