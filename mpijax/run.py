"""``python -m mpijax.run script.py [args]``: run a program so that an uncaught
exception on any rank aborts the whole MPI job (like ``python -m mpi4py``).

Also accepts ``-m module`` and ``-c code``.
"""

import sys

from mpijax._src.failure import run_main as _run_main

if __name__ == "__main__":
  _run_main(sys.argv[1:])
