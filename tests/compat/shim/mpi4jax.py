"""``import mpi4jax`` resolves to ``mpijax.compat.mpi4jax`` with this directory
first on PYTHONPATH (how mpi4jax's own test suite runs against mpijax)."""

import sys

import mpijax.compat.mpi4jax as _compat

sys.modules[__name__] = _compat
