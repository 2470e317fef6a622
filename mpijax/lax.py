"""Collectives with ``jax.lax`` signatures whose named axes span every rank.

Swap ``jax.lax.psum`` for ``mpijax.lax.psum`` (and ``jax.pmap`` /
``jax.shard_map`` for ``mpijax.pmap`` / ``mpijax.shard_map``) and the axis
covers every device of every MPI rank.
"""

from mpijax._src.collectives.parallel import all_gather as all_gather
from mpijax._src.collectives.parallel import all_to_all as all_to_all
from mpijax._src.collectives.parallel import axis_index as axis_index
from mpijax._src.collectives.parallel import axis_size as axis_size
from mpijax._src.collectives.parallel import pbroadcast as pbroadcast
from mpijax._src.collectives.parallel import pmax as pmax
from mpijax._src.collectives.parallel import pmean as pmean
from mpijax._src.collectives.parallel import pmin as pmin
from mpijax._src.collectives.parallel import ppermute as ppermute
from mpijax._src.collectives.parallel import psum as psum
from mpijax._src.collectives.parallel import psum_scatter as psum_scatter

__all__ = [
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "pbroadcast",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "psum",
    "psum_scatter",
]
