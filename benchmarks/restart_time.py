"""How long a restart takes: from SIGKILL of one rank to the restarted job's first step.

A training job (the digits model of ``mpijax.examples.digits``, data-parallel,
a checkpoint after every ``--ckpt-every`` steps) runs under
``mpijax-run -n N --max-restarts 1``. Once it has made ``--kill-at`` steps,
one rank (chosen at random) is SIGKILLed. The job's rank 0 prints timestamped
events (process start, ``mpijax.init()`` done, checkpoint restored, each step
done), and the script splits the time from the kill to the restarted job's
first step into:

==================  ==============================================================
noticed             the kill -> mpijax-run reports the failed attempt (launcher exit)
relaunched          -> the restarted job's rank 0 process exists (back-off included)
imported            -> the program starts (Python, mpijax and JAX imported)
initialized         -> its ``mpijax.init()`` returns (MPI start-up, coordinator)
restored            -> the checkpoint is read into the training state
first step          -> the first step is done: JAX traces and compiles it, then runs it
==================  ==============================================================

"compile" is the first step's time less a steady step's. Each trial has a
compile cache of its own (``MPIJAX_COMPILE_CACHE``), empty when the job starts,
so the first attempt compiles cold and the restarted one finds what it compiled.
The targets, at 4 ranks: ``kill -> first step - compile <= 15 s``;
``kill -> first step <= 0.6x`` a cold start (the first attempt's process start
to its first step); the restarted attempt's seconds in JAX's compile function
up to its first step (slowest rank) ``<= 0.25x`` the first attempt's.

Usage (from a plain shell; each trial is bounded by ``--timeout``)::

  python benchmarks/restart_time.py                  # 4 ranks, 3 trials
  python benchmarks/restart_time.py --np 2 --trials 1 --backoff 1
"""

from __future__ import annotations

import time

_T0 = time.time()  # this process's start, before the imports below

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import uuid  # noqa: E402

TARGET_SECONDS = 15.0
RESTART_TARGET = 0.6  # kill -> first step, against a cold start's process start -> first step
COMPILE_TARGET = 0.25  # the restarted attempt's compile, against the first attempt's
PHASES = ("noticed", "relaunched", "imported", "initialized", "restored", "first step")


def _process_start() -> float:
  """This process's start (Unix time), from /proc: before the interpreter loaded anything."""
  with open("/proc/self/stat") as f:
    ticks = int(f.read().rsplit(")", 1)[1].split()[19])
  with open("/proc/uptime") as f:
    uptime = float(f.read().split()[0])
  # Relative to now (/proc/stat's boot time has whole seconds only).
  return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


# --- the job (runs under mpijax-run) ----------------------------------------------------

def job(state_dir: str, steps: int, ckpt_every: int) -> None:
  import jax
  import optax

  import mpijax
  from mpijax import train
  from mpijax.examples import digits

  rt = mpijax.init()
  attempt = mpijax.config.get("restart_attempt")

  def event(name: str, *extra) -> None:
    if rt.rank == 0:
      print(f"EVENT {attempt} {name} {time.time():.6f} " + " ".join(map(str, extra)), flush=True)

  event("start", f"{_process_start():.6f}", f"{_T0:.6f}")
  event("init")
  x, y, _, _ = digits.load_data(0)
  dp = train.DataParallel(digits.loss_fn, optax.adamw(1e-3), has_aux=True)
  state = dp.init(digits.init_params(0), rng=jax.random.key(0))
  path = os.path.join(state_dir, "state.ckpt")
  done = 0
  if train.broadcast(os.path.exists(path)):
    saved = train.restore_checkpoint(path, like={"state": state, "step": 0})
    state, done = saved["state"], int(saved["step"])
  jax.block_until_ready(state)
  event("restored", done)
  batch = 64
  per_epoch = len(train.shard_batches((x, y), batch, seed=0, epoch=0))
  first = True
  while done < steps:
    epoch, skip = divmod(done, per_epoch)
    for b in itertools.islice(train.shard_batches((x, y), batch, seed=0, epoch=epoch), skip, None):
      state, _ = dp.step(state, b)
      jax.block_until_ready(state)
      done += 1
      event("step", done)
      if first:  # seconds in JAX's compile function up to here, slowest rank
        from mpi4py import MPI

        from mpijax._src import compile_hook

        event("compiled", f"{rt.comm.allreduce(compile_hook.stats().seconds, op=MPI.MAX):.6f}")
        first = False
      if done % ckpt_every == 0:
        train.save_checkpoint(path, {"state": state, "step": done})
      if done >= steps:
        break
  event("done", done)


