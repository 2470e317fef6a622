"""GlobalArray: a sharded array that knows its global shape, mesh and spec.

Each rank holds only its *process-local part*: the block of the global array
held by its devices (the same block :func:`mpijax.shard_map` passes in and
out). That part is a ``jax.Array`` over the rank's local devices, sharded over
``mesh.local_mesh`` by ``geometry.local_spec(mesh, spec)``. A :class:`GlobalArray` pairs
it with the global shape, dtype, :class:`~mpijax.GlobalMesh` and
``PartitionSpec`` so that gathering, resharding, checkpointing and
visualizing can be done without the user doing index arithmetic. Which
block each device and each rank holds is :mod:`.geometry`'s; whether the host
parts the ranks pass fit one global array is checked in :mod:`.part_checks`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from mpijax._src import mpi_util
from mpijax._src.runtime import state as runtime
from mpijax._src.sharding import part_checks
from mpijax._src.sharding.geometry import Index
from mpijax._src.sharding.geometry import block_counts
from mpijax._src.sharding.geometry import check_contiguous
from mpijax._src.sharding.geometry import check_divisible
from mpijax._src.sharding.geometry import device_indices
from mpijax._src.sharding.geometry import index_shape
from mpijax._src.sharding.geometry import local_shape_of
from mpijax._src.sharding.geometry import local_sharding
from mpijax._src.sharding.geometry import normalize_spec
from mpijax._src.sharding.geometry import process_index_of
from mpijax._src.sharding.mesh import GlobalMesh

P = PartitionSpec


# --- the array ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shard:
  """One block held by one of this rank's devices."""

  index: Index  # into the global array
  device: Any  # the jax device
  global_device_index: int  # process_index * local_device_count + local index
  data: jax.Array


