"""``python -m mpijax script.py [args]``: run a program so that an uncaught
exception on any rank aborts the whole MPI job (like ``python -m mpi4py``).

Also accepts ``-m module`` and ``-c code``; ``--exec PROGRAM [args]`` runs any
executable instead (without the Python hooks); ``doctor`` runs the doctor's
checks on this rank (``mpirun -n 4 python -m mpijax doctor``). Either way the rank's
torchrun-style variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``) are set from the launcher's first. ``mpijax-run`` runs
programs this way; under another launcher, write it yourself: ``mpirun -n 4
python -m mpijax train.py``.
"""

import sys

from mpijax._src.run import rank as _rank

if __name__ == "__main__":
  if sys.argv[1:2] == ["doctor"]:
    from mpijax._src import doctor as _doctor

    _rank.apply()
    _doctor.main(sys.argv[2:])
  else:
    _rank.main(sys.argv[1:])
