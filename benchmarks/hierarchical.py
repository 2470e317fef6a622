"""psum over every device of 2 ranks x 2 CPU devices, against its parts and JAX's psum.

Each of the four devices holds one float32 buffer of SIZE bytes; in ONE
``mpirun`` job of 2 ranks x 2 devices, each row (blocking, and 8 calls
dispatched back to back) is timed with its trials interleaved:

* mpijax: ``jax.jit(mpijax.shard_map(lambda x: mpijax.lax.psum(x, 'i')))``
  over a 1-D mesh of the 4 devices, the input already on them (the
  node-local all-reduce among every (rank, device));
* the same with ``MPIJAX_DEVICE_ALLREDUCE=0`` (a local XLA collective around
  an MPI all-reduce per device), for A/B;
* XLA's psum over this rank's 2 devices alone (``jax.shard_map``);
* mpijax's all-reduce of SIZE bytes over the 2 ranks from one device
  (``mpijax.ops.allreduce`` in ``jax.jit``);
* JAX's own psum over the same 4 devices (``jax.distributed``, which
  ``mpijax.init()`` starts; XLA's collectives over MPI through mpijax's bridge);
* ``x + 1`` over this rank's 2 devices: the floor of any 2-device program.

Targets, per size and mode, printed PASS/FAIL: mpijax <= 1.3 x (XLA's local
psum + mpijax's 2-rank all-reduce), and mpijax <= JAX's psum.

Run from a plain shell (it starts the bounded ``mpirun`` jobs), or as the
2 x 2 job itself::

  python benchmarks/hierarchical.py                 # 4 KiB, 1 MiB, 16 MiB
  python benchmarks/hierarchical.py --quick         # smoke test
  timeout 900 mpijax-run -n 2 --devices-per-process 2 python benchmarks/hierarchical.py
  python benchmarks/hierarchical.py --phases hier,flat,gloo4   # + 4 ranks x 1 device

Writes ``hierarchical.json``, ``.md`` and ``.png`` to ``--out`` (default
``benchmarks/results/``). Every row's result is checked against NumPy before
it is timed; the script exits 1 if any result is wrong.
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
DEFAULT_SIZES = (4 << 10, 1 << 20, 16 << 20)
QUICK_SIZES = (4 << 10, 256 << 10)
TWO_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
BACK_TO_BACK = 8  # calls dispatched before blocking on the last
TARGET = 1.3

# method -> label (2 ranks x 2 devices, one job)
METHODS = {
    "mpijax": "mpijax psum over the 4 devices",
    "mpijax_off": "mpijax psum, MPIJAX_DEVICE_ALLREDUCE=0 (local XLA + MPI)",
    "local": "XLA psum over this rank's 2 devices",
    "mpi": "mpijax allreduce over 2 ranks, 1 device",
    "jax": "JAX psum over the 4 devices (jax.distributed)",
    "floor": "x + 1 over this rank's 2 devices (dispatch floor)",
}
MODES = {"blk": "blocking", "b2b": f"{BACK_TO_BACK} back to back"}
# Rows of the optional 4 ranks x 1 device phases, for reference.
EXTRA = {
    "flat": ("mpijax allreduce in jit, 4 ranks x 1 device", "flat"),
    "raw4": ("mpi4py Allreduce out of place, 4 ranks", "flat"),
    "gloo4": ("JAX psum over gloo, 4 processes x 1 device", "gloo4"),
}
PHASES = {"hier": (2, TWO_DEVICES), "flat": (4, {}), "gloo4": (4, {"MPIJAX_XLA_COLLECTIVES": "gloo"})}


def _key(method: str, mode: str) -> str:
  return f"{method}/{mode}"


def _hier_specs(hc: HarnessComm):
  """(key, label, phase, factory) of every row of the 2 x 2 job."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import mpijax
  from mpijax._src import config

  rt = mpijax.init()
  L, W, r = len(rt.local_devices), rt.size, rt.rank
  if L != 2 or W != 2:
    raise SystemExit(f"the hier phase needs 2 ranks x 2 devices, got {W} x {L}")
  G = W * L
  gmesh = mpijax.make_mesh((G,), ("i",))
  lmesh = Mesh(np.array(rt.local_devices), ("d",))
  jmesh = Mesh(np.array(jax.devices()), ("g",)) if len(jax.devices()) == G else None

  def global_psum():
    return jax.jit(mpijax.shard_map(lambda x: mpijax.lax.psum(x, "i"), mesh=gmesh,
                                    in_specs=P("i"), out_specs=P("i")))

  fns = {
      "mpijax": global_psum(),
      "mpijax_off": global_psum(),
      "local": jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "d"), mesh=lmesh,
                                     in_specs=P("d"), out_specs=P("d"))),
      "mpi": jax.jit(lambda x: mpijax.ops.allreduce(x)),
      "floor": jax.jit(jax.shard_map(lambda x: x + 1, mesh=lmesh, in_specs=P("d"),
                                     out_specs=P("d"))),
  }
  if jmesh is not None:
    fns["jax"] = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "g"), mesh=jmesh,
                                       in_specs=P("g"), out_specs=P("g")))

  def factory(method: str, mode: str):
    def make():
      if method not in fns:
        raise ar.Skip(f"JAX sees {len(jax.devices())} devices, not {G}: jax.distributed is off")
      f = fns[method]

      def build(nbytes: int):
        n = nbytes // 4
        rows = [ar.pattern(n, r * L + d) for d in range(L)]  # global device g: pattern(g)
        if method == "mpi":
          x = jax.device_put(jnp.asarray(ar.pattern(n, r)), rt.local_devices[0])
          want = [ar.pattern_sum(n, W)]
        elif method == "local":
          x = jax.device_put(np.concatenate(rows), NamedSharding(lmesh, P("d")))
          want = [sum(rows)] * L
        elif method == "floor":
          x = jax.device_put(np.concatenate(rows), NamedSharding(lmesh, P("d")))
          want = [v + 1 for v in rows]
        elif method == "jax":
          shards = [jax.device_put(v, d) for v, d in zip(rows, jax.local_devices())]
          x = jax.make_array_from_single_device_arrays((G * n,), NamedSharding(jmesh, P("g")),
                                                       shards)
          want = None
        else:
          x = jax.device_put(np.concatenate(rows), NamedSharding(lmesh, P("d")))
          want = [ar.pattern_sum(n, G)] * L
        if method == "mpijax_off":  # read when the program is traced: now
          config.update("device_allreduce", False)
        try:
          y = f(x)
        finally:
          config.reset("device_allreduce")
        if method == "jax":
          for shard in y.addressable_shards:
            ar._expect(shard.data, ar.pattern_sum(n, G), METHODS[method])
        else:
          got = np.asarray(y).reshape(len(want), n)
          for g, w in zip(got, want):
            ar._expect(g, w, METHODS[method])
        if mode == "blk":
          return (lambda: f(x).block_until_ready()), 1

        def back_to_back():
          outs = [f(x) for _ in range(BACK_TO_BACK)]
          jax.block_until_ready(outs)
        return back_to_back, BACK_TO_BACK
      return build
    return make

  return [(_key(m, mode), f"{METHODS[m]} [{MODES[mode]}]", "hier", factory(m, mode))
          for mode in MODES for m in METHODS]