@jax.tree_util.register_pytree_node_class
class GlobalArray:
  """A global array sharded over every device of every rank.

  Build one with :meth:`from_process_local`, :meth:`from_global`,
  :meth:`from_callback`, :func:`zeros` or :func:`full`; never from the
  constructor. It is a pytree whose only child is ``.local``, so
  ``jax.tree.map(f, ga)`` and ``jax.jit`` of functions taking and returning
  GlobalArrays work on the local part and keep shape, mesh and spec.

  Args:
    local: this rank's part, a ``jax.Array`` sharded over ``mesh``'s local
      devices as ``spec`` says.
    shape: the global shape.
    dtype: the dtype.
    mesh: the :class:`~mpijax.GlobalMesh`.
    spec: the normalized ``PartitionSpec`` (one entry per dimension).

  Examples:
    >>> mesh = mpijax.make_mesh((mpijax.process_count(),), ("x",))  # doctest: +SKIP
    >>> ga = mpijax.GlobalArray.from_global(np.arange(16.).reshape(8, 2), mesh, P("x"))  # doctest: +SKIP
    >>> ga.local.shape  # this rank's rows  # doctest: +SKIP
    (2, 2)
    >>> ga.gather().sum()  # collective: every rank calls it  # doctest: +SKIP
    120.0
  """

  def __init__(
    self, local: Any, shape: Sequence[int], dtype: Any, mesh: GlobalMesh, spec: PartitionSpec
  ):
    self._local = local
    self._shape = tuple(int(s) for s in shape)
    self._dtype = np.dtype(dtype)
    self._mesh = mesh
    self._spec = spec

  # pytree: children = (local,), aux = (shape, dtype, mesh, spec)
  def tree_flatten(self):
    return (self._local,), (self._shape, self._dtype, self._mesh, self._spec)

  @classmethod
  def tree_unflatten(cls, aux, children):
    """The pytree protocol's rebuild: a GlobalArray around a new local part.

    Args:
      aux: ``(shape, dtype, mesh, spec)``, from :meth:`tree_flatten`.
      children: ``(local,)``, the new local part.

    Returns:
      The GlobalArray; its dtype follows the new local part.

    Raises:
      ValueError: the new local part changed shape (``jax.tree.map`` of a
        function that is not element-wise).
    """
    shape, dtype, mesh, spec = aux
    local = children[0]
    # After jax.tree.map the leaf may have a new dtype (x.astype); keep it honest.
    if hasattr(local, "dtype") and hasattr(local, "shape"):
      try:
        dtype = np.dtype(local.dtype)
      except TypeError:
        pass
      # A function that changes the shape (jnp.sum, a reshape, an index) applied
      # to the local part says nothing about the global array: without this
      # check the result claims the old global shape and gather() reads garbage.
      want = local_shape_of(shape, mesh, spec, runtime.get("GlobalArray").rank)
      got = tuple(local.shape) if isinstance(local.shape, (tuple, list)) else None
      if got is not None and got != want:
        raise ValueError(
          f"jax.tree.map/jax.jit on a GlobalArray (global shape {shape}, spec {spec}) gave "
          f"this rank's part shape {got}, but it must keep shape {want}: a GlobalArray "
          "leaf only takes shape-preserving (element-wise) functions, e.g. "
          "jax.tree.map(jnp.tanh, ga). For reductions, reshapes or indexing use "
          "mpijax.shard_map (with mpijax.lax collectives), mpijax.reshard, or work on "
          "ga.local (this rank's part) or ga.gather() (NumPy, collective)."
        )
    return cls(local, shape, dtype, mesh, spec)

  # --- attributes ---

  @property
  def local(self) -> jax.Array:
    """This rank's part: a ``jax.Array`` over its local devices."""
    return self._local

  @property
  def shape(self) -> tuple[int, ...]:
    return self._shape

  @property
  def dtype(self) -> np.dtype:
    return self._dtype

  @property
  def ndim(self) -> int:
    return len(self._shape)

  @property
  def size(self) -> int:
    return math.prod(self._shape)

  @property
  def mesh(self) -> GlobalMesh:
    return self._mesh

  @property
  def spec(self) -> PartitionSpec:
    return self._spec

  @property
  def sharding(self) -> NamedSharding:
    """The sharding of ``.local`` over this rank's devices."""
    return local_sharding(self._mesh, self._spec)

  @property
  def local_index(self) -> Index:
    """Where this rank's part sits in the global array."""
    return process_index_of(self._shape, self._mesh, self._spec, runtime.get("GlobalArray").rank)

  @property
  def addressable_shards(self) -> list[Shard]:
    """This rank's blocks, one per local device, with their global index."""
    offset = [s.start for s in self.local_index]
    rt = runtime.get("GlobalArray.addressable_shards")
    local_pos = {d: i for i, d in enumerate(rt.local_devices)}
    out = []
    for s in self._local.addressable_shards:
      index = tuple(
        slice(o + (sl.start or 0), o + (sl.stop if sl.stop is not None else n))
        for o, sl, n in zip(offset, s.index, self._local.shape)
      )
      out.append(
        Shard(index, s.device, rt.rank * rt.local_device_count + local_pos[s.device], s.data)
      )
    return sorted(out, key=lambda sh: sh.global_device_index)

  @property
  def global_devices(self) -> tuple[runtime.DeviceInfo, ...]:
    """Every device of the mesh, in global order (``mpijax.devices()``)."""
    return runtime.get("GlobalArray.global_devices").device_table

  @property
  def is_fully_replicated(self) -> bool:
    return all(k == 1 for k in block_counts(self._mesh, self._spec))

  def __repr__(self) -> str:
    return (
      f"GlobalArray(shape={self._shape}, dtype={self._dtype.name}, spec={self._spec}, "
      f"mesh={self._mesh!r})"
    )

  def __array__(self, *args, **kwargs):
    raise TypeError(
      "a GlobalArray cannot be turned into a NumPy array implicitly: each rank holds only its "
      "part. Call ga.gather() on every rank (collective) for the whole array, or use ga.local "
      "for this rank's part."
    )

  def __len__(self) -> int:
    if not self._shape:
      raise TypeError("len() of a 0-d GlobalArray")
    return self._shape[0]

  def __getitem__(self, index):
    raise TypeError(
      f"a GlobalArray cannot be indexed (ga[{index!r}]): each rank holds only its part. "
      "Index ga.local (this rank's part; ga.local_index says where it sits), ga.gather() "
      "(NumPy, collective), or slice inside mpijax.shard_map."
    )

  def __iter__(self):
    raise TypeError(
      "a GlobalArray cannot be iterated over: each rank holds only its part. "
      "Iterate over ga.local or ga.gather() (collective)."
    )

  def __copy__(self) -> GlobalArray:
    return GlobalArray(self._local, self._shape, self._dtype, self._mesh, self._spec)

  def __deepcopy__(self, memo) -> GlobalArray:
    # The mesh (and its MPI communicators) is shared, as jax.Array shares its devices.
    local = self._local.copy() if hasattr(self._local, "copy") else self._local
    return GlobalArray(local, self._shape, self._dtype, self._mesh, self._spec)

  def __reduce__(self):
    raise TypeError(
      "a GlobalArray cannot be pickled: it is one rank's part of an array spread over MPI "
      "ranks, tied to the job's devices and communicators. Save it with mpijax.save(path, "
      "tree) (collective), or pickle ga.local (this rank's part) or ga.gather() (NumPy)."
    )

  def block_until_ready(self) -> GlobalArray:
    """Waits until this rank's part is computed (local only: no communication)."""
    jax.block_until_ready(self._local)
    return self

  @property
  def nbytes(self) -> int:
    """Bytes of the whole global array (as ``jax.Array.nbytes``)."""
    return self.size * self._dtype.itemsize

  # --- derived arrays ---

  def with_local(self, local: Any) -> GlobalArray:
    """A GlobalArray with the same shape, mesh and spec and a new local part.

    For element-wise results: ``ga.with_local(jax.jit(jnp.sin)(ga.local))``.
    The dtype follows ``local``; it is moved to the expected sharding if needed.
    """
    local = jnp.asarray(local)
    want = index_shape(self.local_index)
    if tuple(local.shape) != want:
      raise ValueError(
        f"with_local got a local part of shape {tuple(local.shape)}, but this rank's part of "
        f"the global {self._shape} array (spec {self._spec}) has shape {want}. Only "
        "shape-preserving (element-wise) results can replace the local part; use reshard or "
        "mpijax.shard_map for anything else."
      )
    sharding = self.sharding
    if not local.sharding.is_equivalent_to(sharding, local.ndim):
      local = jax.device_put(local, sharding)
    return GlobalArray(local, self._shape, local.dtype, self._mesh, self._spec)

  def astype(self, dtype) -> GlobalArray:
    return self.with_local(self._local.astype(dtype))

  # --- constructors ---

  @classmethod
  def from_process_local(cls, local_data: Any, mesh: GlobalMesh, spec) -> GlobalArray:
    """From each rank's part (collective; the global shape is inferred).

    Each rank passes the block of the global array its devices hold (what
    ``mesh`` and ``spec`` assign to it; ranks that differ only along mesh axes
    not named in ``spec`` pass equal copies). Shapes and dtypes are checked
    across ranks with a small allgather: a rank whose part does not fit makes
    every rank raise an error naming it.

    The copies' values are compared in the same allgather. By default only a
    few sampled elements (at most 64, evenly spaced) of each NumPy part are
    hashed: that catches ranks passing their own data where the spec says
    they hold copies, never fails equal copies, and costs nothing measurable;
    ``jax.Array`` parts are not sampled (that would copy them to the host).
    With ``MPIJAX_CHECK=1`` every byte of every part is hashed (blake2b of a
    C-contiguous host copy; a ``jax.Array`` part is copied to the host) and
    compared between the ranks holding the same block: slower, and no extra
    collective either. Bytes are compared, so NaN payloads and -0.0 vs 0.0
    count as differences.

    Args:
      local_data: this rank's part (NumPy-convertible or a ``jax.Array``).
      mesh: the :class:`~mpijax.GlobalMesh` the array is laid over.
      spec: the ``PartitionSpec`` over ``mesh``'s axes (``None``: replicated);
        each sharded dimension must be divisible by the devices sharding it.

    Returns:
      The GlobalArray; its global shape is inferred from the ranks' parts.

    Raises:
      ValueError: on every rank, if any rank's part has the wrong number of
        dimensions, a shape that does not fit the others', or another dtype;
        if ranks holding the same block passed different values (the message
        names the ranks and the block); or if ``MPIJAX_CHECK`` is on for some
        ranks and off for others.
    """
    rt = runtime.get("GlobalArray.from_process_local")
    data = local_data if isinstance(local_data, jax.Array) else np.asarray(local_data)
    shape, nspec = part_checks.check_process_local(rt, data, mesh, spec)
    local = jax.device_put(data, local_sharding(mesh, nspec))
    return cls(local, shape, local.dtype, mesh, nspec)

  @classmethod
  def from_global(cls, host_array: Any, mesh: GlobalMesh, spec) -> GlobalArray:
    """From the whole array, present on every rank; each rank keeps its part.

    Collective: one small allgather (as in :meth:`from_process_local`) checks
    that every rank passed the same shape and dtype, and compares values. By
    default only a few sampled elements (at most 64, evenly spaced) of the
    part each rank keeps are compared, between the ranks that keep the same
    part: that catches, e.g., unseeded random data replicated over ranks,
    never fails equal arrays, and costs nothing measurable. With
    ``MPIJAX_CHECK=1`` every byte of the whole array is hashed on every rank
    (blake2b of a C-contiguous copy) and compared: slower, and no extra
    collective either. Bytes are compared, so NaN payloads and -0.0 vs 0.0
    count as differences.

    Args:
      host_array: the whole array (NumPy-convertible), the same on every
        rank.
      mesh: the :class:`~mpijax.GlobalMesh` the array is laid over.
      spec: the ``PartitionSpec`` over ``mesh``'s axes (``None``: replicated);
        each sharded dimension must be divisible by the devices sharding it.

    Returns:
      The GlobalArray; each rank keeps (on its devices) only its part.

    Raises:
      ValueError: on every rank, if the ranks passed arrays of different shapes
        or dtypes, or different values (the message names the ranks), or if
        ``MPIJAX_CHECK`` is on for some ranks and off for others.
    """
    host = np.asarray(host_array)
    rt = runtime.get("GlobalArray.from_global")
    nspec, box = part_checks.check_global(rt, host, mesh, spec)
    part = host[box]
    local = jax.device_put(part, local_sharding(mesh, nspec))
    return cls(local, host.shape, local.dtype, mesh, nspec)

  @classmethod
  def from_global_part(
    cls, part: Any, global_shape: Sequence[int], mesh: GlobalMesh, spec
  ) -> GlobalArray:
    """From this rank's part when the global shape is known on every rank (no communication).

    Args:
      part: this rank's part: the block ``mesh`` and ``spec`` assign to it.
      global_shape: the global shape, the same on every rank.
      mesh: the :class:`~mpijax.GlobalMesh` the array is laid over.
      spec: the ``PartitionSpec`` over ``mesh``'s axes (``None``: replicated);
        each sharded dimension must be divisible by the devices sharding it.

    Returns:
      The GlobalArray (nothing is checked across ranks).

    Raises:
      ValueError: ``part`` has another shape than this rank's part, or the
        spec does not fit the shape or the mesh.
    """
    shape = tuple(int(s) for s in global_shape)
    nspec = normalize_spec(spec, len(shape), mesh)
    check_divisible(shape, mesh, nspec, "GlobalArray.from_global_part")
    check_contiguous(mesh, nspec)
    want = local_shape_of(tuple(shape), mesh, nspec, runtime.get("GlobalArray").rank)
    if tuple(np.shape(part)) != want:
      raise ValueError(
        f"GlobalArray.from_global_part: this rank's part of the global {shape} "
        f"array (spec {nspec}) has shape {want}, got {tuple(np.shape(part))}"
      )
    local = jax.device_put(part, local_sharding(mesh, nspec))
    return cls(local, shape, local.dtype, mesh, nspec)

  @classmethod
  def zeros(
    cls, shape: Sequence[int], dtype: Any = jnp.float32, *, mesh: GlobalMesh, spec=None
  ) -> GlobalArray:
    """A GlobalArray of zeros, made on the devices (no host copy, no communication).

    Args:
      shape: the global shape.
      dtype: the dtype (default float32).
      mesh: the :class:`~mpijax.GlobalMesh` the array is laid over.
      spec: the ``PartitionSpec`` over ``mesh``'s axes (``None``: replicated);
        each sharded dimension must be divisible by the devices sharding it.

    Returns:
      The GlobalArray.

    Examples:
      >>> buf = mpijax.GlobalArray.zeros((8, 4), mesh=mesh, spec=P("x"))  # doctest: +SKIP
    """
    return full(shape, 0, dtype, mesh=mesh, spec=spec)

  @classmethod
  def full(
    cls, shape: Sequence[int], fill_value: Any, dtype: Any = None, *, mesh: GlobalMesh, spec=None
  ) -> GlobalArray:
    """A GlobalArray filled with ``fill_value``, made on the devices (no communication).

    Args:
      shape: the global shape.
      fill_value: the scalar every element gets.
      dtype: the dtype (default: ``fill_value``'s, as JAX canonicalizes it).
      mesh: the :class:`~mpijax.GlobalMesh` the array is laid over.
      spec: the ``PartitionSpec`` over ``mesh``'s axes (``None``: replicated);
        each sharded dimension must be divisible by the devices sharding it.

    Returns:
      The GlobalArray.
    """
    return full(shape, fill_value, dtype, mesh=mesh, spec=spec)

  @classmethod
  def from_callback(
    cls,
    global_shape: Sequence[int],
    dtype: Any,
    mesh: GlobalMesh,
    spec,
    data_callback: Callable[[Index], Any],
  ) -> GlobalArray:
    """Like ``jax.make_array_from_callback``: ``data_callback(index)`` gives one block.

    Called once per distinct block held by this rank's devices, with the
    block's index (a tuple of slices) into the global array. No
    communication.

    Args:
      global_shape: the global shape.
      dtype: the dtype the blocks are converted to (as JAX canonicalizes it:
        int64 is int32 without x64).
      mesh: the :class:`~mpijax.GlobalMesh` the array is laid over.
      spec: the ``PartitionSpec`` over ``mesh``'s axes (``None``: replicated);
        each sharded dimension must be divisible by the devices sharding it.
      data_callback: ``data_callback(index) -> block``, the block of the
        global array at ``index`` (NumPy-convertible, of that shape).

    Returns:
      The GlobalArray.

    Raises:
      ValueError: a block has the wrong shape, or the spec does not fit.
    """
    rt = runtime.get("GlobalArray.from_callback")
    shape = tuple(int(s) for s in global_shape)
    dtype = np.dtype(jax.dtypes.canonicalize_dtype(dtype))  # int64 -> int32 without x64
    nspec = normalize_spec(spec, len(shape), mesh)
    check_divisible(shape, mesh, nspec, "GlobalArray.from_callback")
    check_contiguous(mesh, nspec)
    L = mesh.local_device_count
    indices = device_indices(shape, mesh, nspec)[rt.rank * L : (rt.rank + 1) * L]
    offset = [s.start for s in process_index_of(shape, mesh, nspec, rt.rank)]
    sharding = local_sharding(mesh, nspec)
    local_shape = local_shape_of(tuple(shape), mesh, nspec, rt.rank)
    cache: dict[Any, np.ndarray] = {}
    arrays = []
    for l, index in enumerate(indices):
      key = tuple((s.start, s.stop) for s in index)
      if key not in cache:
        block = np.asarray(data_callback(index), dtype=dtype)
        if block.shape != index_shape(index):
          raise ValueError(
            f"GlobalArray.from_callback: the callback returned shape {block.shape} "
            f"for index {index}, expected {index_shape(index)}"
          )
        cache[key] = block
      arrays.append(jax.device_put(cache[key], rt.local_devices[l]))
    # Put the blocks in the order jax expects: per device of the local sharding.
    by_device = dict(zip(rt.local_devices, arrays))
    local_map = sharding.addressable_devices_indices_map(local_shape)
    for dev, local_index in local_map.items():  # cross-check the geometry once
      got = tuple((o + (s.start or 0)) for o, s in zip(offset, local_index))
      want = indices[rt.local_devices.index(dev)]
      if got != tuple(s.start for s in want):
        raise AssertionError(f"mpijax geometry mismatch on {dev}: {got} vs {want}")
    local = jax.make_array_from_single_device_arrays(
      local_shape, sharding, [by_device[d] for d in local_map]
    )
    return cls(local, shape, dtype, mesh, nspec)

  @classmethod
  def from_jax(cls, array: jax.Array, mesh: GlobalMesh | None = None, spec=None) -> GlobalArray:
    """From a global ``jax.Array`` (sharded over every rank's devices); no copy if it can.

    JAX must know every rank (``mpijax.init()`` with JAX's distributed
    runtime). When the array's layout is the one ``mesh`` and ``spec`` give,
    this rank's part is made of the array's own device buffers; otherwise JAX
    moves the data first (``jax.device_put``, collective).

    Args:
      array: e.g. the result of :meth:`to_jax` after ``jax.jit``.
      mesh: the GlobalMesh to use; default a new one with the array's mesh
        axes (creating a mesh is collective).
      spec: the layout on ``mesh``; default the array's own ``PartitionSpec``
        (then the array needs a ``NamedSharding`` with ``mesh``'s axes).

    Returns:
      The GlobalArray, with the array's global shape and dtype.

    Raises:
      RuntimeError: JAX does not know every rank.
      TypeError: no ``mesh``/``spec`` given and the array has no
        ``NamedSharding``.
      ValueError: the array's mesh does not match ``mesh`` (without
        ``spec``), or the spec does not fit.
    """
    rt = runtime.get("GlobalArray.from_jax")
    _require_distributed(rt, "GlobalArray.from_jax")
    sharding = array.sharding
    if spec is None or mesh is None:
      if not isinstance(sharding, NamedSharding):
        raise TypeError(
          f"GlobalArray.from_jax needs an array with a NamedSharding, got "
          f"{type(sharding).__name__}; jax.device_put it onto a NamedSharding "
          "first, or pass mesh= and spec=."
        )
      jmesh = sharding.mesh
      if mesh is None:
        mesh = GlobalMesh(tuple(jmesh.shape.values()), tuple(jmesh.axis_names))
      elif spec is None and (
        tuple(jmesh.axis_names) != mesh.axis_names or dict(jmesh.shape) != mesh.shape
      ):
        raise ValueError(
          f"GlobalArray.from_jax: the array's mesh {dict(jmesh.shape)} does not "
          f"match the given {mesh}; pass spec= to lay it out on that mesh."
        )
    nspec = normalize_spec(sharding.spec if spec is None else spec, array.ndim, mesh)
    check_divisible(array.shape, mesh, nspec, "GlobalArray.from_jax")
    check_contiguous(mesh, nspec)
    want = NamedSharding(jax_mesh(mesh), nspec)
    if not sharding.is_equivalent_to(want, array.ndim):
      array = jax.device_put(array, want)  # another layout: JAX moves the data
    by_device = {s.device: s.data for s in array.addressable_shards}
    part_sharding = local_sharding(mesh, nspec)
    local_shape = local_shape_of(tuple(array.shape), mesh, nspec, rt.rank)
    local_map = part_sharding.addressable_devices_indices_map(local_shape)
    local = jax.make_array_from_single_device_arrays(
      local_shape, part_sharding, [by_device[d] for d in local_map]
    )
    return cls(local, array.shape, array.dtype, mesh, nspec)

  # --- leaving ---

  def gather(self, root: int | None = None) -> np.ndarray | None:
    """The whole array as NumPy (collective: every rank must call it).

    Each distinct process part is sent once (replicas are not sent again).

    Args:
      root: ``None``: every rank gets the array; a rank number: only that rank
        does, the others get ``None``.

    Returns:
      A NumPy array of the global shape and dtype (on ``root``, or on every
      rank), else ``None``.

    Raises:
      ValueError: ``root`` is not a rank of the job.
    """
    rt = runtime.get("GlobalArray.gather")
    MPI = mpi_util.import_mpi()
    comm = rt.comm
    boxes = [process_index_of(self._shape, self._mesh, self._spec, r) for r in range(rt.size)]
    keys = [tuple((s.start, s.stop) for s in b) for b in boxes]
    senders = [r for r in range(rt.size) if keys[r] not in keys[:r]]
    item = self._dtype.itemsize
    counts = [
      math.prod(index_shape(boxes[r])) * item if r in senders else 0 for r in range(rt.size)
    ]
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64).tolist()
    if root is not None and not 0 <= root < rt.size:
      raise ValueError(f"gather(root={root}) but the job has ranks 0..{rt.size - 1}")
    if tuple(np.shape(self._local)) != index_shape(boxes[rt.rank]):
      # Sending it would make MPI read past it or mix up the ranks' bytes.
      raise ValueError(
        f"GlobalArray.gather: this rank's part has shape {tuple(np.shape(self._local))}, but "
        f"its part of the global {self._shape} array (spec {self._spec}) is "
        f"{index_shape(boxes[rt.rank])}; the GlobalArray was built around a local array of "
        "the wrong shape"
      )
    # A zero-size part is never read from the devices (JAX may hold it in shards
    # of the wrong shape, see full()).
    mine = (
      np.ascontiguousarray(np.asarray(self._local))
      if rt.rank in senders and counts[rt.rank]
      else None
    )
    send = mine.reshape(-1).view(np.uint8) if mine is not None else np.zeros(0, np.uint8)
    want = root is None or rt.rank == root
    buf = np.empty(int(sum(counts)), np.uint8) if want else None
    recv = [buf, (counts, displs), MPI.BYTE] if want else None
    if root is None:
      comm.Allgatherv([send, MPI.BYTE], recv)
    else:
      comm.Gatherv([send, MPI.BYTE], recv, root=root)
    if not want:
      return None
    out = np.empty(self._shape, self._dtype)
    for r in senders:
      chunk = buf[displs[r] : displs[r] + counts[r]]
      out[boxes[r]] = chunk.view(self._dtype).reshape(index_shape(boxes[r]))
    return out

  def to_jax(self) -> jax.Array:
    """The same array as a global ``jax.Array`` over JAX's devices, without a copy.

    JAX must know every rank (``mpijax.init()`` with JAX's distributed
    runtime). mpijax's global device ``p * L + l`` is JAX's ``l``-th local
    device of process ``p``, so the result has the same layout, its shards
    are this rank's own device buffers, and JAX's ``jit`` partitioning and
    ``with_sharding_constraint`` apply to it.
    """
    rt = runtime.get("GlobalArray.to_jax")
    _require_distributed(rt, "GlobalArray.to_jax")
    sharding = NamedSharding(jax_mesh(self._mesh), self._spec)
    shards = {s.device: s.data for s in self._local.addressable_shards}
    return jax.make_array_from_single_device_arrays(
      self._shape,
      sharding,
      [shards[d] for d in sharding.addressable_devices_indices_map(self._shape)],
    )


