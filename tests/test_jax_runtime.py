"""JAX's own runtime across the ranks: jax.distributed, and XLA's collectives over MPI.

Real jobs: under mpijax-run and under plain mpirun, jax or mpijax imported
first, one and several devices per rank (XLA's MPI collectives through
mpijax's bridge; gloo only where chosen), and the set-ups init() must refuse
on every rank.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests._launch import REPO
from tests._launch import run_mpi
from tests._launch import tail

SCRIPTS = REPO / "tests" / "scripts"
GLOO_WARNING = "XLA's cross-process collectives (jit over global jax.Arrays) use gloo, not MPI"


def _plain_mpirun(n: int, argv: list[str], env: dict[str, str] | None = None,
                  timeout: float = 240) -> subprocess.CompletedProcess:
  """``mpirun -n N argv`` itself (no mpijax-run, no python -m mpijax wrapper), bounded."""
  from mpijax._src.run import mpi_probe
  info = mpi_probe.probe_mpi()
  if info.flavor != "openmpi":
    pytest.skip(f"plain-mpirun tests use Open MPI's flags; mpi4py runs on {info.flavor}")
  cmd = ["timeout", "-k", "10", str(int(timeout)), mpi_probe.find_mpirun(info), "-n", str(n),
         "--oversubscribe", "--bind-to", "none"]
  if os.geteuid() == 0:
    cmd.append("--allow-run-as-root")
  full_env = {k: v for k, v in os.environ.items() if k != "MPITRAMPOLINE_LIB"}
  full_env.update(env or {})
  return subprocess.run(cmd + argv, capture_output=True, text=True, env=full_env,
                        cwd=str(REPO), timeout=timeout + 30, start_new_session=True)


# (ranks, devices per rank): with several, each (rank, local device) is a
# member of XLA's communicators.
LAYOUTS = [(4, 1), (2, 2), (4, 2), (3, 1)]


@pytest.mark.parametrize("ranks,local", LAYOUTS, ids=[f"{p}x{l}" for p, l in LAYOUTS])
def test_xla_collectives_travel_over_mpi(ranks, local):
  result, _ = run_mpi(ranks,
                      [sys.executable, str(SCRIPTS / "xla_collectives.py"), "--expect", "mpi"],
                      devices_per_process=local, timeout=300)
  out = result.stdout
  assert result.returncode == 0, tail(out)
  for r in range(ranks):
    assert f"XLA_COLLECTIVES rank {r} mpi ok" in out, tail(out)
  assert GLOO_WARNING not in out and "did not prepare" not in out, tail(out)


@pytest.mark.parametrize("order", ["--jax-first", "--no-hook"],
                         ids=["jax-first-the-hook-names-the-bridge", "mpijax-first-names-it-itself"])
def test_import_order_under_plain_mpirun(order):
  # jax first: the interpreter-start hook names the bridge before the program's
  # `import jax`. mpijax first, with what the hook named dropped: `import mpijax`
  # must name it before jaxlib loads.
  r = _plain_mpirun(2, [sys.executable, str(SCRIPTS / "xla_collectives.py"), order,
                        "--expect", "mpi"])
  out = r.stdout + r.stderr
  assert r.returncode == 0, tail(out)
  assert out.count(" mpi ok") == 2 and GLOO_WARNING not in out, tail(out)


def test_gloo_chosen_with_several_devices_per_rank_is_silent():
  result, _ = run_mpi(2, [sys.executable, str(SCRIPTS / "xla_collectives.py"), "--expect", "gloo"],
                      devices_per_process=2, env={"MPIJAX_XLA_COLLECTIVES": "gloo"},
                      timeout=300)
  out = result.stdout
  assert result.returncode == 0, tail(out)
  assert out.count(" gloo ok") == 2, tail(out)
  assert GLOO_WARNING not in out, tail(out)


def test_jax_first_without_the_bridge_uses_gloo_and_names_the_fix():
  r = _plain_mpirun(2, [sys.executable, str(SCRIPTS / "jax_setups.py"), "no-bridge"])
  out = r.stdout + r.stderr
  assert r.returncode == 0, tail(out)
  assert out.count("SETUP rank") == 2 and out.count(" gloo ok") == 2, tail(out)
  assert out.count(GLOO_WARNING) == 1, tail(out)
  assert "jax was imported before mpijax" in out and "MPITRAMPOLINE_LIB=" in out, tail(out)


@pytest.mark.parametrize("case,devices,env,expected", [
    ("backend-first", 1, {}, "Call mpijax.init() before using JAX"),
    ("user-dist-mismatch", 1, {}, "jax.distributed.initialize() was already called"),
], ids=["backend-first", "user-dist-mismatch"])
def test_bad_setups_are_refused_on_every_rank(case, devices, env, expected):
  result, seconds = run_mpi(2, [sys.executable, str(SCRIPTS / "jax_setups.py"), case],
                            devices_per_process=devices, env=env, timeout=180)
  out = result.stdout
  assert result.returncode != 0, tail(out)
  assert "SETUP rank" not in out, tail(out)
  for r in range(2):
    assert f"rank {r} refused: mpijax.init(): " in out, tail(out)
  assert out.count(expected) >= 2, tail(out)


def test_mpi_required_where_it_cannot_serve_is_refused_on_every_rank():
  # jax imported first with nothing naming the bridge (plain mpirun: no wrapper
  # imports mpijax before the program), and MPIJAX_XLA_COLLECTIVES=mpi.
  r = _plain_mpirun(2, [sys.executable, str(SCRIPTS / "jax_setups.py"), "mpi-required"],
                    env={"MPIJAX_XLA_COLLECTIVES": "mpi"})
  out = r.stdout + r.stderr
  assert r.returncode != 0, tail(out)
  assert "SETUP rank" not in out, tail(out)
  for rank in range(2):
    assert f"rank {rank} refused: mpijax.init(): " in out, tail(out)
  assert out.count("MPIJAX_XLA_COLLECTIVES=mpi, but XLA's MPI collectives cannot serve") >= 2, tail(
    out)
  assert "jax was imported before mpijax" in out, tail(out)


def test_the_users_own_jax_distributed_is_adopted():
  result, _ = run_mpi(2, [sys.executable, str(SCRIPTS / "jax_setups.py"), "user-dist"], timeout=180)
  out = result.stdout
  assert result.returncode == 0, tail(out)
  assert out.count(" mpi ok") == 2, tail(out)


def test_float16_all_gather_stops_the_job_with_the_fix():
  result, seconds = run_mpi(2, [sys.executable, str(SCRIPTS / "jax_setups.py"), "f16"], timeout=180)
  out = result.stdout
  assert result.returncode != 0, tail(out)
  assert "Unsupported primitive type for reduction: f16" in out, tail(out)
  assert "have no float16 all-reduce or all-gather" in out, tail(out)


def test_a_rank_that_never_joins_stops_the_job_instead_of_hanging():
  start = time.monotonic()
  result, _ = run_mpi(2, [sys.executable, str(SCRIPTS / "jax_setups.py"), "split-stall"],
                      env={"MPIJAX_TIMEOUT": "5"}, timeout=180)
  out = result.stdout
  assert result.returncode != 0, tail(out)
  assert time.monotonic() - start < 100, tail(out)  # rank 1 sleeps 120 s
  assert "waited 5 s for the other ranks to create a communicator" in out, tail(out)
  assert "SETUP rank 0" not in out, tail(out)
