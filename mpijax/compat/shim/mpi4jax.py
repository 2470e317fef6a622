"""``import mpi4jax`` as ``mpijax.compat.mpi4jax``: this directory first on
``PYTHONPATH`` runs a program written for mpi4jax unchanged
(``python -m mpijax.compat.shim`` prints the directory; docs/mpi4jax.md)."""

import sys

import mpijax.compat.mpi4jax as _compat

sys.modules[__name__] = _compat
