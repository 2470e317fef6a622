"""A jitted all-reduce at 2 ranks x 2 devices with XLA's pools spinning and kept from spinning.

One ``mpijax-run -n 2 --devices-per-process 2`` job (``MPIJAX_XLA_SPIN=on``:
init() leaves the pools as jaxlib built them) runs a jitted ``x.sum(0)`` over
rows of SIZE bytes on every device (XLA's all-reduce, over MPI through
mpijax's bridge). In each of ``--rounds`` rounds every rank first gives its
pools their spinning back (``mpijax._src.xla.pools.spin()``) and times ``--calls`` single
blocking calls, then turns it off (``pools.quiet()``, what
``MPIJAX_XLA_SPIN=auto`` does on such a node) and times as many: the two
rows share the job and every period of the machine's drift. A figure is the
median µs per call over all of a rank's calls in that state, max over ranks;
the rounds' own medians give the spread. The result is checked first: a
wrong sum, or pools that cannot be switched (a jaxlib off the allow-list),
exit 1.

  python benchmarks/xla_spin.py                 # 4 B and 4 KiB per device
  python benchmarks/xla_spin.py --sizes 4 --rounds 20

Writes ``xla_spin.{md,json}`` to ``--out`` (default ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

SCRIPT = os.path.abspath(__file__)
STATES = ("spinning", "quiet")
LABELS = {
  "spinning": "XLA's pools spinning, as jaxlib builds them (MPIJAX_XLA_SPIN=on)",
  "quiet": "XLA's pools kept from spinning (MPIJAX_XLA_SPIN=auto on this node)",
}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--sizes", default="4,4KiB", help="bytes per device, comma-separated")
  p.add_argument("--rounds", type=int, default=10, help="rounds of both states")
  p.add_argument("--calls", type=int, default=100, help="calls timed per state and round")
  p.add_argument("--out", default=_common.default_out_dir(), help="output directory")
  p.add_argument("--timeout", type=float, default=600, help="seconds for the job")
  p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
  return p.parse_args(argv)


def _switch(state: str) -> None:
  from mpijax._src.xla import pools as xla_pools

  report = xla_pools.spin() if state == "spinning" else xla_pools.quiet()
  if report.reason or not report.pools:
    raise SystemExit(f"xla_spin: XLA's pools cannot be switched here: {report.reason}")


def job(args) -> int:
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import mpijax

  mpijax.init()
  hc = _common.HarnessComm()
  n, L = jax.device_count(), jax.local_device_count()
  mesh = jax.make_mesh((n,), ("x",))
  rows = NamedSharding(mesh, P("x", None))
  f = jax.jit(lambda x: x.sum(0), out_shardings=NamedSharding(mesh, P()))
  first = jax.process_index() * L
  result: dict[str, dict] = {}
  for nbytes in _common.parse_sizes(args.sizes):
    m = max(nbytes // 4, 1)
    mine = np.stack([np.full(m, first + i + 1, np.float32) for i in range(L)])
    x = jax.make_array_from_process_local_data(rows, mine, (n, m))
    _common.check_close(
      f(x).addressable_shards[0].data, n * (n + 1) / 2, _common.fmt_size(nbytes), rtol=0
    )
    calls: dict[str, list[float]] = {s: [] for s in STATES}
    rounds: dict[str, list[float]] = {s: [] for s in STATES}
    for _ in range(args.rounds):
      for state in STATES:
        _switch(state)
        for _ in range(10):
          f(x).block_until_ready()
        hc.barrier()
        times = []
        for _ in range(args.calls):
          t0 = time.perf_counter()
          f(x).block_until_ready()
          times.append((time.perf_counter() - t0) * 1e6)
        calls[state] += times
        rounds[state].append(statistics.median(times))
    result[str(nbytes)] = {
      s: {
        "median_us": hc.max(statistics.median(calls[s])),
        "p10_us": hc.max(float(np.percentile(calls[s], 10))),
        "p90_us": hc.max(float(np.percentile(calls[s], 90))),
        "round_medians_us": hc.comm.allgather(rounds[s]),
      }
      for s in STATES
    }
  if hc.rank == 0:
    report(result, args)
  return 0


def report(result: dict, args) -> None:
  lines = [
    "| size | state | median µs | p10 / p90 µs | rounds' medians, min-max µs |",
    "|---|---|---:|---:|---:|",
  ]
  for nbytes, states in result.items():
    for s in STATES:
      r = states[s]
      spread = [v for rank in r["round_medians_us"] for v in rank]
      lines.append(
        f"| {_common.fmt_size(int(nbytes))} | {LABELS[s]} | {r['median_us']:.1f} | "
        f"{r['p10_us']:.1f} / {r['p90_us']:.1f} | {min(spread):.1f}-{max(spread):.1f} |"
      )
    ratio = states["spinning"]["median_us"] / states["quiet"]["median_us"]
    lines.append(f"| {_common.fmt_size(int(nbytes))} | spinning / quiet | {ratio:.1f}x | | |")
  text = (
    "### jit x.sum(0) at 2 ranks x 2 devices: XLA's pools spinning and quiet, same job\n\n"
    + "\n".join(lines)
    + f"\n\n{args.rounds} rounds of {args.calls} calls per state; a figure is the median "
    "of a rank's calls, max over ranks. " + _common.load_note()
  )
  print(text, flush=True)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "xla_spin.md"), "w") as fh:
    fh.write(text + "\n")
  with open(os.path.join(args.out, "xla_spin.json"), "w") as fh:
    json.dump({"result": result, "environment": _common.environment_info()}, fh, indent=1)


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.job:
    return job(args)
  cmd = [
    "timeout",
    "--kill-after=10",
    str(int(args.timeout)),
    sys.executable,
    "-m",
    "mpijax.launch",
    "-n",
    "2",
    "--devices-per-process",
    "2",
    "--",
    sys.executable,
    SCRIPT,
    "--job",
    "--sizes",
    args.sizes,
    "--rounds",
    str(args.rounds),
    "--calls",
    str(args.calls),
    "--out",
    os.path.abspath(args.out),
  ]
  env = _common.launcher_free_env({"MPIJAX_XLA_SPIN": "on"})
  rc = subprocess.run(cmd, env=env, timeout=args.timeout + 60).returncode
  if rc != 0:
    print(f"xla_spin: the job failed (exit {rc})", file=sys.stderr)
  return rc


if __name__ == "__main__":
  sys.exit(main())
