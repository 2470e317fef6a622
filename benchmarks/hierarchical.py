"""Hierarchical psum against a flat MPI allreduce and JAX's gloo psum, same global data.

Four CPU devices hold one float32 buffer of SIZE bytes each; every row sums
them over all four devices:

* mpijax hierarchical psum, 2 ranks x 2 local devices:
  ``mpijax.pmap(lambda x: mpijax.lax.psum(x, 'i'), axis_name='i')`` (local
  reduce-scatter, one MPI allreduce per local device, local all-gather).
* flat MPI: 4 ranks x 1 device, ``mpijax.ops.allreduce`` inside ``jax.jit``
  (and raw mpi4py ``Allreduce`` over the same 4 ranks for reference).
* JAX's own psum over gloo with ``jax.distributed``, 4 processes x 1 device
  (and 2 processes x 2 devices).

Run from a plain shell; it starts one bounded ``mpirun`` job per layout::

  python benchmarks/hierarchical.py            # sizes 4 KiB .. 64 MiB
  python benchmarks/hierarchical.py --quick    # smoke test

Writes ``hierarchical.json``, ``.md`` and ``.png`` to ``--out`` (default
``benchmarks/results/``). Every row's result is checked against NumPy before
it is timed; the script exits 1 if any result is wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import allreduce as ar  # noqa: E402
from _common import HarnessComm, Row  # noqa: E402

SCRIPT = os.path.abspath(__file__)
DEFAULT_SIZES = (4 << 10, 256 << 10, 4 << 20, 64 << 20)
QUICK_SIZES = (4 << 10, 256 << 10)
TWO_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}

# key -> (label, phase); phase -> (ranks, extra environment)
ROWS = {
    "hier": ("mpijax hierarchical psum, 2 ranks x 2 devices", "hier"),
    "flat": ("mpijax allreduce in jit (flat), 4 ranks x 1 device", "flat"),
    "raw4": ("mpi4py Allreduce out of place, 4 ranks (reference)", "flat"),
    "gloo4": ("JAX psum over gloo, 4 processes x 1 device", "gloo4"),
    "gloo2x2": ("JAX psum over gloo, 2 processes x 2 devices", "gloo2x2"),
}
PHASES = {
    "hier": (2, TWO_DEVICES),
    "flat": (4, {}),
    "gloo4": (4, {}),
    "gloo2x2": (2, TWO_DEVICES),
}


def _hier_factory(hc: HarnessComm):
  import jax
  import jax.numpy as jnp
  import numpy as np
  import mpijax
  if not hasattr(mpijax, "pmap"):
    raise ar.Skip("this mpijax has no mpijax.pmap")
  try:
    import mpijax.lax as mlax
  except Exception as e:
    raise ar.Skip(f"mpijax.lax not importable: {type(e).__name__}: {e}") from None
  L = mpijax.local_device_count()
  P = mpijax.process_count()
  f = mpijax.pmap(lambda x: mlax.psum(x, "i"), axis_name="i")
  place = mpijax.pmap(lambda x: x, axis_name="i")
  G = P * L

  def build(nbytes: int):
    n = nbytes // 4
    base = mpijax.process_index() * L
    host = np.stack([ar.pattern(n, base + l) for l in range(L)])  # global device g: pattern(g)
    x = place(host)
    ar._expect(f(x), ar.pattern_sum(n, G), "mpijax hierarchical psum")
    x = place(np.zeros_like(host))
    return (lambda: jax.block_until_ready(f(x))), 1
  return build


def phase_rows(phase: str, args, sizes: list[int]) -> list[Row]:
  if phase in ("gloo4", "gloo2x2"):
    hc, err = ar.start_jax_distributed()

    def gloo():
      if err:
        raise ar.Skip(err)
      return ar.gloo_factory(hc)
    return ar._measure(hc, [(phase, ROWS[phase][0], phase, gloo)], sizes, args)

  init_error = ar._init_mpijax()
  hc = HarnessComm()

  def needs_mpijax(factory):
    def wrapped():
      if init_error:
        raise ar.Skip(f"mpijax.init() failed: {init_error}")
      return factory()
    return wrapped

  if phase == "hier":
    return ar._measure(hc, [("hier", ROWS["hier"][0], phase, needs_mpijax(lambda: _hier_factory(hc)))],
                       sizes, args)
  if phase == "flat":
    flat = needs_mpijax(lambda: ar._jitted_allreduce(hc, ar._mpijax_fn(), "mpijax allreduce"))
    return ar._measure(hc, [("flat", ROWS["flat"][0], phase, flat),
                            ("raw4", ROWS["raw4"][0], phase, lambda: ar._raw(hc, in_place=False))],
                       sizes, args)
  raise SystemExit(f"unknown --phase {phase!r}; known: {sorted(PHASES)}")


def report(rows: list[Row], sizes: list[int], args, meta: dict[str, Any]) -> None:
  order = list(ROWS)
  rows = sorted(rows, key=lambda r: order.index(r.key))
  by = {r.key: r for r in rows}
  title = "psum of 4 float32 buffers (one per CPU device): median µs (max over ranks)"
  parts = [f"### {title}", "", _common.markdown_table(rows, sizes, title="method (size per device)")]
  if by.get("flat") and any(by["flat"].us(s) for s in sizes):
    parts += ["", "Ratio to the flat mpijax allreduce (4 ranks x 1 device):", "",
              _common.markdown_table(rows, sizes, ratio_to=by["flat"])]
  parts += ["", "Fastest trial instead of the median (µs, max over ranks):", "",
             _common.markdown_table(rows, sizes, stat="best", title="method (size per device)")]
  notes = _common.skip_notes(rows)
  if notes:
    parts += ["", "Not measured:", ""] + notes
  parts += ["", _common.load_note()]
  text = "\n".join(parts)
  print("\n" + text, flush=True)
  os.makedirs(args.out, exist_ok=True)
  base = os.path.join(args.out, "hierarchical")
  with open(base + ".md", "w") as f:
    f.write(text + "\n")
  with open(base + ".json", "w") as f:
    json.dump({"benchmark": "hierarchical", "sizes": sizes, "meta": meta,
               "rows": [r.to_json() for r in rows]}, f, indent=1)
  why = _common.plot(rows, sizes, base + ".png", "psum over 4 CPU devices",
                     xlabel="buffer size per device (float32)")
  print(f"\nwrote {base}.md, {base}.json" + (f"; {why}" if why else f", {base}.png"), flush=True)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--sizes", default=None, help="bytes per device, e.g. 4KiB,256KiB,4MiB,64MiB")
  p.add_argument("--trials", type=int, default=None,
                 help="trials per cell (default 30 below 1 MiB, 10 from 1 MiB; 5 with --quick)")
  p.add_argument("--trial-seconds", type=float, default=0.005)
  p.add_argument("--quick", action="store_true", help="smoke test: 4 KiB and 256 KiB, 5 trials")
  p.add_argument("--phases", default=",".join(PHASES),
                 help=f"comma-separated subset of {','.join(PHASES)}")
  p.add_argument("--out", default=_common.default_out_dir())
  p.add_argument("--phase-timeout", type=float, default=600, help="seconds per mpirun job")
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
    hc = HarnessComm()
    if hc.rank == 0 and args.phase_out:
      _common.write_phase_output(args.phase_out, rows, _common.environment_info())
    return 0
  if _common.under_mpi_launcher():
    raise SystemExit("run benchmarks/hierarchical.py from a plain shell (not under mpirun): "
                     "it starts its own mpirun jobs, one per device layout.")
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
      rows += [Row(k, lab, ph, {s: res for s in sizes}) for k, (lab, ph) in ROWS.items()
               if ph == phase]
    else:
      rows += res[0]
      meta.setdefault("phases", {})[phase] = {"ranks": nprocs, "env": env, **res[1]}
  report(rows, sizes, args, meta)
  return _common.exit_status(rows)


if __name__ == "__main__":
  sys.exit(main())
