"""The cross-rank checks of the parts a GlobalArray is built from.

:meth:`GlobalArray.from_process_local` and :meth:`GlobalArray.from_global`
take host data from every rank. Before any rank keeps its part, one small
allgather tells every rank whether the ranks' data fit one global array
(shapes, dtypes, spec) and whether the ranks meant to hold copies of a block
passed equal values; a misfit raises the same error on every rank, naming
the ranks. The digests compared are :mod:`.mpi_util`'s.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from mpijax._src import config
from mpijax._src import mpi_util
from mpijax._src.runtime.state import Runtime
from mpijax._src.sharding.geometry import Index
from mpijax._src.sharding.geometry import block_counts
from mpijax._src.sharding.geometry import check_contiguous
from mpijax._src.sharding.geometry import check_divisible
from mpijax._src.sharding.geometry import normalize_spec
from mpijax._src.sharding.geometry import process_block_counts
from mpijax._src.sharding.geometry import process_boxes
from mpijax._src.sharding.geometry import process_index_of
from mpijax._src.sharding.geometry import replicated_axes
from mpijax._src.sharding.mesh import GlobalMesh


def check_process_local(
  rt: Runtime, data: Any, mesh: GlobalMesh, spec
) -> tuple[tuple[int, ...], PartitionSpec]:
  """Checks each rank's part for ``GlobalArray.from_process_local`` (collective).

  Args:
    rt: this rank's runtime (``runtime.get``).
    data: this rank's part, a ``jax.Array`` or a NumPy array.
    mesh: the mesh.
    spec: the ``PartitionSpec`` as the user gave it.

  Returns:
    The global shape the ranks' parts make, and the normalized spec.

  Raises:
    ValueError: on every rank, as documented at ``GlobalArray.from_process_local``.
  """
  check = bool(config.get("check"))
  status: dict[str, Any] = {}
  try:
    nspec = normalize_spec(spec, np.ndim(data), mesh)
    check_contiguous(mesh, nspec)
    counts = process_block_counts(mesh, nspec)
    lshape = tuple(np.shape(data))
    for d, (n, k, c) in enumerate(zip(lshape, block_counts(mesh, nspec), counts)):
      per_rank = k // c  # devices of one rank along d
      if n % per_rank:
        raise ValueError(
          f"dimension {d} of its part (shape {lshape}) has size {n}, not divisible by its "
          f"{per_rank} local devices sharding it (PartitionSpec {nspec})"
        )
    status = {
      "shape": [n * c for n, c in zip(lshape, counts)],
      "dtype": np.dtype(data.dtype).name,
    }
  except (ValueError, TypeError) as e:
    status = {"error": str(e)}
  if "error" not in status and rt.size > 1:  # one rank: nothing to compare with
    if check:
      status.update(check=1, digest=mpi_util.value_digest(data))
    elif not isinstance(data, jax.Array):
      status["sample"] = mpi_util.sample_digest(data)
  reports = [json.loads(s) for s in mpi_util.allgather_str(rt.comm, json.dumps(status))]
  errors = [(r, s["error"]) for r, s in enumerate(reports) if "error" in s]
  if errors:
    raise ValueError(
      "GlobalArray.from_process_local: " + "; ".join(f"rank {r}: {e}" for r, e in errors[:8])
    )
  keys = [(tuple(s["shape"]), s["dtype"]) for s in reports]
  # Ties (e.g. two ranks) go to the lowest rank's view.
  majority = max(set(keys), key=lambda k: (keys.count(k), -keys.index(k)))
  odd = [r for r, k in enumerate(keys) if k != majority]
  if odd:
    raise ValueError(
      "GlobalArray.from_process_local: the ranks' parts do not fit one global array "
      f"(PartitionSpec {nspec}, mesh {mesh}). Most ranks' parts imply global shape "
      f"{majority[0]} dtype {majority[1]}, but "
      + ", ".join(f"rank {r}'s part (global {keys[r][0]} {keys[r][1]})" for r in odd[:8])
      + " does not. Give every rank the block mesh and spec assign to it "
      "(global shape divided by the number of process blocks along each dimension)."
    )
  mpi_util.mixed_check("GlobalArray.from_process_local", [bool(s.get("check")) for s in reports])
  digests = [s.get("digest" if check else "sample") for s in reports]
  if rt.size > 1 and any(d is not None for d in digests):
    diffs = mpi_util.differing_copies(process_boxes(majority[0], mesh, nspec), digests)
    if diffs:
      axes = replicated_axes(mesh, nspec)
      raise ValueError(
        f"GlobalArray.from_process_local: ranks that hold the same block of the global "
        f"{majority[0]} {majority[1]} array (PartitionSpec {nspec}, mesh {mesh}; they differ "
        f"only along mesh axes {axes}, which the spec does not name) passed different "
        f"values ({mpi_util.how_compared(check)}): {mpi_util.copies_text(diffs, blocks=True)}. Pass equal "
        "copies on those ranks (e.g. the same seed for random data), or, if each rank's "
        f"data is its own, name {' and '.join(repr(a) for a in axes)} in the spec so that "
        "each rank holds its own block."
      )
  return majority[0], nspec


def check_global(
  rt: Runtime, host: np.ndarray, mesh: GlobalMesh, spec
) -> tuple[PartitionSpec, Index]:
  """Checks the whole arrays the ranks passed to ``GlobalArray.from_global`` (collective).

  Args:
    rt: this rank's runtime (``runtime.get``).
    host: the whole array as this rank passed it.
    mesh: the mesh.
    spec: the ``PartitionSpec`` as the user gave it.

  Returns:
    The normalized spec, and the index of this rank's part in ``host``.

  Raises:
    ValueError: on every rank, as documented at ``GlobalArray.from_global``.
  """
  check = bool(config.get("check"))
  shape_text = f"{host.dtype.name}{list(host.shape)}"
  # A bad spec raises only after the collective: ranks whose shapes differ
  # could otherwise disagree on raising before it and leave the others waiting.
  error: ValueError | None = None
  try:
    nspec = normalize_spec(spec, host.ndim, mesh)
    check_divisible(host.shape, mesh, nspec, "GlobalArray.from_global")
    check_contiguous(mesh, nspec)
    box = process_index_of(host.shape, mesh, nspec, rt.rank)
  except (ValueError, TypeError) as e:
    error = e
  status: dict[str, Any] = {"shape": shape_text, "check": check}
  if rt.size > 1 and error is None:  # one rank: nothing to compare with
    if check:
      status["digest"] = mpi_util.value_digest(host)
    else:
      status["sample"] = mpi_util.sample_digest(host[box])
  reports = [json.loads(t) for t in mpi_util.allgather_str(rt.comm, json.dumps(status))]
  rank = next((r for r, t in enumerate(reports) if t["shape"] != reports[0]["shape"]), None)
  if rank is not None:
    raise ValueError(
      f"GlobalArray.from_global needs the same whole array on every rank, but rank 0 "
      f"passed {reports[0]['shape']} and rank {rank} passed {reports[rank]['shape']}. Pass "
      "the same array everywhere, or each rank's own block with "
      "GlobalArray.from_process_local."
    )
  if error is not None:
    raise error
  mpi_util.mixed_check("GlobalArray.from_global", [t["check"] for t in reports])
  if check:  # the whole array, compared between all ranks
    diffs = mpi_util.differing_copies([None] * rt.size, [t.get("digest") for t in reports])
  else:  # the sampled part, compared between ranks that keep the same part
    diffs = mpi_util.differing_copies(
      process_boxes(host.shape, mesh, nspec), [t.get("sample") for t in reports]
    )
  if diffs:
    raise ValueError(
      f"GlobalArray.from_global needs the same whole array on every rank, but the ranks "
      f"passed {shape_text} arrays with different values ({mpi_util.how_compared(check)}): "
      f"{mpi_util.copies_text(diffs, blocks=not check)}. Pass the same array everywhere (e.g. seed "
      "random data the same way on every rank), or give each rank's own block to "
      "GlobalArray.from_process_local with a spec that names the mesh axis the ranks' "
      "data differs along."
    )
  return nspec, box
