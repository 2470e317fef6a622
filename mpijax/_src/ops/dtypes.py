"""The dtypes and reduction ops mpijax's primitives accept, checked at trace time."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

_FLOATS = ("float16", "bfloat16", "float32", "float64")
_COMPLEX = ("complex64", "complex128")
_INTS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
SUPPORTED_DTYPES = _FLOATS + _COMPLEX + _INTS + ("bool",)

REDUCE_OPS = ("sum", "prod", "min", "max", "and", "or", "xor")
OP_CODES = {name: i for i, name in enumerate(REDUCE_OPS)}


def _ops_for(dtype_name: str) -> tuple[str, ...]:
  if dtype_name in _FLOATS:
    return ("sum", "prod", "min", "max")
  if dtype_name in _COMPLEX:
    return ("sum", "prod")
  if dtype_name == "bool":
    return ("min", "max", "and", "or", "xor")
  return REDUCE_OPS


def check_dtype(op_name: str, dtype: Any) -> str:
  """The canonical dtype name, or a TypeError naming the supported ones."""
  name = np.dtype(dtype).name
  if name not in SUPPORTED_DTYPES:
    raise TypeError(
        f"{op_name} got an array of dtype {name}, which mpijax cannot send; "
        f"supported dtypes: {', '.join(SUPPORTED_DTYPES)}. Cast first, e.g. "
        "x.astype(jnp.float32).")
  return name


def as_array(op_name: str, x: Any) -> Any:
  """``x`` as a JAX array (tracers pass through); a value JAX cannot hold is
  a TypeError naming its type and dtype, not JAX's internal message."""
  try:
    return jnp.asarray(x)
  except (TypeError, ValueError):
    what = f"a value of type {type(x).__name__}"
    if x is None:
      what = "None"
    else:
      try:
        what += f", dtype {np.asarray(x).dtype.name}"
      except Exception:  # noqa: BLE001 -- only for the message
        pass
    raise TypeError(
        f"{op_name} got {what}, which JAX cannot hold as an array; pass a "
        f"numeric array of one of mpijax's dtypes ({', '.join(SUPPORTED_DTYPES)}), "
        "e.g. jnp.asarray(x, jnp.float32).") from None


def check_reduce_op(op_name: str, op: str, dtype: Any) -> str:
  """Validates a reduction op for a dtype (at trace time)."""
  name = check_dtype(op_name, dtype)
  if op not in REDUCE_OPS:
    raise ValueError(f"{op_name} got op={op!r}; expected one of {REDUCE_OPS}.")
  allowed = _ops_for(name)
  if op not in allowed:
    raise TypeError(
        f"{op_name} got op={op!r} for dtype {name}; ops supported for {name}: "
        f"{allowed}" + (" (and/or/xor are bitwise, for integers and bool)"
                        if op in ("and", "or", "xor") else "") + ".")
  return op
