"""A PNG summary of one step of a timeline file (matplotlib), and the
``python -m mpijax.timeline`` command that draws it."""

from __future__ import annotations

import argparse
import collections
import json
import sys
from collections.abc import Sequence
from typing import Any

from mpijax._src.timeline.merge import STEPS_TID

_WAIT_COLOR = "#f4a261"
_TRANSFER_COLOR = "#2a6f97"
_STEP_COLOR = "#cccccc"


def _fmt(us: float) -> str:
  return f"{us / 1000:.2f} ms" if us >= 1000 else f"{us:.1f} µs"


def _load(path: str) -> dict[str, Any]:
  with open(path) as f:
    trace = json.load(f)
  if not isinstance(trace, dict) or "traceEvents" not in trace:
    raise ValueError(f"{path} is not a timeline file (no 'traceEvents')")
  return trace


def step_window(events: list[dict[str, Any]], step: int | None) -> tuple[float, float, str]:
  """(start, end, label) in µs of step ``step`` over all ranks, or of the whole trace."""
  steps: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
  for e in events:
    if e.get("ph") == "X" and e.get("tid") == STEPS_TID and e.get("cat") == "step":
      steps[e["pid"]].append(e)
  counts = {len(v) for v in steps.values()}
  if steps and min(counts) > 0:
    n = min(counts)
    k = n - 1 if step is None else step
    if not -n <= k < n:
      raise ValueError(f"--step {step} is out of range: the file has {n} steps (0..{n - 1})")
    k %= n
    chosen = [sorted(v, key=lambda e: e["ts"])[k] for v in steps.values()]
    # Counted from 1, as "of n" is: the last of 12 is "step 12 of 12" (--step 11 or -1).
    return (
      min(e["ts"] for e in chosen),
      max(e["ts"] + e["dur"] for e in chosen),
      f"step {k + 1} of {n}",
    )
  if step is not None:
    raise ValueError(
      "the file has no step spans (DataParallel.step, or "
      "mpijax.timeline.span(name, step=True)): render without --step to see the "
      "whole trace"
    )
  calls = [e for e in events if e.get("ph") == "X" and e.get("cat") == "mpijax"]
  if not calls:
    raise ValueError("the file has no mpijax calls")
  return (min(e["ts"] for e in calls), max(e["ts"] + e["dur"] for e in calls), "whole trace")


