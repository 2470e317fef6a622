"""tests/compat/mpi4jax_suite.py fails on a skip mpi4jax's suite would not make, and on
one of its own skips that did not happen, at each rank and rank count."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "compat"))
import mpi4jax_suite  # noqa: E402

ALLREDUCE = "tests/collective_ops/test_allreduce.py::test_allreduce"


@pytest.mark.parametrize("ranks,skips", [(1, [17]), (2, [0, 2]), (4, [0, 2, 13, 13])])
def test_the_pinned_skips_per_rank(ranks, skips):
  assert [len(mpi4jax_suite.expected_skips(r, ranks)) for r in range(ranks)] == skips


def _results(tmp_path, ranks, skipped_by_rank):
  for rank in range(ranks):
    outcomes = {ALLREDUCE: {"outcome": "passed", "detail": ""}}
    outcomes.update({n: {"outcome": "skipped", "detail": "x"} for n in skipped_by_rank[rank]})
    (tmp_path / f"rank-{rank}.json").write_text(json.dumps({"outcomes": outcomes}))
  return tmp_path


def test_check_accepts_exactly_the_suites_own_skips(tmp_path):
  skipped = [sorted(mpi4jax_suite.expected_skips(r, 4)) for r in range(4)]
  problems, _ = mpi4jax_suite.check(4, 0, _results(tmp_path, 4, skipped))
  assert problems == []


def test_check_fails_on_a_skip_more_or_one_fewer(tmp_path):
  skipped = [sorted(mpi4jax_suite.expected_skips(r, 4)) for r in range(4)]
  skipped[1].append(ALLREDUCE + "[float32]")  # a test the suite runs at 4 ranks
  dropped = skipped[3].pop()  # a test the suite skips on rank 3
  problems, _ = mpi4jax_suite.check(4, 0, _results(tmp_path, 4, skipped))
  assert problems == [
    f"rank 1: skipped, but mpi4jax's suite runs it at 4 ranks: {ALLREDUCE}[float32]",
    f"rank 3: ran, but mpi4jax's suite skips it at 4 ranks: {dropped}",
  ]
