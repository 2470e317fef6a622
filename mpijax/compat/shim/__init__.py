"""A directory to put first on ``PYTHONPATH``: in it, ``import mpi4jax`` is
``mpijax.compat.mpi4jax``, so a program written for mpi4jax runs unchanged.

    PYTHONPATH="$(python -m mpijax.compat.shim)" mpijax-run -n 4 -- python prog.py

Importing this package imports nothing else; ``DIR`` is the directory.
"""

import os as _os

DIR = _os.path.dirname(_os.path.abspath(__file__))

__all__ = ["DIR"]
