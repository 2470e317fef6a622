"""Call sites and signatures of mpijax's custom calls.

Each custom call carries a static ``sig`` (a hash of what every rank must
agree on: kind, shapes, dtypes, op, root, permutation) and a ``site``, the id
of a description such as "allreduce(float32[4], sum) at train.py:42" that C++
prints in stall and mismatch reports. Sites are interned by (description,
sig, comm), so recompiling the same program (on one rank but not another)
reuses the site and its "already checked" flag instead of triggering an
unpaired check.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import jax
import jaxlib
import numpy as np

from mpijax._src import ffi as _ffi

_sites: dict[tuple[str, int, int | None], int] = {}
_check_slots: dict[tuple[int, int | None], int] = {}


def _package_dir(module: Any) -> str:
  return os.path.dirname(os.path.abspath(module.__file__)) + os.sep


# Frames in these directories are library code, not the user's call site.
_LIB_DIRS = tuple(_package_dir(m) for m in (jax, np, jaxlib)) + (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)  # mpijax/_src/
_LIB_NAMES = (os.sep + "optax" + os.sep, os.sep + "contextlib.py", os.sep + "runpy.py")


def user_location(ctx) -> str:
  """file:line of the first frame outside jax, numpy, optax and mpijax/_src."""
  tb = getattr(ctx, "traceback", None)
  for f in ([] if tb is None else tb.frames):
    name = f.file_name
    if name.startswith(_LIB_DIRS) or any(n in name for n in _LIB_NAMES):
      continue
    return f"{os.path.basename(name)}:{f.line_num}"
  return "an unknown location"


def describe(kind: str, avals, params: dict[str, Any]) -> tuple[str, str]:
  """(human text, canonical signature text) of one call."""
  parts = [f"{a.dtype.name}[{','.join(map(str, a.shape))}]" for a in avals]
  if "op" in params:
    # An allreduce with a divisor is the public op "mean".
    parts.append("mean" if params.get("divisor", 1) != 1 else str(params["op"]))
  if "root" in params:
    parts.append(f"root={params['root']}")
  if "perm" in params:
    perm = str(list(params["perm"]))
    parts.append("perm=" + (perm if len(perm) <= 60 else perm[:57] + "..."))
  shown = parts if len(avals) <= 3 else \
      parts[:2] + [f"... {len(avals)} arrays"] + parts[len(avals):]
  human = f"{kind}({', '.join(shown)})"
  # Not in the signature: the communicator's local id (ranks may number their
  # communicators differently) and the pairs of a sendrecv (`rank_view`: the
  # pairs each rank knows, legitimately different per rank). A ppermute's
  # permutation is global, so every rank must pass the same one.
  skip = ("comm_id", "rank_view") + (("perm",) if params.get("rank_view") else ())
  canon = "|".join([kind] + parts[:len(avals)] +
                   [f"{k}={params[k]!r}" for k in sorted(params) if k not in skip])
  return human, canon


def call_site(ctx, kind: str, params: dict[str, Any]) -> tuple[int, int]:
  """(site id, signature) for a custom call being lowered."""
  human, canon = describe(kind, ctx.avals_in, params)
  # A stable hash (Python's hash() changes with PYTHONHASHSEED, per rank).
  sig = int.from_bytes(hashlib.blake2b(canon.encode(), digest_size=8).digest(),
                       "little") & ((1 << 63) - 1)
  text = f"{human} at {user_location(ctx)}"
  # The local communicator id is part of the site (not of the signature): a
  # site's "checked" flag must not carry over from, e.g., a COMM_SELF call on
  # one rank to a call on the world at the same line.
  key = (text, sig, params.get("comm_id"))
  site = _sites.get(key)
  if site is None:
    # The "already compared" flag is per (signature, communicator): ranks
    # agree on those, not on which call site compiled a program first (an
    # eager op's cached program may come from another line on another rank).
    slot = _check_slots.setdefault((sig, params.get("comm_id")), len(_check_slots))
    site = _ffi.load().register_site(text, slot)
    _sites[key] = site
  return site, sig