def _require_distributed(rt, what: str) -> None:
  if jax.process_count() != rt.size:
    raise RuntimeError(
      f"{what} needs JAX to know every rank, but JAX sees {jax.process_count()} process(es) "
      f"in this {rt.size}-rank job: call mpijax.init() before anything else uses JAX, and "
      "without jax_distributed=False or MPIJAX_JAX_DISTRIBUTED=0. Without it, use .gather() "
      "or .local."
    )


@functools.lru_cache(maxsize=32)
def _jax_mesh(axis_shapes: tuple[int, ...], axis_names: tuple[str, ...], L: int):
  from jax.sharding import Mesh

  rt = runtime.get("mpijax.GlobalArray.to_jax")
  per_process: dict[int, list[Any]] = {}
  for d in jax.devices():
    per_process.setdefault(d.process_index, []).append(d)
  # JAX lists each process' devices by id; mpijax's local order is jax.local_devices().
  ordered = []
  for p in range(rt.size):
    devs = sorted(per_process.get(p, []), key=lambda d: d.id)
    if p == rt.rank:
      devs = list(rt.local_devices)
    if len(devs) != L:
      raise RuntimeError(f"JAX sees {len(devs)} devices of process {p}, mpijax expects {L}")
    ordered += devs
  if sorted(rt.local_devices, key=lambda d: d.id) != list(rt.local_devices):
    raise RuntimeError(
      "this rank's local devices are not in id order; cannot map mpijax's "
      "global device order onto JAX's devices"
    )
  return Mesh(np.array(ordered, dtype=object).reshape(axis_shapes), axis_names)


