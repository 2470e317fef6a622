"""``python -m mpijax.run script.py [args]``: an alias of ``python -m mpijax``.

Runs a program so that an uncaught exception on any rank aborts the whole
MPI job (like ``python -m mpi4py``), after setting the rank's torchrun-style
variables. Also accepts ``-m module``, ``-c code`` and ``--exec PROGRAM``.
"""

import sys

from mpijax._src.rank_env import main as main

if __name__ == "__main__":
  main(sys.argv[1:])
