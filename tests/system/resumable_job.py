"""A job that survives restarts: STEPS steps of an all-reduce, its state saved after every step.

Usage: python resumable_job.py STATE_DIR STEPS [SECONDS_PER_STEP]

Used by the fault-injection tests (test_restart.py, test_slurm.py). Every
step all-reduces ``step + 1`` over the ranks and checks the sum against the
rank count, so a rank that is missing or left over fails the step. Rank 0
saves ``{"step", "total", "ranks"}`` to STATE_DIR/state.json after every
step (write to a temporary file, then rename: never half-written); a
restarted job continues from it, also on another rank count.

SIGUSR1/SIGTERM (Slurm's ``--signal``, a preemption) make every rank finish
its step, agree to stop, and exit 75 (EX_TEMPFAIL) after the state is saved.
At the end rank 0 writes STATE_DIR/done.json and prints ``DONE ...``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import jax.numpy as jnp
import numpy as np

import mpijax
from mpijax import ops
from mpijax._src import mpi_util

PREEMPTED = 75


def _save(path: str, state: dict) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(state, f)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def _allreduce(value: float) -> float:
  out = ops.allreduce(jnp.asarray([value], jnp.float32), op="sum")
  out = out[0] if isinstance(out, tuple) else out
  return float(np.asarray(out)[0])


def main(state_dir: str, steps: int, seconds: float) -> int:
  rt = mpijax.init()
  attempt = mpijax.config.get("restart_attempt")
  stop = []
  for sig in (signal.SIGUSR1, signal.SIGTERM):
    signal.signal(sig, lambda signum, _frame: stop.append(signum))
  path = os.path.join(state_dir, "state.json")
  state = {"step": 0, "total": 0, "ranks": []}
  if rt.rank == 0 and os.path.exists(path):
    with open(path) as f:
      state = json.load(f)
  state = json.loads(mpi_util.bcast_str(rt.comm, json.dumps(state) if rt.rank == 0 else None))
  start = state["step"]
  print(f"attempt {attempt}: {rt.size} ranks, starting at step {start} "
        f"(SLURM_RESTART_COUNT={os.environ.get('SLURM_RESTART_COUNT', '-')})", flush=True)
  for step in range(start, steps):
    got = _allreduce(float(step + 1))
    assert got == rt.size * (step + 1), f"step {step}: sum {got} on {rt.size} ranks"
    state = {"step": step + 1, "total": state["total"] + step + 1,
             "ranks": state["ranks"] + [rt.size]}
    if rt.rank == 0:
      _save(path, state)
    print(f"step {step + 1}/{steps} on {rt.size} ranks", flush=True)
    # Every rank stops after the same step: the signal reaches them at different times.
    if _allreduce(1.0 if stop else 0.0) > 0:
      print(f"preempted after step {step + 1}: state saved, exit {PREEMPTED}", flush=True)
      return PREEMPTED
    time.sleep(seconds)
  if rt.rank == 0:
    _save(os.path.join(state_dir, "done.json"), {**state, "resumed_from": start, "attempt": attempt})
    print(f"DONE steps={state['step']} total={state['total']} resumed_from={start} "
          f"attempt={attempt}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else 0.2))
