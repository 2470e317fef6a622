"""Test layout.

* ``tests/unit``: plain pytest, no MPI.
* ``tests/mpi``: MPI tests (pytest-mpi's ``mpi`` marker, set by
  ``tests/mpi/conftest.py``): skipped unless pytest runs with ``--with-mpi``,
  as every rank of an MPI job does, e.g.
  ``mpirun -n 4 python -m pytest --with-mpi tests/mpi``.
  ``tests/test_multirank.py`` starts them that way under ``mpijax-run`` with
  4 ranks x 1 device, 2 ranks x 2 devices, 3 ranks and 1 rank, each bounded
  by a timeout.
* ``tests/system``: real Slurm and multi-host (network namespace) runs; need root.
"""