def phase_rows(phase: str, args, sizes: list[int]) -> list[Row]:
  if phase == "gloo4":
    hc, err = ar.start_jax_distributed()

    def gloo():
      if err:
        raise ar.Skip(err)
      return ar.gloo_factory(hc)
    return ar._measure(hc, [("gloo4", EXTRA["gloo4"][0], phase, gloo)], sizes, args)
  init_error = ar._init_mpijax()
  hc = HarnessComm()
  if init_error:
    raise SystemExit(f"mpijax.init() failed: {init_error}")
  if phase == "hier":
    return ar._measure(hc, _hier_specs(hc), sizes, args)
  if phase == "flat":
    flat = lambda: ar._jitted_allreduce(hc, ar._mpijax_fn(), "mpijax allreduce")  # noqa: E731
    return ar._measure(hc, [("flat", EXTRA["flat"][0], phase, flat),
                            ("raw4", EXTRA["raw4"][0], phase, lambda: ar._raw(hc, in_place=False))],
                       sizes, args)
  raise SystemExit(f"unknown --phase {phase!r}; known: {sorted(PHASES)}")


def targets(rows: list[Row], sizes: list[int]) -> tuple[str, bool]:
  """The targets as a Markdown table of ratios with PASS/FAIL, and whether all passed."""
  by = {r.key: r for r in rows}

  def us(method, mode, s):
    row = by.get(_key(method, mode))
    return row.us(s) if row else None

  lines = ["| size | mode | mpijax | local + 2-rank | mpijax / (local + 2-rank) | "
           f"≤ {TARGET}× | JAX psum | mpijax / JAX | ≤ 1× |",
           "|---|---|---:|---:|---:|---|---:|---:|---|"]
  ok = True
  fmt = _common._fmt_us
  for s in sizes:
    for mode, mode_label in MODES.items():
      m, loc, mpi, jx = (us(k, mode, s) for k in ("mpijax", "local", "mpi", "jax"))
      parts = None if None in (m, loc, mpi) else m / (loc + mpi)
      vs_jax = None if None in (m, jx) else m / jx
      # Each verdict is taken on the ratio as printed (3 decimals).
      (v1, r1), (v2, r2) = (
          ("N/A", "–") if q is None else
          (lambda okq: ("PASS" if okq[0] else "FAIL", okq[1] + "×"))(_common.judged(q, lim))
          for q, lim in ((parts, TARGET), (vs_jax, 1)))
      ok = ok and v1 == "PASS" and v2 == "PASS"
      lines.append(f"| {_common.fmt_size(s)} | {mode_label} | {fmt(m)} | "
                   f"{fmt(None if parts is None else loc + mpi)} | "
                   f"{r1} | {v1} | {fmt(jx)} | {r2} | {v2} |")
  return "\n".join(lines), ok


