"""benchmarks/_common: a target's verdict never disagrees with the figure it prints."""

from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import _common  # noqa: E402
from _common import Row  # noqa: E402
from _common import Timing  # noqa: E402


def _targets(**medians: float) -> _common.Targets:
  rows = [
    Row(k, k, "mpi", {4: Timing(median_us=v, rank_medians_us=[v], iters=1, trials=1)})
    for k, v in medians.items()
  ]
  return _common.Targets(rows)


@pytest.mark.parametrize(
  "value,limit,at_least,verdict,shown",
  [
    (1.1019, 1.1, False, False, "1.102"),  # once printed "1.10x FAIL"
    (1.1004, 1.1, False, True, "1.100"),
    (1.0996, 1.1, False, True, "1.100"),
    (0.0996, 0.1, False, True, "0.100"),
    (9.9994, 10, True, False, "9.999"),
    (10.0004, 10, True, True, "10.000"),
  ],
)
def test_the_verdict_is_taken_on_the_printed_figure(value, limit, at_least, verdict, shown):
  assert _common.judged(value, limit, at_least=at_least) == (verdict, shown)


def test_every_ratio_line_reads_the_same_as_its_verdict():
  t = _targets(a=110.19, b=100.0, c=99.96, d=1000.0, e=100.04)
  t.ratio("a <= 1.1x b", t.get("a", 4), t.get("b", 4), 1.1)
  t.ratio("c <= 1x b", t.get("c", 4), t.get("b", 4), 1.0)
  t.ratio("d >= 10x e", t.get("d", 4), t.get("e", 4), 10, at_least=True)
  t.ratio("a <= 1x missing", t.get("a", 4), t.get("nothing", 4), 1.0)
  t.at_most("e <= 100 us", t.get("e", 4), 100)
  assert t.lines == [
    "FAIL  a <= 1.1x b: 110.2 / 100.0 us = 1.102x",
    "PASS  c <= 1x b: 100.0 / 100.0 us = 1.000x",
    "FAIL  d >= 10x e: 1000.0 / 100.0 us = 9.996x",
    "N/A   a <= 1x missing: missing",
    "FAIL  e <= 100 us: 100.04 us",
  ]
  for line in t.lines[:3]:
    verdict, op, limit, figure = re.match(
      r"(\w+) .*?(<=|>=) ([\d.]+)x .*= ([\d.]+)x$", line
    ).groups()
    meets = float(figure) >= float(limit) if op == ">=" else float(figure) <= float(limit)
    assert verdict == ("PASS" if meets else "FAIL"), line
