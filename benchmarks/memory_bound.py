"""What the node-local all-reduce's memory traffic alone costs on this machine.

Builds ``memory_bound.c`` (a C model of mpijax's cross-memory all-reduce: the
same blocks, chunks and kernel copies, with no XLA, MPI or Python) and runs it
in the layouts the all-reduce targets compare, in round robin:

- 2 processes x 1 thread, out of place and in place: the all-reduce without
  and with donation;
- 1 process x 2 threads: the local part of the 2 x 2 target's reference;
- 2 processes x 2 threads: the 2 x 2 all-reduce, as mpijax runs it (flat)
  and in two levels (each process's sum first, then across the processes).

A run's figure is member 0's median step as a blocking call sees it, from
its arrival to its departure (in a loop, the time per all-reduce); the part
between the barriers alone is shown beside it. With ``--reference`` (the
JSON of ``partitioner_allreduce.py --devices 2``) it sets the 2 x 2 model
against that job's target, 1.3 x (local + 1-device all-reduce), and that
job's all-reduce.

  python benchmarks/memory_bound.py [--bytes 4MiB] [--repeats 5] [--iters 300]
                                    [--reference results/partitioner_allreduce_np2x2.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import _common

HERE = Path(__file__).resolve().parent

# (name, processes, threads, in place, algorithm)
LAYOUTS = [
  ("2 x 1, out of place", 2, 1, 0, "flat"),
  ("2 x 1, in place", 2, 1, 1, "flat"),
  ("1 x 2 (local)", 1, 2, 0, "flat"),
  ("2 x 2", 2, 2, 0, "flat"),
  ("2 x 2, two-level", 2, 2, 0, "two-level"),
]


def build(out_dir: Path) -> Path:
  cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
  if cc is None:
    sys.exit("memory_bound: no C compiler (cc or gcc); set CC")
  exe = out_dir / "memory_bound"
  cmd = [cc, "-O3", "-march=native", "-pthread", "-o", str(exe), str(HERE / "memory_bound.c")]
  r = subprocess.run(cmd, capture_output=True, text=True)
  if r.returncode != 0:
    sys.exit(f"memory_bound: {' '.join(cmd)} failed:\n{r.stderr}")
  return exe


def run_layout(exe: Path, layout, nbytes: int, iters: int) -> dict:
  _, procs, threads, in_place, algorithm = layout
  args = [str(exe), str(procs), str(threads), str(nbytes), str(in_place), str(iters), algorithm]
  r = subprocess.run(args, capture_output=True, text=True, timeout=600)
  if r.returncode != 0:
    sys.exit(f"memory_bound: {' '.join(args)} failed (exit {r.returncode}):\n{r.stderr}")
  return json.loads(r.stdout)


def reference_target(path: Path, nbytes: int) -> tuple[float, float, float]:
  """(all-reduce, local, 1-device all-reduce) medians in us at ``nbytes`` from
  a partitioner_allreduce.py --devices 2 job."""
  rows = {row["key"]: row for row in json.loads(path.read_text())["rows"]}

  def cell(key: str) -> float:
    try:
      return rows[key]["cells"][str(nbytes)]["median_us"]
    except KeyError:
      sys.exit(f"memory_bound: {path} has no {key!r} at {nbytes} bytes")

  return cell("xla_mpi"), cell("xla_local"), cell("xla_mpi_flat")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("--bytes", default="4MiB", help="bytes per member (default 4MiB)")
  p.add_argument("--repeats", type=int, default=5, help="runs of each layout, in round robin")
  p.add_argument("--iters", type=int, default=300, help="steps per run")
  p.add_argument("--reference", type=Path, help="JSON of partitioner_allreduce.py --devices 2")
  p.add_argument("--out", type=Path, default=HERE / "results")
  args = p.parse_args(argv)
  nbytes = _common.parse_sizes(args.bytes)[0]
  args.out.mkdir(parents=True, exist_ok=True)
  runs: dict[str, list[dict]] = {name: [] for name, *_ in LAYOUTS}
  with tempfile.TemporaryDirectory() as tmp:
    exe = build(Path(tmp))
    for _ in range(args.repeats):
      for layout in LAYOUTS:
        runs[layout[0]].append(run_layout(exe, layout, nbytes, args.iters))

  def med(name: str, what: str = "call_us") -> float:
    return statistics.median(r[what][1] for r in runs[name])

  size = _common.fmt_size(nbytes)
  lines = [
    f"# Memory model of the node-local all-reduce, {size} per member",
    "",
    f"Medians over {args.repeats} runs of {args.iters} steps each (us; a run's figure is member"
    " 0's median step: per call, from its arrival to its departure; between the barriers, from"
    " the moment it sees every member arrived).",
    "",
    "| layout | per call | between barriers |",
    "|---|---:|---:|",
  ]
  for name, *_ in LAYOUTS:
    lines.append(f"| {name} | {med(name):,.0f} | {med(name, 'between_barriers_us'):,.0f} |")
  lines.append("")
  oop, inp = med("2 x 1, out of place"), med("2 x 1, in place")
  local = med("1 x 2 (local)")
  parts = local + oop
  lines.append(f"2 x 1: out of place / in place = {oop:.0f} / {inp:.0f} us = {oop / inp:.2f}x")
  for name in ("2 x 2", "2 x 2, two-level"):
    lines.append(
      f"{name} / (1 x 2 + 2 x 1 out of place) = {med(name):.0f} / ({local:.0f} + {oop:.0f}) us"
      f" = {med(name) / parts:.2f}x"
    )
  if args.reference is not None:
    xla, xla_local, xla_flat = reference_target(args.reference, nbytes)
    target = 1.3 * (xla_local + xla_flat)
    both = med("2 x 2")
    lines.append(
      f"{args.reference.name}: target 1.3 x ({xla_local:.0f} + {xla_flat:.0f}) = {target:.0f} us;"
      f" the model's 2 x 2 all-reduce {both:.0f} us = {both / target:.2f}x the target; the job's"
      f" all-reduce {xla:.0f} us = {xla / both:.2f}x the model"
    )
  load = os.getloadavg()
  lines.append("")
  lines.append(f"Load average {load[0]:.1f} / {load[1]:.1f} (1 / 5 min) at the end of the run.")
  text = "\n".join(lines)
  print(text)
  (args.out / "memory_bound.md").write_text(text + "\n")
  (args.out / "memory_bound.json").write_text(
    json.dumps({"bytes": nbytes, "iters": args.iters, "runs": runs, "load": load}, indent=1)
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
