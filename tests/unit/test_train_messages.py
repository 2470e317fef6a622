"""How the training layer words what it prints (no MPI): the problems of several
ranks in one error, the progress bar under a launcher."""

from __future__ import annotations

import io

import pytest

from mpijax._src.mpi_util import rank_lines


def test_ranks_with_the_same_problem_share_a_line():
  bad = [(0, "no file"), (1, "no file"), (2, "no file"), (3, "bad dtype"), (5, "no file")]
  assert rank_lines(bad) == "  ranks 0-2, 5: no file\n  rank 3: bad dtype"


def test_many_different_problems_are_cut():
  text = rank_lines([(r, f"problem {r}") for r in range(10)], limit=8)
  assert text.splitlines()[0] == "  rank 0: problem 0"
  assert text.splitlines()[-1] == "  ... and 2 more different problems"


def test_the_bar_under_a_launcher_counts_its_rate_after_the_compiling_first_step(monkeypatch):
  tqdm = pytest.importorskip("tqdm.auto").tqdm
  from mpijax._src.train import metrics

  clock = [100.0]
  monkeypatch.setattr(metrics.time, "monotonic", lambda: clock[0])

  def steps():
    for i in range(23):
      clock[0] += 6.0 if i == 0 else 0.2  # the first step compiles
      yield i

  out = io.StringIO()
  assert list(
    metrics._lines(steps(), tqdm, file=out, desc="epoch 1/12", total=23, unit="step", ncols=80)
  ) == list(range(23))
  first, *rest = out.getvalue().splitlines()
  # 6 s in, one step done: no rate, no time left yet (not 6 s per step, 2 minutes left).
  assert first.endswith("1/23 [00:06<?, ?step/s]"), first
  assert rest and rest[-1].endswith("23/23 [00:10<00:00,  5.00step/s]"), rest
