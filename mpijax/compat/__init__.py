"""Other libraries' APIs on mpijax's transport, for programs written for them.

* :mod:`mpijax.compat.mpi4jax`: mpi4jax's functions (``import
  mpijax.compat.mpi4jax as mpi4jax`` is the whole migration).
"""

__all__: list[str] = []
