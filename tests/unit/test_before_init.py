"""Misuse around mpijax.init(): collectives before it, bad arguments, a second
call with other arguments, a script started without a launcher; each is
named with the fix."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests._launch import REPO

# Variables by which a launcher (or mpijax-run) would say who this process is.
_LAUNCH_VARS = ("OMPI_", "PMI_", "PMIX_", "SLURM_", "MPIJAX_", "PRTE_", "HYDRA_")


def _script(tmp_path, code: str, *flags: str, **env: str) -> subprocess.CompletedProcess:
  """``python [flags] job.py`` with ``code``, outside any launcher."""
  path = tmp_path / "job.py"
  path.write_text(code)
  clean = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_VARS)}
  return subprocess.run(
    [sys.executable, *flags, str(path)],
    capture_output=True,
    text=True,
    timeout=180,
    cwd=REPO,
    env={**clean, **env},
    stdin=subprocess.DEVNULL,
  )


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
  from mpijax._src.runtime import state as runtime

  with pytest.raises(ValueError, match=r"coordinator_address='127.0.0.1:abc'.*'host:port'"):
    runtime._check_arguments("127.0.0.1:abc", None, None)
  with pytest.raises(TypeError, match=r"devices_per_process='2'.*int >= 1"):
    runtime._check_arguments(None, "2", None)
  with pytest.raises(TypeError, match=r"comm='world'.*mpi4py communicator"):
    runtime._check_arguments(None, None, "world")
  runtime._check_arguments("node1:1234", 2, None)  # fine


def test_cpu_thread_pool_gets_two_threads_per_local_device(monkeypatch):
  """XLA's CPU client needs 2 threads per device for back-to-back multi-device calls."""
  from mpijax._src.runtime import devices as device_setup

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
  from mpijax._src.runtime import devices as device_setup

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
  from mpijax._src.runtime import devices as device_setup

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


SINGLE = "running as 1 rank: no MPI launcher started this process"


def test_a_script_without_a_launcher_says_once_that_it_is_1_rank(tmp_path):
  code = "import mpijax\nmpijax.init()\nmpijax.shutdown()\nmpijax.init()\nprint('done')\n"
  out = _script(tmp_path, code, MPIJAX_TIMOUT="5")
  assert out.returncode == 0 and out.stdout == "done\n", out.stderr
  # Once per process each: the misspelled setting, then the rank count.
  warning, notice = out.stderr.splitlines()
  assert warning.endswith(
    "warning: MPIJAX_TIMOUT is not an mpijax setting and is ignored (did you mean MPIJAX_TIMEOUT?)"
  ), warning
  assert SINGLE in notice, notice
  assert "mpijax-run -n N python job.py" in notice and "MPIJAX_LAUNCHER=single" in notice


@pytest.mark.parametrize(
  "code,flags",
  [
    ("mpijax.init(launcher='single')\nmpijax.shutdown()\nmpijax.init(size=1)", ()),
    ("mpijax.init()", ("-i",)),  # an interactive session
  ],
)
def test_one_process_meant_is_not_told(tmp_path, code, flags):
  out = _script(tmp_path, f"import mpijax\n{code}\nprint('done')\n", *flags)
  assert out.returncode == 0 and "done" in out.stdout, out.stderr
  assert SINGLE not in out.stderr, out.stderr


def test_a_second_init_with_other_arguments_raises_naming_both(tmp_path):
  code = (
    "import mpijax\n"
    "rt = mpijax.init(abort_on_exception=False)\n"
    "assert mpijax.init() is rt and mpijax.init(devices_per_process=1, size=1) is rt\n"
    "try:\n"
    "  mpijax.init(devices_per_process=2, timeline='t.json')\n"
    "except RuntimeError as e:\n"
    "  print(e)\n"
  )
  out = _script(tmp_path, code, MPIJAX_LAUNCHER="single")
  assert out.returncode == 0, out.stderr
  assert SINGLE not in out.stderr, out.stderr  # MPIJAX_LAUNCHER=single: 1 rank meant
  text = out.stdout
  assert text.startswith("mpijax.init() was called again, with "), text
  assert "devices_per_process=2 (the runtime runs with devices_per_process=1)" in text, text
  assert "timeline='t.json' (the runtime runs with timeline=None)" in text, text
  assert "the first call, init(abort_on_exception=False), started the runtime" in text, text
  assert "mpijax.shutdown()" in text, text


def test_a_second_init_compares_with_what_the_runtime_chose():
  from mpijax._src.runtime import state as runtime

  topology = runtime.Topology(
    rank=1,
    size=4,
    local_rank=1,
    local_size=4,
    node_index=0,
    node_count=1,
    hostnames=("h",) * 4,
    coordinator_address="127.0.0.1:5",
    launcher="prrte",
  )
  world = object()
  rt = runtime.Runtime(
    topology=topology,
    comm=None,
    local_devices=["d0"],
    device_table=(),
    jax_distributed=True,
    _world_comm=world,
    _first_call={"abort_on_exception": True, "timeline": "", "args": {}},
  )
  same = dict(
    launcher="prrte",
    rank=1,
    size=4,
    local_rank=1,
    local_size=4,
    coordinator_address="127.0.0.1:5",
    devices_per_process=1,
    jax_distributed=True,
    comm=world,
    abort_on_exception=True,
    timeline=None,
  )
  runtime._check_same_as_first(rt, same)  # what the runtime runs with: fine
  runtime._check_same_as_first(rt, dict.fromkeys(same))  # nothing given: fine
  for name, value, have in [
    ("jax_distributed", False, "jax_distributed=True"),
    ("devices_per_process", 2, "devices_per_process=1"),
    ("launcher", "slurm", "launcher='prrte'"),
    ("rank", 0, "rank=1"),
    ("coordinator_address", "10.0.0.1:7", "coordinator_address='127.0.0.1:5'"),
    ("abort_on_exception", False, "abort_on_exception=True"),
    ("comm", object(), "runs on <object"),
  ]:
    with pytest.raises(RuntimeError, match=r"init\(\) was called again") as e:
      runtime._check_same_as_first(rt, {**dict.fromkeys(same), name: value})
    assert f"{name}={value!r}" in str(e.value) and have in str(e.value), str(e.value)
