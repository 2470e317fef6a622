"""The transport layer: mpijax's MPI operations as JAX primitives.

One module per primitive (``allreduce``, ``allgather``, ``reduce_scatter``,
``alltoall``, ``bcast``, ``ppermute``, ``barrier``), on shared machinery:

* ``dtypes``: the dtypes and reduction ops the primitives accept.
* ``reduce_ops``: mpi4py ``MPI.Op`` objects as those reduction ops.
* ``settings``: the transport's settings, sent to the C++ side.
* ``communicators``: the registry of private communicator clones.
* ``primitive``: the primitive factory (eager and dead-code rules) and
  autodiff helpers.
* ``ordering``: the order-token chain that keeps MPI calls in program order.
* ``call_sites``: call sites and signatures for stall and mismatch reports.
* ``lowering``: the lowering of a primitive to an XLA FFI custom call.
* ``jax_rules``: the replacement of JAX's own lowering rules, installed
  once by ``import mpijax``.
"""
