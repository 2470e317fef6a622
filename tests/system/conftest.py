"""Shared helpers for the system tests (real Slurm, multi-host namespaces).

Both need root, change machine state (daemons, network namespaces) and undo
it in finalizers; every subprocess they start is bounded by a timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
HERE = Path(__file__).resolve().parent

# Helper modules (slurm_cluster.py, netns.py) live beside the tests.
if str(HERE) not in sys.path:
  sys.path.insert(0, str(HERE))


def read_reports(outdir: Path) -> list[dict]:
  """The rank-<i>.json files written by rank_report.py, in rank order."""
  import json
  files = sorted(outdir.glob("rank-*.json"), key=lambda p: int(p.stem.split("-")[1]))
  return [json.loads(p.read_text()) for p in files]


# The sums rank_report.py computes, each by mpijax's own transport.
SUM_PATHS = ("mpijax.ops.allreduce", "jit(mpijax.ops.allreduce)", "mpijax.lax.psum")


def assert_mpijax_sums(report: dict, size: int) -> None:
  """The rank computed every sum with mpijax's transport, and each is right."""
  assert sorted(report.get("sums", {})) == sorted(SUM_PATHS), report
  assert report["sums"] == {path: size * (size + 1) / 2 for path in SUM_PATHS}, report


@pytest.fixture
def report_dir(tmp_path: Path) -> Path:
  d = tmp_path / "reports"
  d.mkdir()
  os.chmod(tmp_path, 0o755)
  return d


def run(argv: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
  """subprocess.run with output captured as text and a mandatory timeout."""
  return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