def jax_mesh(mesh: GlobalMesh):
  """A ``jax.sharding.Mesh`` over JAX's global devices laid out like ``mesh``."""
  return _jax_mesh(
    tuple(mesh.shape[n] for n in mesh.axis_names), mesh.axis_names, mesh.local_device_count
  )


def _unsupported_operator(name: str):
  def op(self, *args, **kwargs):
    raise TypeError(
      f"GlobalArray does not implement {name}: each rank holds only its part, so NumPy-style "
      "operators on the global array are not defined. For element-wise math use "
      "jax.tree.map(f, ga) or jax.tree.map(jnp.add, a, b) (same mesh and spec; inside "
      "jax.jit too); for reductions or anything that mixes blocks use mpijax.shard_map with "
      "mpijax.lax collectives; ga.local is this rank's part, ga.gather() the whole array "
      "(collective)."
    )

  op.__name__ = name
  return op


for _name in (
  "__add__",
  "__radd__",
  "__sub__",
  "__rsub__",
  "__mul__",
  "__rmul__",
  "__truediv__",
  "__rtruediv__",
  "__floordiv__",
  "__rfloordiv__",
  "__mod__",
  "__rmod__",
  "__pow__",
  "__rpow__",
  "__matmul__",
  "__rmatmul__",
  "__neg__",
  "__pos__",
  "__abs__",
  "__invert__",
  "__and__",
  "__rand__",
  "__or__",
  "__ror__",
  "__xor__",
  "__rxor__",
  "__lt__",
  "__le__",
  "__gt__",
  "__ge__",
  "__float__",
  "__int__",
  "__complex__",
  "__index__",
):
  setattr(GlobalArray, _name, _unsupported_operator(_name))