def report(rows: list[Row], sizes: list[int], args, meta: dict[str, Any]) -> None:
  order = [_key(m, mode) for mode in MODES for m in METHODS] + list(EXTRA)
  rows = sorted(rows, key=lambda r: order.index(r.key) if r.key in order else len(order))
  title = "psum of 4 float32 buffers (one per CPU device): median µs per call (max over ranks)"
  table, ok = targets(rows, sizes)
  parts = [f"### {title}", "",
           _common.markdown_table(rows, sizes, title="method (size per device)"),
           "", "Targets (2 ranks x 2 devices, same job):", "", table,
           "", "Fastest trial instead of the median (µs, max over ranks):", "",
           _common.markdown_table(rows, sizes, stat="best", title="method (size per device)")]
  notes = _common.skip_notes(rows)
  if notes:
    parts += ["", "Not measured:", ""] + notes
  parts += ["", _common.load_note()]
  text = "\n".join(parts)
  print("\n" + text, flush=True)
  print(f"\ntargets: {'all PASS' if ok else 'not all PASS'}", flush=True)
  _common.write_report(args.out, "hierarchical", text,
                       {"benchmark": "hierarchical", "sizes": sizes, "meta": meta,
                        "rows": [r.to_json() for r in rows]},
                       rows, sizes, "psum over 4 CPU devices (2 ranks x 2)", xlabel="buffer size per device (float32)")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--sizes", default=None, help="bytes per device, e.g. 4KiB,1MiB,16MiB")
  p.add_argument("--trials", type=int, default=None,
                 help="trials per cell (default 30 below 1 MiB, 10 from 1 MiB; 5 with --quick)")
  p.add_argument("--trial-seconds", type=float, default=0.005)
  p.add_argument("--quick", action="store_true", help="smoke test: 4 KiB and 256 KiB, 5 trials")
  p.add_argument("--phases", default="hier",
                 help=f"comma-separated subset of {','.join(PHASES)} (default: hier)")
  p.add_argument("--out", default=_common.default_out_dir())
  p.add_argument("--phase-timeout", type=float, default=900, help="seconds per mpirun job")
  p.add_argument("--verbose", action="store_true")
  p.add_argument("--phase", default=None, help=argparse.SUPPRESS)
  p.add_argument("--phase-out", default=None, help=argparse.SUPPRESS)
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  sizes = (_common.parse_sizes(args.sizes) if args.sizes
           else list(QUICK_SIZES if args.quick else DEFAULT_SIZES))
  if args.phase is not None:
    rows = phase_rows(args.phase, args, sizes)
    return _common.finish_phase(args.phase_out, rows)
  if _common.under_mpi_launcher():
    # Run as the 2 x 2 job itself: the hier phase here, the report on rank 0.
    rows = phase_rows("hier", args, sizes)
    hc = HarnessComm()
    if hc.rank == 0:
      report(rows, sizes, args, {"phases": {"hier": _common.environment_info()}})
    return _common.exit_status(rows)
  phase_args = ar._phase_args(args, sizes)
  rows: list[Row] = []
  meta: dict[str, Any] = {}
  for phase in [p.strip() for p in args.phases.split(",") if p.strip()]:
    if phase not in PHASES:
      raise SystemExit(f"unknown phase {phase!r}; known: {','.join(PHASES)}")
    nprocs, env = PHASES[phase]
    res = _common.run_phase(SCRIPT, nprocs, phase, phase_args, env=env,
                            timeout=args.phase_timeout)
    if isinstance(res, str):
      if phase == "hier":
        rows += [Row(_key(m, mode), f"{METHODS[m]} [{MODES[mode]}]", phase,
                     {s: res for s in sizes}) for mode in MODES for m in METHODS]
      else:
        rows += [Row(k, lab, ph, {s: res for s in sizes}) for k, (lab, ph) in EXTRA.items()
                 if ph == phase]
    else:
      rows += res[0]
      meta.setdefault("phases", {})[phase] = {"ranks": nprocs, "env": env, **res[1]}
  report(rows, sizes, args, meta)
  return _common.exit_status(rows)


if __name__ == "__main__":
  sys.exit(main())
