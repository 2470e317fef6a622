"""Every rank raises the same one-line error: mpijax.save to a path that exists."""

import tempfile

import numpy as np
from jax.sharding import PartitionSpec as P

import mpijax

rt = mpijax.init()
path = mpijax._src.mpi_util.bcast_str(rt.comm, tempfile.mkdtemp() if rt.rank == 0 else None)
mesh = mpijax.make_mesh((rt.size,), ("x",))
w = mpijax.GlobalArray.from_global(np.arange(8.0), mesh, P("x"))
mpijax.save(f"{path}/ckpt", {"w": w})
mpijax.save(f"{path}/ckpt", {"w": w})  # exists: an OSError on every rank
