"""The timeline's public functions (``mpijax.timeline``) and its command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mpijax._src import runtime
from mpijax._src.timeline import record


def start(path: str) -> None:
  """Starts recording the collective timeline into ``path`` (collective).

  ``mpijax.init(timeline=path)`` or ``MPIJAX_TIMELINE=path`` do this at
  start-up and write the file at exit; call this to record only part of a
  run, then :func:`finish`. The same path on every rank.
  """
  rt = runtime.get("mpijax.timeline.start()")
  record.start(path, rt.comm, hostnames=rt.topology.hostnames,
               devices=rt.local_device_count, drain=runtime._drain_at_exit)


def finish() -> str | None:
  """Stops recording; rank 0 merges every rank's events and writes the file.

  Collective. Returns the path written on rank 0, None on the other ranks
  (and when the timeline was not recording).
  """
  return record.finish(runtime._drain_at_exit)


def main(argv: Sequence[str] | None = None) -> int:
  """``python -m mpijax.timeline render TRACE -o PNG [--step N]``."""
  parser = argparse.ArgumentParser(prog="python -m mpijax.timeline",
                                   description="Summaries of an mpijax timeline file.")
  sub = parser.add_subparsers(dest="command", required=True)
  r = sub.add_parser("render", help="a PNG of one training step: per rank and device, each "
                     "call's wait and transfer, and who waited for whom")
  r.add_argument("trace", help="the JSON file MPIJAX_TIMELINE wrote")
  r.add_argument("-o", "--output", required=True, help="the PNG to write")
  r.add_argument("--step", type=int, default=None,
                 help="which step span (0-based, negative counts from the end; default: the "
                      "last one); without step spans the whole trace")
  args = parser.parse_args(argv)
  from mpijax._src.timeline import render
  try:
    summary = render.render(args.trace, args.output, step=args.step)
  except (OSError, ValueError) as e:
    print(f"mpijax.timeline: {e}", file=sys.stderr)
    return 1
  print(summary)
  return 0
