"""The collective timeline: where each step's time goes, rank by rank.

``MPIJAX_TIMELINE=trace.json`` (or ``mpijax.init(timeline=...)``) records
every mpijax call on every rank and device, split into waiting for the other
ranks and moving data, plus the training steps, and rank 0 writes them
merged into one Chrome-trace / Perfetto JSON at exit. See docs/timeline.md.

Command line::

  python -m mpijax.timeline render trace.json -o step.png [--step N]
"""

from __future__ import annotations

from mpijax._src.runtime.state import finish_timeline as finish
from mpijax._src.runtime.state import start_timeline as start
from mpijax._src.timeline.record import active as active
from mpijax._src.timeline.record import span as span
from mpijax._src.timeline.render import main as main
from mpijax._src.timeline.render import render as render

__all__ = ["active", "finish", "main", "render", "span", "start"]

if __name__ == "__main__":
  import sys
  sys.exit(main())
