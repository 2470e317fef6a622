"""pytest plugin for mpi4jax's suite under mpijax (``-p mpi4jax_suite_plugin``).

Leaves out the deviations (mpi4jax_deviations.py) and writes each rank's
outcomes to ``$MPIJAX_TEST_SUITE_RESULTS/rank-<rank>.json`` for
tests/compat/mpi4jax_suite.py to check.
"""

from __future__ import annotations

import json
import os

import pytest
from mpi4jax_deviations import deviation

_outcomes: dict[str, dict[str, str]] = {}
_deselected: list[str] = []


def pytest_collection_modifyitems(config, items):
  keep, drop = [], []
  for item in items:
    (drop if deviation(item.nodeid) else keep).append(item)
  if drop:
    config.hook.pytest_deselected(items=drop)
    items[:] = keep
    _deselected.extend(i.nodeid for i in drop)


def pytest_runtest_logreport(report):
  entry = _outcomes.setdefault(report.nodeid, {"outcome": "passed", "detail": ""})
  if report.failed:
    entry["outcome"] = "failed" if report.when == "call" else "error"
    entry["detail"] = (report.longreprtext or "")[-2000:]
  elif report.skipped and entry["outcome"] == "passed":
    entry["outcome"] = "skipped"
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    entry["detail"] = reason


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
  out_dir = os.environ.get("MPIJAX_TEST_SUITE_RESULTS")
  if not out_dir:
    return
  from mpi4py import MPI

  rank = MPI.COMM_WORLD.Get_rank()
  with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
    json.dump(
      {"exitstatus": int(exitstatus), "outcomes": _outcomes, "deselected": _deselected}, f, indent=1
    )