del _name


# --- constructors ---------------------------------------------------------------------


def full(
  shape: Sequence[int], fill_value: Any, dtype: Any = None, *, mesh: GlobalMesh, spec=None
) -> GlobalArray:
  """A GlobalArray filled with ``fill_value`` (made on the devices, no host copy)."""
  shape = tuple(int(s) for s in shape)
  dtype = np.dtype(
    jax.dtypes.canonicalize_dtype(dtype if dtype is not None else np.asarray(fill_value).dtype)
  )
  nspec = normalize_spec(spec, len(shape), mesh)
  check_divisible(shape, mesh, nspec, "mpijax full/zeros")
  check_contiguous(mesh, nspec)
  local_shape = local_shape_of(tuple(shape), mesh, nspec, runtime.get("mpijax.zeros/full").rank)
  sharding = local_sharding(mesh, nspec)
  if math.prod(local_shape) == 0:
    # jax.jit gives each device a zero-size output of the *whole* local shape
    # (jax 0.10: shards (0, 4) for a (0, 4) array split over 2 devices), which
    # breaks np.asarray and reshard; device_put cuts the shards right.
    local = jax.device_put(np.zeros(local_shape, dtype), sharding)
  else:
    local = jax.jit(lambda: jnp.full(local_shape, fill_value, dtype), out_shardings=sharding)()
  return GlobalArray(local, shape, dtype, mesh, nspec)


def zeros(
  shape: Sequence[int], dtype: Any = jnp.float32, *, mesh: GlobalMesh, spec=None
) -> GlobalArray:
  """A GlobalArray of zeros."""
  return full(shape, 0, dtype, mesh=mesh, spec=spec)
