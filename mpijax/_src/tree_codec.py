"""Pytree leaves <-> one contiguous byte buffer, keeping dtypes, shapes and leaf kinds.

Used by ``mpijax.train.broadcast`` (one MPI ``Bcast`` of all bytes) and by the
training and array checkpoints.
A leaf's *kind* says how to rebuild it: a ``jax.Array``, a NumPy array or
scalar, a Python scalar, or a typed PRNG key (stored as its raw key data).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class LeafSpec:
  path: str
  kind: str  # "jax" | "numpy" | "python" | "key"
  dtype: str  # of the stored bytes (key data for "key")
  shape: tuple[int, ...]
  impl: str = ""  # PRNG implementation name for "key" leaves

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64)) * jnp.dtype(self.dtype).itemsize

  def to_json(self) -> dict[str, Any]:
    return {"path": self.path, "kind": self.kind, "dtype": self.dtype,
            "shape": list(self.shape), "impl": self.impl}

  @classmethod
  def from_json(cls, d: dict[str, Any]) -> LeafSpec:
    return cls(d["path"], d["kind"], d["dtype"], tuple(int(s) for s in d["shape"]), d.get("impl", ""))

  def signature(self) -> str:
    """What must agree between two trees for bytes to be exchanged."""
    return f"{self.path}: {self.dtype}{list(self.shape)}" + (f" key<{self.impl}>" if self.impl else "")


def _is_key(x: Any) -> bool:
  return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def leaf_to_numpy(x: Any) -> tuple[np.ndarray, str, str]:
  """(host array, kind, PRNG impl) of one leaf."""
  if _is_key(x):
    return np.asarray(jax.random.key_data(x)), "key", str(jax.random.key_impl(x))
  if isinstance(x, jax.Array):
    return np.asarray(x), "jax", ""
  if isinstance(x, (np.ndarray, np.generic)):
    return np.asarray(x), "numpy", ""
  if isinstance(x, (bool, int, float, complex)):
    return np.asarray(x), "python", ""
  raise TypeError(
      f"cannot store a leaf of type {type(x).__name__} ({x!r:.80}); leaves must be "
      "jax/NumPy arrays or Python scalars (turn other objects into arrays first)")


def flatten(tree: Any) -> tuple[list[LeafSpec], list[np.ndarray], Any]:
  """Specs, C-contiguous host arrays and the treedef of ``tree``."""
  with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
  specs, arrays = [], []
  for path, leaf in with_paths:
    try:
      arr, kind, impl = leaf_to_numpy(leaf)
    except TypeError as e:
      raise TypeError(f"leaf {jax.tree_util.keystr(path)}: {e}") from None
    # Not np.ascontiguousarray: it turns 0-d arrays into shape (1,).
    arr = arr if arr.flags.c_contiguous else arr.copy(order="C")
    specs.append(LeafSpec(jax.tree_util.keystr(path), kind, arr.dtype.name, tuple(arr.shape), impl))
    arrays.append(arr)
  return specs, arrays, treedef


def pack(arrays: list[np.ndarray]) -> np.ndarray:
  """All leaves' bytes, concatenated, as one uint8 array."""
  if not arrays:
    return np.zeros(0, np.uint8)
  return np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays])


def unpack(buf: np.ndarray, specs: list[LeafSpec]) -> list[np.ndarray]:
  """Inverse of :func:`pack` (copies, so results do not alias ``buf``)."""
  out, offset = [], 0
  for s in specs:
    n = s.nbytes
    chunk = buf[offset:offset + n]
    if chunk.size != n:
      raise ValueError(f"buffer too short for leaf {s.path} ({s.dtype}{list(s.shape)})")
    out.append(chunk.view(jnp.dtype(s.dtype)).reshape(s.shape).copy())
    offset += n
  if offset != buf.size:
    raise ValueError(f"buffer has {buf.size - offset} bytes more than the leaves need")
  return out


def rebuild(arr: np.ndarray, spec: LeafSpec, like: Any = None) -> Any:
  """One leaf from its host array: the kind of ``like`` if given, else ``spec.kind``."""
  kind = spec.kind if like is None else leaf_to_kind(like)
  if kind == "key":
    impl = str(jax.random.key_impl(like)) if like is not None else spec.impl
    return jax.random.wrap_key_data(jnp.asarray(arr), impl=impl)
  if kind == "jax":
    if like is not None and isinstance(like, jax.Array) and getattr(like, "committed", False):
      # Keep the placement the caller chose (device or sharding); an
      # uncommitted leaf stays uncommitted so jit may still move it.
      return jax.device_put(arr, like.sharding)
    return jnp.asarray(arr)
  if kind == "python":
    value = arr.item()
    return type(like)(value) if like is not None else value
  if isinstance(like, np.generic):
    # A NumPy scalar (np.float32(1.0), an int counter) stays a scalar, not a
    # 0-d array, so every rank gets the same type the root passed.
    return arr[()]
  return arr


def leaf_to_kind(x: Any) -> str:
  if _is_key(x):
    return "key"
  if isinstance(x, jax.Array):
    return "jax"
  if isinstance(x, (bool, int, float, complex)):
    return "python"
  return "numpy"
