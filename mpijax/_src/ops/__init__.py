"""The transport layer: mpijax's MPI operations as JAX primitives.

One module per primitive: the collectives ``allreduce``, ``allreduce_many``
(a list in one call), ``device_allreduce`` (every local device of every
rank), ``allgather``, ``reduce_scatter``, ``alltoall``, ``bcast``,
``reduce``, ``gather``, ``scatter``, ``scan``, ``ppermute``, ``barrier``;
the point-to-point ``send``, ``recv`` and ``sendrecv`` (both the ppermute
step and mpi4jax's tagged ``MPI_Sendrecv``); and ``fence`` (the gates
``mpijax.train`` orders its overlapped all-reduce with). Where two
primitives are each other's transposes, the later module registers both
(``reduce`` for bcast, ``scatter`` for gather). On shared machinery:

* ``dtypes``: the dtypes and reduction ops the primitives accept.
* ``reduce_ops``: mpi4py ``MPI.Op`` objects as those reduction ops.
* ``peers``: roots, peers and tags checked as MPI would; a receive's status.
* ``communicators``: the registry of private communicator clones.
* ``primitive``: the primitive factory (eager and dead-code rules) and
  autodiff helpers.
* ``ordering``: the order-token chain that keeps MPI calls in program order.
* ``call_sites``: call sites and signatures for stall and mismatch reports.
* ``lowering``: the lowering of a primitive to an XLA FFI custom call.
* ``jax_rules``: the replacement of JAX's own lowering rules, installed
  once by ``import mpijax``.

The transport's settings go to the C++ side through ``ffi.settings``.
"""
