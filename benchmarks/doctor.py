"""How long ``mpijax-run -n N --doctor`` takes, launch to exit, against the 30 s target.

Each trial runs ``mpijax-run -n N --doctor`` from a plain shell (bounded by
``--timeout``), checks that it passed (exit 0, no FAIL line) and takes the
wall time from the launch to its exit, and rank 0's own figure (the report's
last line: its process start to the report). The table gives every trial
and the median; the target, at 4 ranks: the median within 30 s. The machine's
load average is printed with the figures (a busy machine inflates them).

Usage::

  python benchmarks/doctor.py                 # 4 ranks, 3 trials
  python benchmarks/doctor.py --np 2 --trials 5
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

TARGET_SECONDS = 30.0
TARGET_RANKS = 4


def trial(np: int, timeout: float) -> dict:
  env = {k: v for k, v in os.environ.items() if not k.startswith("MPIJAX_")}
  cmd = [sys.executable, "-m", "mpijax.launch", "-n", str(np), "--doctor"]
  start = time.monotonic()
  out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout + 30)
  seconds = time.monotonic() - start
  text = out.stdout + out.stderr
  last = re.search(r"mpijax doctor: (\d+) failed, .* \(([\d.]+) s on rank 0\)", text)
  return {
    "seconds": seconds,
    "rank0_seconds": float(last[2]) if last else None,
    "passed": out.returncode == 0 and last is not None and last[1] == "0",
    "returncode": out.returncode,
    "tail": text.strip().splitlines()[-3:],
  }


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--np", type=int, default=TARGET_RANKS, help="ranks (default 4)")
  p.add_argument("--trials", type=int, default=3, help="launches (default 3)")
  p.add_argument("--timeout", type=float, default=180, help="seconds per launch (default 180)")
  p.add_argument("--out", default=None, help="write the figures as JSON to this file")
  args = p.parse_args(argv)
  rows = [trial(args.np, args.timeout) for _ in range(args.trials)]
  load = os.getloadavg()
  print("| trial | mpijax-run --doctor, s | rank 0 (process start to report), s | passed |")
  print("|---:|---:|---:|---|")
  for i, r in enumerate(rows):
    rank0 = f"{r['rank0_seconds']:.1f}" if r["rank0_seconds"] is not None else "–"
    print(f"| {i} | {r['seconds']:.1f} | {rank0} | {'yes' if r['passed'] else 'NO'} |")
  median = statistics.median(r["seconds"] for r in rows)
  print(
    f"\n{args.np} ranks, median {median:.1f} s; load average {load[0]:.1f} {load[1]:.1f} "
    f"{load[2]:.1f} on {os.cpu_count()} cores"
  )
  ok = all(r["passed"] for r in rows)
  for r in rows:
    if not r["passed"]:
      print("a trial did not pass: " + " / ".join(r["tail"]))
  if args.np == TARGET_RANKS:
    verdict = "PASS" if median <= TARGET_SECONDS else "FAIL"
    print(f"target: median <= {TARGET_SECONDS:g} s at {TARGET_RANKS} ranks: {verdict}")
    ok = ok and median <= TARGET_SECONDS
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"np": args.np, "trials": rows, "median": median, "load": load}, f, indent=1)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
