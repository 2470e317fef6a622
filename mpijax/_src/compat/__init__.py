"""mpi4jax's API on mpijax's transport: ``api`` (public in mpijax.compat.mpi4jax), ``autodiff``."""
