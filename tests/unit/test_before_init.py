"""Collectives before mpijax.init() fail with the fix in the message (issue 8)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("call", [
    "mpijax.ops.allreduce(jnp.ones(2))",
    "jax.jit(lambda x: mpijax.ops.allgather(x))(jnp.ones(2))",
])
def test_collective_before_init_says_call_init(call):
  code = f"import jax, jax.numpy as jnp, mpijax, mpijax.ops\n{call}\n"
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode != 0
  assert "needs the mpijax runtime: call mpijax.init() first" in proc.stderr, proc.stderr[-2000:]


def test_init_argument_errors_name_the_value_and_the_fix():
  from mpijax._src import runtime
  with pytest.raises(ValueError, match=r"coordinator_address='127.0.0.1:abc'.*'host:port'"):
    runtime._check_arguments("127.0.0.1:abc", None, None)
  with pytest.raises(TypeError, match=r"devices_per_process='2'.*int >= 1"):
    runtime._check_arguments(None, "2", None)
  with pytest.raises(TypeError, match=r"comm='world'.*mpi4py communicator"):
    runtime._check_arguments(None, None, "world")
  runtime._check_arguments("node1:1234", 2, None)  # fine
