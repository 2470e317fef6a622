"""``python -m mpijax script.py [args]``: run a program so that an uncaught
exception on any rank aborts the whole MPI job (like ``python -m mpi4py``).

Also accepts ``-m module`` and ``-c code``; ``--exec PROGRAM [args]`` runs any
executable instead (without the Python hooks). Either way the rank's
torchrun-style variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``) are set from the launcher's first. ``mpijax-run`` runs
programs this way; under another launcher, write it yourself: ``mpirun -n 4
python -m mpijax train.py``.
"""

import sys

from mpijax._src.run.rank import main as _main

if __name__ == "__main__":
  _main(sys.argv[1:])
