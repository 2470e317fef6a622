"""Resume and preemption without DataParallel: docs/training.md's loop, complete.

    mpijax-run -n 4 -- python -m mpijax.examples.preemption --preempt-at 121   # exits 75
    mpijax-run -n 4 -- python -m mpijax.examples.preemption                    # resumes: x = 200

The state is a dict that carries its own step; each step adds 1 to ``x``.
``--preempt-at STEP`` has the last rank send itself SIGTERM at that step, as
a scheduler would; the ranks agree to stop at the next check (every 10
steps), save that step and exit with status 75. Run again, the loop resumes
at the saved step and ends with ``x`` = 200 everywhere.
"""

import argparse
import os
import signal

import jax
import jax.numpy as jnp

import mpijax
from mpijax import train

parser = argparse.ArgumentParser(prog="python -m mpijax.examples.preemption")
parser.add_argument("--preempt-at", type=int, default=None, metavar="STEP",
                    help="the last rank sends itself SIGTERM at this step")
args = parser.parse_args()

rt = mpijax.init()
total = 200


def init_state():
  return {"step": jnp.int32(0), "x": jnp.zeros(3)}


def next_batch(step):
  return jnp.ones(3)


@jax.jit
def my_step(state, batch):
  return {"step": state["step"] + 1, "x": state["x"] + batch}


train.install_preemption_handler()
state = train.resume_or_init("loop_ckpt", lambda: init_state())      # init_state() -> {"step": 0, ...}
for step in range(int(state["step"]), total):
  state = my_step(state, next_batch(step))                            # returns the state with "step": step + 1
  if step == args.preempt_at and rt.rank == rt.size - 1:
    os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler would: to one rank
  if step % 10 == 0 and train.stop_requested():       # collective: the same answer on every rank
    path = train.save_step_checkpoint("loop_ckpt", state, step + 1)
    raise train.Preempted(step + 1, path)
train.log(f"x = {state['x']} after step {int(state['step'])}")
