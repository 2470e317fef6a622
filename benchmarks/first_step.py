"""How long a job waits for the compiler: cold, warm and restarted, per rank, in one run.

Every row is a job of ``mpijax-run`` that builds the main job's model (the digits
CNN of ``mpijax.examples.digits`` under ``mpijax.train.DataParallel``) and makes
its first training step. Each rank reports the seconds it spent in JAX's compile
function (mpijax's compile hook: compiling, loading from the cache, waiting for
another rank's compile) up to the end of that step, and the step's own time.

==============================  ===========================================================
row                             the job
==============================  ===========================================================
1 rank, cold                    one rank, an empty cache: the compile of one process
N ranks, no cache               ``MPIJAX_COMPILE_CACHE=off``: every rank compiles (as without mpijax)
N ranks, JAX's cache, warm      ``MPIJAX_COMPILE_CACHE=off`` and ``JAX_COMPILATION_CACHE_DIR``: JAX's
                                own cache, after a first job filled it (process 0 writes, the
                                keys of per-rank programs differ between ranks)
N ranks, cold                   mpijax's cache, empty: one rank compiles each program
N ranks, warm                   the same cache again
N ranks, restarted              ``--max-restarts 1``: a rank dies after the first step of a
                                cold job; the restarted attempt's first step
==============================  ===========================================================

Targets: warm, the slowest rank's compile <= 0.25x its cold one; cold, the slowest
rank's <= 1.5x the 1-rank job's; restarted, <= 0.25x the first attempt's.

Usage::

  python benchmarks/first_step.py                 # 4 ranks, 3 trials of every row
  python benchmarks/first_step.py --np 2 --trials 1
"""

from __future__ import annotations

import time

_T0 = time.time()  # this process's start, before the imports below

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

WARM_TARGET, COLD_TARGET, RESTART_TARGET = 0.25, 1.5, 0.25


# --- the job (runs under mpijax-run) ----------------------------------------------------


def job(die_after_first_step: bool) -> None:
  import jax
  import optax

  import mpijax
  from mpijax import train
  from mpijax._src.xla import compile_hook
  from mpijax.examples import digits

  rt = mpijax.init()
  attempt = mpijax.config.get("restart_attempt")
  t_init = time.time()
  x, y, _, _ = digits.load_data(0)
  dp = train.DataParallel(digits.loss_fn, optax.adamw(1e-3), has_aux=True)
  state = dp.init(digits.init_params(0), rng=jax.random.key(0))
  batch = next(iter(train.shard_batches((x, y), 64, seed=0, epoch=0)))
  jax.block_until_ready(state)
  t_step = time.time()
  state, _ = dp.step(state, batch)
  jax.block_until_ready(state)
  t_done = time.time()
  stats = compile_hook.stats()
  print(
    "RESULT "
    + json.dumps(
      {
        "rank": rt.rank,
        "attempt": attempt,
        "compile_s": stats.seconds,
        "compiled": stats.compiled,
        "loaded": stats.loaded,
        "waited": stats.waited,
        "uncached": stats.uncached,
        "first_step_s": t_done - t_step,
        "start_to_first_step_s": t_done - _process_start(),
        "init_s": t_init - _process_start(),
        "done_at": t_done,
      }
    ),
    flush=True,
  )
  if die_after_first_step and attempt == 0 and rt.rank == rt.size - 1:
    os._exit(3)  # the restarted attempt is what is measured


def _process_start() -> float:
  """This process's start (Unix time), from /proc: before the interpreter loaded anything."""
  with open("/proc/self/stat") as f:
    ticks = int(f.read().rsplit(")", 1)[1].split()[19])
  with open("/proc/uptime") as f:
    uptime = float(f.read().split()[0])
  return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


# --- the driver ------------------------------------------------------------------------


def run(np_: int, env: dict[str, str], *, restart: bool, timeout: float) -> list[dict]:
  """One job; every rank's RESULT (of every attempt)."""
  argv = [sys.executable, "-m", "mpijax.launch", "-n", str(np_), "--timeout", str(int(timeout))]
  if restart:
    argv += ["--max-restarts", "1", "--restart-backoff", "0"]
  argv += ["--", sys.executable, os.path.abspath(__file__), "--job"]
  if restart:
    argv.append("--die")
  full = {**os.environ, **env}
  for name in ("JAX_COMPILATION_CACHE_DIR", "MPIJAX_COMPILE_CACHE"):
    if name not in env:
      full.pop(name, None)
  proc = subprocess.run(argv, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        text=True, timeout=timeout + 60)
  rows = [json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines()
          if "RESULT " in line]
  want = np_ * (2 if restart else 1)
  if proc.returncode != 0 or len(rows) != want:
    raise RuntimeError(f"job failed (exit {proc.returncode}, {len(rows)} of {want} results):\n"
                       + "\n".join(proc.stdout.splitlines()[-30:]))
  return rows


