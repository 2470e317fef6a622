"""How the training layer lists the problems of several ranks in one error (no MPI)."""

from __future__ import annotations

from mpijax._src.mpi_util import rank_lines


def test_ranks_with_the_same_problem_share_a_line():
  bad = [(0, "no file"), (1, "no file"), (2, "no file"), (3, "bad dtype"), (5, "no file")]
  assert rank_lines(bad) == "  ranks 0-2, 5: no file\n  rank 3: bad dtype"


def test_many_different_problems_are_cut():
  text = rank_lines([(r, f"problem {r}") for r in range(10)], limit=8)
  assert text.splitlines()[0] == "  rank 0: problem 0"
  assert text.splitlines()[-1] == "  ... and 2 more different problems"
