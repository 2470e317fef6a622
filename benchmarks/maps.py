"""A psum over every device of every rank: JAX's own maps against mpijax's.

After ``mpijax.init()`` JAX spans the ranks, so ``jax.pmap`` and
``jax.shard_map`` over ``jax.devices()`` already reduce across them (XLA's
collectives, over MPI through mpijax's bridge at any number of CPU devices
per rank); ``mpijax.pmap`` and ``mpijax.shard_map`` run
mpijax's own (the local XLA step plus MPI). Rows, per size per device
(median µs per blocking call, max over ranks; the rows of a layout are timed
interleaved in one job):

* ``jax.pmap`` + ``jax.lax.psum`` over this rank's rows (L, n);
* ``jax.jit(jax.shard_map)`` + ``jax.lax.psum`` over a global array of every
  device's row;
* ``mpijax.pmap`` + ``jax.lax.psum`` (the same program, one word changed);
* ``jax.jit(mpijax.shard_map)`` + ``mpijax.lax.psum``.

Each row's result is checked against NumPy first. Layouts: 2 ranks x 1 device
and 2 ranks x 2 devices, each its own job::

  python benchmarks/maps.py            # both layouts
  python benchmarks/maps.py --quick    # 4 B, 4 KiB, 256 KiB; 5 trials

Writes ``maps.json``, ``.md`` and ``.png`` to ``--out`` (default
``benchmarks/results/``) and prints the table.
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
DEFAULT_SIZES = (4, 4 << 10, 256 << 10, 4 << 20)
QUICK_SIZES = (4, 4 << 10, 256 << 10)
METHODS = {
  "jax_pmap": "jax.pmap + jax.lax.psum",
  "jax_shard_map": "jax.jit(jax.shard_map) + jax.lax.psum",
  "mpijax_pmap": "mpijax.pmap + jax.lax.psum",
  "mpijax_shard_map": "jax.jit(mpijax.shard_map) + mpijax.lax.psum",
}
# phase -> (ranks, CPU devices per rank)
PHASES = {"1dev": (2, 1), "2dev": (2, 2)}


def _key(method: str, phase: str) -> str:
  return f"{method}/{phase}"


def _label(method: str, phase: str) -> str:
  ranks, devices = PHASES[phase]
  return f"{METHODS[method]} [{ranks} ranks x {devices} device{'s' if devices > 1 else ''}]"


def _local_rows(nbytes: int):
  """This rank's rows, one per local device: global device g's row holds g + 1."""
  import jax
  import numpy as np

  L = jax.local_device_count()
  first = jax.process_index() * L
  return np.stack([np.full(nbytes // 4, first + l + 1, np.float32) for l in range(L)])


def _factories(phase: str) -> dict[str, Any]:
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import mpijax
  import mpijax.lax as mlax

  n = jax.device_count()
  want = n * (n + 1) / 2

  def check(out, what):
    _common.check_close(np.asarray(out), want, f"{what} [{phase}]", rtol=1e-6)

  def local(nbytes):
    """This rank's rows, row l on local device l (as both pmaps lay out their inputs)."""
    mesh = jax.sharding.Mesh(np.array(jax.local_devices()), ("l",))
    return jax.device_put(_local_rows(nbytes), NamedSharding(mesh, P("l")))

  def jax_pmap():
    f = jax.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i")

    def build(nbytes):
      x = jax.pmap(lambda v: v)(_local_rows(nbytes))  # already in pmap's layout
      check(f(x), "jax.pmap")
      return (lambda: f(x).block_until_ready()), 1

    return build

  def jax_shard_map():
    mesh = jax.make_mesh((n,), ("i",))
    f = jax.jit(
      jax.shard_map(lambda x: jax.lax.psum(x, "i"), mesh=mesh, in_specs=P("i"), out_specs=P())
    )

    def build(nbytes):
      rows = _local_rows(nbytes)
      shards = [jax.device_put(rows[k : k + 1], d) for k, d in enumerate(jax.local_devices())]
      x = jax.make_array_from_single_device_arrays(
        (n, nbytes // 4), NamedSharding(mesh, P("i")), shards
      )
      check(f(x).addressable_shards[0].data, "jax.shard_map")
      return (lambda: f(x).block_until_ready()), 1

    return build

  def mpijax_pmap():
    f = mpijax.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i")

    def build(nbytes):
      x = local(nbytes)
      check(f(x), "mpijax.pmap")
      return (lambda: f(x).block_until_ready()), 1

    return build

  def mpijax_shard_map():
    mesh = mpijax.make_mesh((n,), ("i",))
    f = jax.jit(
      mpijax.shard_map(lambda x: mlax.psum(x, "i"), mesh=mesh, in_specs=P("i"), out_specs=P())
    )

    def build(nbytes):
      x = local(nbytes)
      check(f(x), "mpijax.shard_map")
      return (lambda: f(x).block_until_ready()), 1

    return build

  return {
    "jax_pmap": jax_pmap,
    "jax_shard_map": jax_shard_map,
    "mpijax_pmap": mpijax_pmap,
    "mpijax_shard_map": mpijax_shard_map,
  }


def phase_rows(phase: str, args, sizes: list[int]) -> list[Row]:
  import mpijax  # before jax: names mpijax's bridge for XLA (see docs/jax-integration.md)

  rt = mpijax.init()
  hc = HarnessComm()
  ar._log(hc, f"{phase}: XLA's cross-process collectives over {rt.xla_collectives}")
  factories = _factories(phase)
  specs = [(_key(m, phase), _label(m, phase), phase, factories[m]) for m in METHODS]
  return ar._measure(hc, specs, sizes, args)


def report(rows: list[Row], sizes: list[int], args, meta: dict[str, Any]) -> int:
  order = [_key(m, p) for p in PHASES for m in METHODS]
  rows = sorted(rows, key=lambda r: order.index(r.key) if r.key in order else len(order))
  title = "psum over every device of 2 ranks: median µs per call (max over ranks)"
  parts = [
    f"### {title}",
    "",
    _common.markdown_table(rows, sizes, title="map + psum (size per device)"),
  ]
  for phase in PHASES:
    ref = next((r for r in rows if r.key == _key("mpijax_pmap", phase)), None)
    mine = [r for r in rows if r.phase == phase]
    if ref is not None:
      parts += [
        "",
        f"Ratio to mpijax.pmap, {_label('mpijax_pmap', phase).split('[')[1][:-1]}:",
        "",
        _common.markdown_table(mine, sizes, ratio_to=ref),
      ]
  parts += [
    "",
    "Fastest trial instead of the median (µs, max over ranks):",
    "",
    _common.markdown_table(rows, sizes, stat="best"),
  ]
  notes = _common.skip_notes(rows)
  if notes:
    parts += ["", "Not measured:", ""] + notes
  parts += ["", _common.load_note()]
  text = "\n".join(parts)
  print("\n" + text, flush=True)
  _common.write_report(
    args.out,
    "maps",
    text,
    {"benchmark": "maps", "sizes": sizes, "meta": meta, "rows": [r.to_json() for r in rows]},
    rows,
    sizes,
    title,
  )
  return _common.exit_status(rows)


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument(
    "--sizes", default=None, help="comma-separated bytes per device (default 4,4KiB,256KiB,4MiB)"
  )
  p.add_argument(
    "--phases",
    default=",".join(PHASES),
    help=f"layouts to run, comma-separated (default {','.join(PHASES)})",
  )
  p.add_argument(
    "--trials",
    type=int,
    default=None,
    help="trials per cell (default 30 below 1 MiB, 10 from 1 MiB; 5 with --quick)",
  )
  p.add_argument(
    "--trial-seconds", type=float, default=0.005, help="target length of one trial (default 0.005)"
  )
  p.add_argument("--quick", action="store_true", help="smoke test: 4 B, 4 KiB, 256 KiB; 5 trials")
  p.add_argument("--out", default=_common.default_out_dir(), help="output directory")
  p.add_argument("--phase-timeout", type=float, default=900, help="seconds per sub-job")
  p.add_argument("--verbose", action="store_true")
  p.add_argument("--phase", default=None, help=argparse.SUPPRESS)
  p.add_argument("--phase-out", default=None, help=argparse.SUPPRESS)
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  sizes = (
    _common.parse_sizes(args.sizes)
    if args.sizes
    else list(QUICK_SIZES if args.quick else DEFAULT_SIZES)
  )
  if args.phase is not None:  # one sub-job
    if args.phase not in PHASES:
      raise SystemExit(f"unknown --phase {args.phase!r}; known: {','.join(PHASES)}")
    return _common.finish_phase(
      args.phase_out, phase_rows(args.phase, args, sizes), _common.environment_info()
    )
  rows: list[Row] = []
  meta: dict[str, Any] = {}
  phase_args = ar._phase_args(args, sizes)
  for phase in [p.strip() for p in args.phases.split(",") if p.strip()]:
    if phase not in PHASES:
      raise SystemExit(f"unknown phase {phase!r}; known: {','.join(PHASES)}")
    ranks, devices = PHASES[phase]
    env = {"MPIJAX_DEVICES_PER_PROCESS": str(devices)}
    res = _common.run_phase(SCRIPT, ranks, phase, phase_args, env=env, timeout=args.phase_timeout)
    if isinstance(res, str):
      rows += [
        Row(_key(m, phase), _label(m, phase), phase, {s: res for s in sizes}) for m in METHODS
      ]
    else:
      rows += res[0]
      meta.setdefault("phases", {})[phase] = {"ranks": ranks, "env": env, **res[1]}
  return report(rows, sizes, args, meta)


if __name__ == "__main__":
  sys.exit(main())