def trial(np_: int, timeout: float) -> dict[str, list[dict]]:
  """Every row once, in the order of the table (one temporary cache per kind)."""
  out: dict[str, list[dict]] = {}
  dirs = [tempfile.mkdtemp(prefix="mpijax-first-step-") for _ in range(4)]
  one, jax_dir, ours, restart_dir = dirs
  try:
    out["1 rank, cold"] = run(1, {"MPIJAX_COMPILE_CACHE": one}, restart=False, timeout=timeout)
    out["N ranks, no cache"] = run(np_, {"MPIJAX_COMPILE_CACHE": "off"}, restart=False,
                                   timeout=timeout)
    jax_env = {"MPIJAX_COMPILE_CACHE": "off", "JAX_COMPILATION_CACHE_DIR": jax_dir}
    run(np_, jax_env, restart=False, timeout=timeout)  # fills JAX's own cache
    out["N ranks, JAX's cache, warm"] = run(np_, jax_env, restart=False, timeout=timeout)
    out["N ranks, cold"] = run(np_, {"MPIJAX_COMPILE_CACHE": ours}, restart=False,
                               timeout=timeout)
    out["N ranks, warm"] = run(np_, {"MPIJAX_COMPILE_CACHE": ours}, restart=False,
                               timeout=timeout)
    both = run(np_, {"MPIJAX_COMPILE_CACHE": restart_dir}, restart=True, timeout=timeout)
    out["N ranks, restart: first attempt"] = [r for r in both if r["attempt"] == 0]
    out["N ranks, restarted"] = [r for r in both if r["attempt"] == 1]
  finally:
    for d in dirs:
      shutil.rmtree(d, ignore_errors=True)
  return out


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--np", type=int, default=4, help="ranks (default 4)")
  p.add_argument("--trials", type=int, default=3, help="runs of every row (default 3)")
  p.add_argument("--timeout", type=float, default=600, help="seconds per job (default 600)")
  p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                               "results"))
  p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--die", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.job:
    job(args.die)
    return 0
  trials = []
  for i in range(args.trials):
    trials.append(trial(args.np, args.timeout))
    print(f"# trial {i + 1} of {args.trials} done", flush=True)

  def slowest(name: str, key: str = "compile_s") -> float:
    return statistics.median(max(r[key] for r in t[name]) for t in trials)

  def per_rank(name: str, key: str = "compile_s") -> list[float]:
    ranks = sorted({r["rank"] for r in trials[0][name]})
    return [statistics.median(next(r[key] for r in t[name] if r["rank"] == k) for t in trials)
            for k in ranks]

  names = list(trials[0])
  n = args.np
  print(f"\n## First step, {n} ranks: seconds in JAX's compile function up to the end of the "
        f"first step, median of {len(trials)} trial(s)\n")
  print("| job | " + " | ".join(f"rank {k}" for k in range(n)) + " | slowest | first step (slowest) "
        "| process start to first step (slowest) |")
  print("|---|" + "---:|" * (n + 3))
  for name in names:
    cells = per_rank(name)
    cells += [float("nan")] * (n - len(cells))
    label = name.replace("N ranks", f"{n} ranks")
    print(f"| {label} | " + " | ".join("" if c != c else f"{c:.2f}" for c in cells)
          + f" | {slowest(name):.2f} | {slowest(name, 'first_step_s'):.2f} | "
          f"{slowest(name, 'start_to_first_step_s'):.2f} |")
  checks = [
    ("warm: slowest rank's compile <= 0.25x its cold", slowest("N ranks, warm"),
     slowest("N ranks, cold"), WARM_TARGET),
    (f"cold: slowest of {n} ranks <= 1.5x one rank's", slowest("N ranks, cold"),
     slowest("1 rank, cold"), COLD_TARGET),
    ("restarted attempt <= 0.25x the first attempt", slowest("N ranks, restarted"),
     slowest("N ranks, restart: first attempt"), RESTART_TARGET),
  ]
  print()
  failed = 0
  for what, got, ref, target in checks:
    ratio = got / ref if ref else float("inf")
    ok = ratio <= target
    failed += not ok
    print(f"{'PASS' if ok else 'FAIL'}  {what}: {got:.2f} / {ref:.2f} s = {ratio:.3f}x")
  peer = slowest("N ranks, JAX's cache, warm")
  print(f"info  JAX's own cache, warm: slowest rank {peer:.2f} s, "
        f"{peer / slowest('N ranks, warm'):.1f}x mpijax's warm; no cache: "
        f"{slowest('N ranks, no cache'):.2f} s")
  one, five, _ = os.getloadavg()
  print(f"Load average {one:.1f} / {five:.1f} (1 / 5 min) on {os.cpu_count()} CPUs at the end.")
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, f"first_step_{n}ranks.json")
  with open(path, "w") as f:
    json.dump({"np": n, "trials": trials, "loadavg": [one, five]}, f, indent=1)
  print(f"wrote {path}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
