"""Collectives before mpijax.init() fail with the fix in the message."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
  "call",
  [
    "mpijax.ops.allreduce(jnp.ones(2))",
    "jax.jit(lambda x: mpijax.ops.allgather(x))(jnp.ones(2))",
  ],
)
def test_collective_before_init_says_call_init(call):
  code = f"import jax, jax.numpy as jnp, mpijax, mpijax.ops\n{call}\n"
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
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


def test_cpu_thread_pool_gets_two_threads_per_local_device(monkeypatch):
  """XLA's CPU client needs 2 threads per device for back-to-back multi-device calls."""
  from mpijax._src import device_setup

  for var in ("PJRT_NPROC", "NPROC"):
    monkeypatch.delenv(var, raising=False)
  monkeypatch.setattr(device_setup.os, "sched_getaffinity", lambda pid: {0, 1})
  device_setup._size_cpu_pool(1)
  assert "PJRT_NPROC" not in device_setup.os.environ  # one device: XLA's own size is enough
  device_setup._size_cpu_pool(2)
  assert device_setup.os.environ["PJRT_NPROC"] == "4"
  monkeypatch.setattr(device_setup.os, "sched_getaffinity", lambda pid: set(range(8)))
  monkeypatch.delenv("PJRT_NPROC")
  device_setup._size_cpu_pool(4)  # 8 cores: enough already
  assert "PJRT_NPROC" not in device_setup.os.environ


def test_ranks_sharing_a_node_unbound_each_get_their_share_of_its_cores(monkeypatch):
  """XLA's CPU pool (and how far its compiler splits a loop) is the rank's share of the
  node's cores where the node's ranks all run on all of them."""
  from mpijax._src import device_setup

  def pool(devices, local_size, cpus, online):
    for var in ("PJRT_NPROC", "NPROC"):
      monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(device_setup.os, "sched_getaffinity", lambda pid: set(cpus))
    monkeypatch.setattr(device_setup.os, "cpu_count", lambda: online)
    device_setup._size_cpu_pool(devices, local_size)
    return device_setup.os.environ.get("PJRT_NPROC")

  assert pool(1, 2, range(2), 2) == "1"  # 2 ranks on 2 cores
  assert pool(1, 2, range(8), 8) == "4"
  assert pool(1, 3, range(8), 8) == "2"
  assert pool(2, 2, range(8), 8) == "4"  # the share is 4: 2 per device already
  assert pool(2, 2, range(2), 2) == "4"  # at least 2 per device, share or not
  assert pool(1, 1, range(8), 8) is None  # the node alone
  assert pool(1, 2, [3], 8) is None  # its launcher gave it its own cores
  assert pool(1, 4, [1], 2) is None  # bound to one core (more ranks than cores): XLA sees 1


def test_users_small_cpu_thread_pool_wins_with_a_warning(monkeypatch, caplog):
  from mpijax._src import device_setup

  monkeypatch.delenv("NPROC", raising=False)
  monkeypatch.setenv("PJRT_NPROC", "3")
  device_setup._size_cpu_pool(2)
  assert device_setup.os.environ["PJRT_NPROC"] == "3"
  [record] = [r for r in caplog.records if r.name == "mpijax"]
  text = record.getMessage()
  assert record.levelname == "WARNING" and ": warning: JAX's CPU client has 3 threads" in text, text
  assert "3 threads for 2 local devices" in text and "PJRT_NPROC=4" in text, text
  caplog.clear()
  monkeypatch.setenv("PJRT_NPROC", "4")
  device_setup._size_cpu_pool(2)
  assert not [r for r in caplog.records if r.name == "mpijax"]