# --- the driver ------------------------------------------------------------------------

def _rank_pid(marker: str, rank: int) -> int | None:
  want = f"MPIJAX_BENCH_MARKER={marker}".encode()
  ranks = [f"{v}={rank}".encode() for v in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")]
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/environ", "rb") as f:
        env = f.read().split(b"\0")
      with open(f"/proc/{entry}/cmdline", "rb") as f:
        cmdline = f.read()
    except OSError:
      continue
    if want in env and any(r in env for r in ranks) and b"--job" in cmdline:
      return int(entry)
  return None


def trial(args, seed: int) -> dict:
  """One job: kill a rank after --kill-at steps, return the timings."""
  rng = random.Random(seed)
  victim = rng.randrange(args.np)
  marker = uuid.uuid4().hex
  state = tempfile.mkdtemp(prefix="mpijax-restart-bench-")
  argv = [sys.executable, "-m", "mpijax.launch", "-n", str(args.np), "--timeout", str(args.timeout),
          "--max-restarts", "1", "--restart-backoff", str(args.backoff), "--",
          sys.executable, os.path.abspath(__file__), "--job", state, "--steps", str(args.steps),
          "--ckpt-every", str(args.ckpt_every)]
  cache = tempfile.mkdtemp(prefix="mpijax-restart-cache-")  # the first attempt compiles cold
  env = {**os.environ, "MPIJAX_BENCH_MARKER": marker, "MPIJAX_COMPILE_CACHE": cache}
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          start_new_session=True)
  lines: list[tuple[float, str]] = []
  reader = threading.Thread(target=lambda: [lines.append((time.time(), l.rstrip("\n")))
                                            for l in proc.stdout], daemon=True)
  reader.start()
  events: dict[tuple[int, str], list[tuple[float, list[str]]]] = {}

  def parse() -> None:
    events.clear()
    for _, line in list(lines):
      if "EVENT " in line:
        attempt, name, stamp, *extra = line.split("EVENT ", 1)[1].split()
        events.setdefault((int(attempt), name), []).append((float(stamp), extra))

  killed = None
  end = time.monotonic() + args.timeout
  while time.monotonic() < end and proc.poll() is None:
    parse()
    steps0 = events.get((0, "step"), [])
    if steps0 and int(steps0[-1][1][0]) >= args.kill_at:
      pid = _rank_pid(marker, victim)
      if pid is not None:
        os.kill(pid, signal.SIGKILL)
        killed = time.time()
        break
    time.sleep(0.01)
  try:
    proc.wait(timeout=args.timeout)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
  reader.join(10)
  shutil.rmtree(cache, ignore_errors=True)
  parse()
  text = "\n".join(l for _, l in lines)
  if proc.returncode != 0 or killed is None or (1, "step") not in events:
    raise RuntimeError(f"trial failed (exit {proc.returncode}, killed={killed is not None}):\n"
                       + "\n".join(text.splitlines()[-40:]))
  noticed = next(t for t, l in lines if "mpijax-run: attempt 0:" in l and t >= killed)
  steps0 = [t for t, _ in events[(0, "step")]]
  steady = statistics.median(b - a for a, b in zip(steps0[-20:], steps0[-19:])) if len(steps0) > 2 else 0.0
  t = {"noticed": noticed, "relaunched": float(events[(1, "start")][0][1][0]),
       "imported": float(events[(1, "start")][0][1][1]), "initialized": events[(1, "init")][0][0], "restored": events[(1, "restored")][0][0],  # noqa: E501
       "first step": events[(1, "step")][0][0]}
  compile_s = t["first step"] - t["restored"] - steady
  cold = events[(0, "step")][0][0] - float(events[(0, "start")][0][1][0])
  return {"seed": seed, "victim": victim, "killed_after_step": args.kill_at,
          "resumed_at_step": int(events[(1, "restored")][0][1][0]),
          "kill_to": {k: v - killed for k, v in t.items()}, "compile_s": compile_s,
          "steady_step_s": steady, "cold_start_to_first_step_s": cold,
          "compile_fn_s": [float(events[(a, "compiled")][0][1][0]) for a in (0, 1)]}


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--np", type=int, default=4, help="ranks (default 4)")
  p.add_argument("--trials", type=int, default=3)
  p.add_argument("--steps", type=int, default=150, help="training steps of the job (default 150)")
  p.add_argument("--kill-at", type=int, default=40, help="kill a rank after this many steps (default 40)")
  p.add_argument("--ckpt-every", type=int, default=10, help="checkpoint interval in steps (default 10)")
  p.add_argument("--backoff", type=float, default=1.0, help="mpijax-run --restart-backoff (default 1)")
  p.add_argument("--timeout", type=float, default=600, help="seconds per trial (default 600)")
  p.add_argument("--seed", type=int, default=None)
  p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
  p.add_argument("--job", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.job:
    job(args.job, args.steps, args.ckpt_every)
    return 0
  seed = args.seed if args.seed is not None else random.randrange(1 << 30)
  results = []
  for i in range(args.trials):
    r = trial(args, seed + i)
    results.append(r)
    print(f"# trial {i + 1}: kill -> first step {r['kill_to']['first step']:.1f} s "
          f"(compile {r['compile_s']:.1f} s), rank {r['victim']} killed", flush=True)

  def med(f):
    return statistics.median(f(r) for r in results)

  rows = [("kill -> " + k, med(lambda r, k=k: r["kill_to"][k])) for k in PHASES]
  compile_s = med(lambda r: r["compile_s"])
  overhead = med(lambda r: r["kill_to"]["first step"] - r["compile_s"])
  print(f"\n## Restart time, {args.np} ranks, median of {len(results)} trial(s), "
        f"back-off {args.backoff:g} s, checkpoint every {args.ckpt_every} steps\n")
  print("| from the kill to | seconds |\n|---|---|")
  for name, v in rows:
    print(f"| {name[len('kill -> '):]} | {v:.1f} |")
  print(f"| (of which JAX compiles the first step) | {compile_s:.1f} |")
  cold = med(lambda r: r["cold_start_to_first_step_s"])
  first_step = med(lambda r: r["kill_to"]["first step"])
  compiles = [med(lambda r, a=a: r["compile_fn_s"][a]) for a in (0, 1)]
  # Each target judged on the figure printed (3 decimals for a ratio).
  restart_ratio, compile_ratio = round(first_step / cold, 3), round(compiles[1] / compiles[0], 3)
  checks = [
    (round(overhead, 1) <= TARGET_SECONDS,
     f"first step - compile = {overhead:.1f} s (target <= {TARGET_SECONDS:g} s)"),
    (restart_ratio <= RESTART_TARGET,
     f"kill -> first step {first_step:.1f} s <= {RESTART_TARGET:g}x a cold start to the first "
     f"step ({cold:.1f} s): {restart_ratio:.3f}x"),
    (compile_ratio <= COMPILE_TARGET,
     f"the restarted attempt's compile {compiles[1]:.2f} s <= {COMPILE_TARGET:g}x the first "
     f"attempt's ({compiles[0]:.2f} s; seconds in JAX's compile function up to the first step, "
     f"slowest rank): {compile_ratio:.3f}x"),
  ]
  print()
  for ok, text in checks:
    print(f"{'PASS' if ok else 'FAIL'}  {text}")
  one, five, _ = os.getloadavg()
  print(f"Load average {one:.1f} / {five:.1f} (1 / 5 min) on {os.cpu_count()} CPUs at the end.")
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, f"restart_time_{args.np}ranks.json")
  with open(path, "w") as f:
    json.dump({"np": args.np, "backoff": args.backoff, "ckpt_every": args.ckpt_every,
               "target_s": TARGET_SECONDS, "median_overhead_s": overhead, "median_compile_s": compile_s,
               "loadavg": [one, five], "trials": results}, f, indent=1)
  print(f"wrote {path}")
  return 0 if all(ok for ok, _ in checks) else 1


if __name__ == "__main__":
  sys.exit(main())
