"""One core per rank where a node has more ranks than cores (mpijax/_src/run/cpu_bind.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mpijax._src.run import cpu_bind


def test_round_robin_only_where_ranks_exceed_cores():
  assert [cpu_bind.choose(r, 4, [0, 1], 2) for r in range(4)] == [0, 1, 0, 1]
  assert [cpu_bind.choose(r, 3, [5, 2], 2) for r in range(3)] == [2, 5, 2]  # sorted
  assert cpu_bind.choose(1, 2, [0, 1], 2) is None  # a core per rank: XLA keeps every core
  assert cpu_bind.choose(0, 1, [0, 1, 2, 3], 4) is None
  assert cpu_bind.choose(None, 4, [0, 1], 2) is None and cpu_bind.choose(0, None, [0], 1) is None
  # Already bound by its launcher (2 of 8 cores for each of 4 ranks): left alone.
  assert cpu_bind.choose(3, 4, [6, 7], 8) is None


_PROBE = "import json, os, mpijax; print(json.dumps(sorted(os.sched_getaffinity(0))))"
# Whether the import found the node oversubscribed, and what the transport's settings got.
_WAITS = ("import json, mpijax; from mpijax._src.run import cpu_bind; "
          "from mpijax._src.ffi import settings; "
          "print(json.dumps([cpu_bind.oversubscribed(), settings._oversubscribed]))")


def _after_import(local_rank: int, local_size: int, probe: str = _PROBE, **extra: str):
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("OMPI_", "PMI_", "PMIX_", "PRTE", "SLURM_", "MPIJAX_"))}
  env.update({
    "OMPI_COMM_WORLD_RANK": str(local_rank), "OMPI_COMM_WORLD_SIZE": str(local_size),
    "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank),
    "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size), "PRTE_LAUNCHED": "1", **extra,
  })
  out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 0, out.stderr
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_import_binds_an_oversubscribed_rank_and_only_that():
  cpus = sorted(os.sched_getaffinity(0))
  n = len(cpus)
  assert _after_import(n + 1, 2 * n + 1) == [cpus[(n + 1) % n]]
  assert _after_import(n + 1, 2 * n + 1, MPIJAX_CPU_BIND="none") == cpus
  assert _after_import(n + 1, 2 * n + 1, MPIJAX_XLA_COLLECTIVES="gloo") == cpus
  assert _after_import(n - 1, n) == cpus  # a core per rank


def test_waits_yield_where_ranks_outnumber_the_cores_bound_or_not():
  online = os.cpu_count()
  assert _after_import(0, online + 1, _WAITS) == [True, True]
  assert _after_import(0, online + 1, _WAITS, MPIJAX_CPU_BIND="none") == [True, True]
  assert _after_import(0, online + 1, _WAITS, MPIJAX_XLA_COLLECTIVES="gloo") == [True, True]
  assert _after_import(0, online, _WAITS) == [False, False]
