"""Where a 2 x 2 all-reduce's time goes: in mpijax's code, or in XLA's program around it.

XLA's all-reduce (a jitted ``x.sum(0)`` over rows on every device, through
mpijax's bridge) and mpijax's ``psum`` over the same devices (its custom
call) run the same node-local all-reduce. This job runs both, 200 blocking
calls of each in turn, six times per size, with ``MPIJAX_TIMELINE`` on: the
timeline records how long each call spends in mpijax's code, and the calls'
period (start to start on a device's thread) is their whole cost. What one
row's period exceeds the other's by, beyond their time in mpijax, is spent
in XLA's program around the collective. Results are checked first: a wrong
sum exits 1.

  python benchmarks/xla_call_split.py [--sizes 4,256KiB,1MiB]   # from a plain shell
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

SCRIPT = os.path.abspath(__file__)
# Timeline event names: XLA's all-reduce, mpijax's psum over every device.
ROWS = ("XLA all-reduce", "device_allreduce")
ROUNDS, CALLS = 6, 200


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--sizes", default="4,256KiB,1MiB", help="bytes per device, comma-separated")
  p.add_argument("--out", default=_common.default_out_dir(), help="output directory")
  p.add_argument("--timeout", type=float, default=600, help="seconds for the job")
  p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
  return p.parse_args(argv)


def job(args) -> int:
  import jax
  import numpy as np
  from jax.sharding import Mesh
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import mpijax
  import mpijax.lax as mlax

  mpijax.init()
  n, r = jax.device_count(), mpijax.process_index()
  mesh = jax.make_mesh((n,), ("x",))
  rows = NamedSharding(mesh, P("x", None))
  xla = jax.jit(lambda x: x.sum(0), out_shardings=NamedSharding(mesh, P()))
  own = jax.jit(
    mpijax.shard_map(
      lambda v: mlax.psum(v.sum(0), "x"),
      mesh=mpijax.make_mesh((n,), ("x",)),
      in_specs=P("x"),
      out_specs=P(),
    )
  )
  local = NamedSharding(Mesh(np.array(jax.local_devices()), ("l",)), P("l"))
  want = n * (n + 1) / 2
  for nbytes in _common.parse_sizes(args.sizes):
    host = np.repeat(np.arange(1, n + 1, dtype=np.float32)[:, None], max(nbytes // 4, 1), 1)
    mine = host[r * len(jax.local_devices()) :][: len(jax.local_devices())]
    x = jax.make_array_from_single_device_arrays(
      host.shape,
      rows,
      [jax.device_put(mine[i : i + 1], d) for i, d in enumerate(jax.local_devices())],
    )
    y = jax.device_put(mine, local)
    for what, got in (("XLA's all-reduce", xla(x).addressable_shards[0].data), ("psum", own(y))):
      _common.check_close(got, want, f"{what} @ {_common.fmt_size(nbytes)}", rtol=0)
    for _ in range(ROUNDS):
      for f, a in ((xla, x), (own, y)):
        for _ in range(CALLS):
          f(a).block_until_ready()
  return 0


def split(timeline: str) -> dict[int, dict[str, tuple[float, float, int]]]:
  """Per size and row: (median µs in mpijax, median call period µs, calls)."""
  with open(timeline) as fh:
    data = json.load(fh)
  events = data["traceEvents"] if isinstance(data, dict) else data
  calls = collections.defaultdict(list)
  for e in events:
    # XLA's calls named by a program: not init()'s unnamed warm-up of the communicators.
    site = e.get("args", {}).get("call_site", "")
    if (
      e.get("ph") == "X" and e.get("name") in ROWS and (e["name"] != ROWS[0] or " in jit(" in site)
    ):
      calls[(e["args"]["bytes"], e["name"])].append(e)
  out: dict[int, dict[str, tuple[float, float, int]]] = collections.defaultdict(dict)
  for (nbytes, name), evs in calls.items():
    starts = collections.defaultdict(list)
    for e in evs:
      starts[(e["pid"], e["tid"])].append(e["ts"])
    gaps = []
    for ts in starts.values():
      ts.sort()
      # The few gaps between rounds (the other row ran) barely move the median.
      gaps += [b - a for a, b in zip(ts, ts[1:])]
    out[nbytes][name] = (
      statistics.median(e["dur"] for e in evs),
      statistics.median(gaps),
      len(evs),
    )
  return out


def report(result, args) -> int:
  lines = [
    "| size | in mpijax: XLA's all-reduce | in mpijax: psum | period: XLA's all-reduce | "
    "period: psum | XLA's extra outside mpijax |",
    "|---|---:|---:|---:|---:|---:|",
  ]
  for nbytes in sorted(result):
    rows = result[nbytes]
    if set(rows) != set(ROWS):
      lines.append(f"| {_common.fmt_size(nbytes)} | missing: {sorted(set(ROWS) - set(rows))} |")
      continue
    (ix, px, _), (io, po, _) = rows["XLA all-reduce"], rows["device_allreduce"]
    lines.append(
      f"| {_common.fmt_size(nbytes)} | {ix:.2f} | {io:.2f} | {px:.1f} | {po:.1f} | "
      f"{(px - po) - (ix - io):+.1f} |"
    )
  calls = sorted({c for rows in result.values() for _, _, c in rows.values()})
  text = (
    "### 2 ranks x 2 devices: median µs per call, from the collective timeline\n\n"
    + "\n".join(lines)
    + f"\n\nCalls per row and size (every device's): {', '.join(map(str, calls))}. "
    + _common.load_note()
  )
  print(text, flush=True)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "xla_call_split.md"), "w") as fh:
    fh.write(text + "\n")
  with open(os.path.join(args.out, "xla_call_split.json"), "w") as fh:
    json.dump({str(k): v for k, v in result.items()}, fh, indent=1)
  return 0 if all(set(rows) == set(ROWS) for rows in result.values()) and result else 1


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.job:
    return job(args)
  os.makedirs(args.out, exist_ok=True)
  timeline = os.path.join(os.path.abspath(args.out), "xla_call_split_timeline.json")
  if os.path.exists(timeline):
    os.remove(timeline)
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
  ]
  env = _common.launcher_free_env({"MPIJAX_TIMELINE": timeline})
  rc = subprocess.run(cmd, env=env, timeout=args.timeout + 60).returncode
  if rc != 0 or not os.path.exists(timeline):
    print(f"xla_call_split: the job failed (exit {rc})", file=sys.stderr)
    return rc or 1
  return report(split(timeline), args)


if __name__ == "__main__":
  sys.exit(main())
