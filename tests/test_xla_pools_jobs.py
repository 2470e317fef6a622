"""Which jobs get XLA's pools kept from spinning (MPIJAX_XLA_SPIN=auto), seen from outside.

Real jobs under plain ``mpirun`` with Open MPI's binding of each rank to one
core: a node is oversubscribed when its ranks x local devices exceed the
cores its ranks may use together, whatever one rank's own mask holds. A
jaxlib whose library is not on the allow-list is left as built. Each job
prints its ranks' pools (tests/scripts/xla_pools_job.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests._launch import REPO
from tests._launch import tail

SCRIPT = str(REPO / "tests" / "scripts" / "xla_pools_job.py")
NOT_VERIFIED = "is not a build the pool patch was verified on"


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
  """One cache directory for the module's jobs: the first hashes jaxlib's library."""
  return str(tmp_path_factory.mktemp("cache"))


def _run(cmd: list[str], env: dict[str, str], timeout: float = 180) -> tuple[dict, str]:
  """Runs ``cmd`` bounded; each rank's XLA_POOLS line by rank, and the output."""
  full_env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
  full_env.update(env, MPIJAX_LOG_LEVEL="DEBUG")
  r = subprocess.run(
    ["timeout", "-k", "10", str(int(timeout))] + cmd,
    capture_output=True,
    text=True,
    env=full_env,
    cwd=str(REPO),
    timeout=timeout + 30,
    start_new_session=True,
  )
  out = r.stdout + r.stderr
  assert r.returncode == 0, f"exit {r.returncode}:\n{tail(out)}"
  ranks = {}
  for line in r.stdout.splitlines():
    if line.startswith("XLA_POOLS "):
      got = json.loads(line.split(" ", 1)[1])
      ranks[got["rank"]] = got
  return ranks, out


def _bound_job(devices: int, cache: str) -> tuple[dict, str]:
  """2 ranks, each bound by Open MPI to a core of its own, ``devices`` CPU devices each."""
  from mpijax._src.run import mpi_probe

  info = mpi_probe.probe_mpi()
  if info.flavor != "openmpi":
    pytest.skip(f"these jobs use Open MPI's binding flags; mpi4py runs on {info.flavor}")
  cmd = [mpi_probe.find_mpirun(info), "-n", "2", "--map-by", "core", "--bind-to", "core"]
  if os.geteuid() == 0:
    cmd.append("--allow-run-as-root")
  env = {"MPIJAX_DEVICES_PER_PROCESS": str(devices), "XDG_CACHE_HOME": cache}
  ranks, out = _run(cmd + [sys.executable, SCRIPT], env)
  assert sorted(ranks) == [0, 1], tail(out)
  # What the job is about: each rank's own mask is one core, and the two differ.
  assert [len(ranks[r]["cpus"]) for r in (0, 1)] == [1, 1], ranks
  assert ranks[0]["cpus"] != ranks[1]["cpus"], ranks
  return ranks, out


def _spinning(pools: list) -> bool:
  return len(pools) >= 2 and all(a == 1 and s == 5000 // n for n, a, s in pools)


def test_two_ranks_bound_to_a_core_each_keep_their_pools_spinning(cache):
  """2 ranks x 1 device on the node's 2 cores: not oversubscribed, though each
  rank's own mask holds one core."""
  ranks, out = _bound_job(1, cache)
  for r, got in ranks.items():
    assert _spinning(got["pools"]), (r, got)
    assert got["report"]["changed"] == 0 and not got["report"]["wanted"], got
    assert got["report"]["reason"] == (
      "this node's 2 ranks x 1 CPU device do not exceed the 2 cores they may use"
    ), got
    assert (
      f"rank {r}/2: XLA's CPU thread pools keep spinning: this node's 2 ranks x 1 CPU "
      "device do not exceed the 2 cores they may use." in out
    ), tail(out)


def test_two_ranks_of_two_devices_on_two_cores_quiet_their_pools(cache):
  """2 ranks x 2 devices on the node's 2 cores: oversubscribed."""
  ranks, out = _bound_job(2, cache)
  for r, got in ranks.items():
    report = got["report"]
    assert report["reason"] == "" and report["changed"] == report["pools"] >= 2, got
    quiet = [p for p in got["pools"] if p[1:] == [0, 0]]
    assert len(quiet) >= report["changed"], got
    assert f"rank {r}/2: XLA's CPU thread pools: {report['changed']} of " in out, tail(out)


def test_a_jaxlib_library_not_on_the_allow_list_is_left_as_built(cache):
  """One rank with MPIJAX_XLA_SPIN=off (spinning off on any node), and an
  allow-list whose digest does not match the loaded library: the pools spin,
  and the rank warns, naming the library's digest."""
  import jaxlib

  env = {
    "MPIJAX_XLA_SPIN": "off",
    "MPIJAX_DEVICES_PER_PROCESS": "2",
    "XDG_CACHE_HOME": cache,
  }
  ranks, out = _run([sys.executable, SCRIPT, "--mismatched-hash"], env)
  got = ranks[0]
  assert _spinning(got["pools"]), got  # read with the real allow-list: the pools are there
  report = got["report"]
  assert report["changed"] == 0 and report["wanted"], got
  digest = json.loads(open(os.path.join(cache, "mpijax", "jaxlib-sha256.json")).read())
  (entry,) = digest.values()
  assert report["reason"] == (
    f"jaxlib {jaxlib.__version__}'s libjax_common.so (sha256 {entry['sha256']}) {NOT_VERIFIED}"
  ), got
  assert f"warning: XLA's CPU thread pools keep spinning: {report['reason']}." in out, tail(out)
