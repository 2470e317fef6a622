"""``mpijax-run`` / ``python -m mpijax.launch``: start an mpijax job on N ranks.

Usage::

  mpijax-run -n N [--devices-per-process K] [--hostfile F | --hosts h1:s1,h2:s2]
             [--timeout S] [--log-dir DIR [--tee]] [--max-restarts N [--min-ranks M]]
             [--dry-run] -- PROGRAM ARGS

The console script calls ``sys.exit(main())``; :func:`main` returns the job's
exit status. See :mod:`mpijax._src.run` for what the command adds and why.
"""

from __future__ import annotations

from mpijax._src.run.cli import main as main

__all__ = ["main"]

if __name__ == "__main__":
  import sys

  sys.exit(main())
