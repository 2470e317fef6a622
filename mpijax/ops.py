"""MPI operations as JAX primitives: eager, inside ``jax.jit``, differentiable.

Each op works on an mpi4py communicator (default: the runtime's; always on a
private clone) and runs in the same order on every rank.
"""

from mpijax._src.ops.allreduce import allreduce as allreduce

__all__ = [
    "allreduce",
]