def waits_in(events: list[dict[str, Any]], start: float, end: float) -> dict[int, dict[int, float]]:
  """rank -> (rank waited for -> µs) over the calls that start in [start, end]."""
  out: dict[int, dict[int, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
  for e in events:
    if e.get("cat") != "mpijax" or not start <= e["ts"] <= end:
      continue
    who = e["args"].get("waited_for_rank")
    if who is not None:
      out[e["pid"]][who] += e["args"]["wait_ns"] / 1000.0
  return out


def render(trace_path: str, output: str, *, step: int | None = None) -> str:
  """Draws step ``step`` (default: the last) of ``trace_path`` into ``output``; a text summary.

  One row per rank and device: each mpijax call's wait for the other ranks
  and its transfer, the ranks' step bars above, and who waited for whom.
  Needs matplotlib. What ``python -m mpijax.timeline render`` runs.

  Args:
    trace_path: a timeline file (``MPIJAX_TIMELINE``'s JSON).
    output: the image to write (its suffix picks the format, e.g. ``.png``).
    step: which step span (0-based, negative counts from the end); default
      the last. A file without step spans is drawn whole (``step`` None).

  Returns:
    The summary: the window drawn and its length, then per rank how long it
    waited and for which rank most (or ``no rank waited``).

  Raises:
    OSError: ``trace_path`` cannot be read or ``output`` written.
    ValueError: ``trace_path`` is not a timeline file, ``step`` is out of
      range or given for a file without step spans, or the file has no
      mpijax calls.

  Examples:
    >>> print(render("trace.json", "step.png", step=-1))  # doctest: +SKIP
    step 9 of 10: 12.31 ms
    rank 0 waited 4.10 ms, most for rank 1 (4.10 ms)
  """
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.patches import Patch

  trace = _load(trace_path)
  events = trace["traceEvents"]
  start, end, label = step_window(events, step)
  span = max(end - start, 1e-3)
  rows = sorted(
    {(e["pid"], e["tid"]) for e in events if e.get("ph") == "X" and e.get("cat") == "mpijax"}
  )
  ranks = sorted({p for p, _ in rows} | {e["pid"] for e in events if e.get("ph") == "X"})
  # One row per (rank, device), plus the rank's step bar above its devices.
  y: dict[tuple[int, int], float] = {}
  pos = 0.0
  ticks, tick_labels = [], []
  has_steps = {e["pid"] for e in events if e.get("ph") == "X" and e.get("tid") == STEPS_TID}
  for r in ranks:
    if r in has_steps:
      y[(r, STEPS_TID)] = pos
      ticks.append(pos)
      tick_labels.append(f"rank {r} step")
      pos += 0.6
    for p, t in rows:
      if p == r:
        y[(p, t)] = pos
        ticks.append(pos)
        tick_labels.append(f"rank {r} dev {t - 1}")
        pos += 1.0
    pos += 0.4
  fig_h = 1.6 + 0.45 * pos
  fig, ax = plt.subplots(figsize=(11, fig_h))

  def clipped(ts: float, dur: float) -> tuple[float, float]:  # ms, within the window
    a, b = max(ts, start), min(ts + dur, end)
    return (a - start) / 1000.0, max(b - a, 0.0) / 1000.0

  for e in events:
    if e.get("ph") != "X" or e["ts"] + e["dur"] < start or e["ts"] > end:
      continue
    key = (e["pid"], e["tid"])
    if key not in y:
      continue
    if e["tid"] == STEPS_TID:
      x0, w = clipped(e["ts"], e["dur"])
      ax.barh(y[key], w, left=x0, height=0.35, color=_STEP_COLOR, edgecolor="#888888")
    elif e.get("cat") == "mpijax":
      a = e["args"]
      wait_ns, transfer_ns = a["wait_ns"], a["transfer_ns"]
      x0, w = clipped(e["ts"], wait_ns / 1000.0)
      ax.barh(y[key], w, left=x0, height=0.7, color=_WAIT_COLOR)
      x0, w = clipped(e["ts"] + wait_ns / 1000.0, transfer_ns / 1000.0)
      ax.barh(y[key], w, left=x0, height=0.7, color=_TRANSFER_COLOR)
  waits = waits_in(events, start, end)
  lines = []
  for r in ranks:
    if r not in waits:
      continue
    who, us = max(waits[r].items(), key=lambda kv: kv[1])
    total = sum(waits[r].values())
    text = f"rank {r} waited {_fmt(total)}, most for rank {who} ({_fmt(us)})"
    lines.append(text)
    ys = [v for (p, t), v in y.items() if p == r and t != STEPS_TID]
    ax.text(
      1.01,
      max(ys),
      f"waited {_fmt(total)},\n{_fmt(us)} for rank {who}",
      transform=ax.get_yaxis_transform(),
      va="center",
      fontsize=8,
    )
  ax.set_yticks(ticks, tick_labels, fontsize=8)
  ax.invert_yaxis()
  ax.set_xlim(0, span / 1000.0)
  ax.set_xlabel("ms from the start of the window (clocks aligned to rank 0)")
  ax.set_title(f"mpijax timeline: {label}, {span / 1000:.2f} ms", fontsize=10, pad=22)
  ax.legend(
    handles=[
      Patch(color=_WAIT_COLOR, label="waiting for the other ranks"),
      Patch(color=_TRANSFER_COLOR, label="moving / reducing data"),
      Patch(color=_STEP_COLOR, label="step (Python)"),
    ],
    loc="lower center",
    bbox_to_anchor=(0.5, 1.0),
    ncol=3,
    fontsize=8,
    frameon=False,
  )
  fig.subplots_adjust(left=0.12, right=0.8, top=1 - 0.9 / fig_h, bottom=0.6 / fig_h)
  fig.savefig(output, dpi=110)
  plt.close(fig)
  summary = [f"{label}: {_fmt(span)}"] + (lines or ["no rank waited"])
  return "\n".join(summary)


def main(argv: Sequence[str] | None = None) -> int:
  """``python -m mpijax.timeline render TRACE -o PNG [--step N]``."""
  parser = argparse.ArgumentParser(
    prog="python -m mpijax.timeline", description="Summaries of an mpijax timeline file."
  )
  sub = parser.add_subparsers(dest="command", required=True)
  r = sub.add_parser(
    "render",
    help="a PNG of one training step: per rank and device, each "
    "call's wait and transfer, and who waited for whom",
  )
  r.add_argument("trace", help="the JSON file MPIJAX_TIMELINE wrote")
  r.add_argument("-o", "--output", required=True, help="the PNG to write")
  r.add_argument(
    "--step",
    type=int,
    default=None,
    help="which step span (0-based, negative counts from the end; default: the "
    "last one); without step spans the whole trace",
  )
  args = parser.parse_args(argv)
  try:
    summary = render(args.trace, args.output, step=args.step)
  except (OSError, ValueError) as e:
    print(f"mpijax.timeline: {e}", file=sys.stderr)
    return 1
  print(summary)
  return 0
