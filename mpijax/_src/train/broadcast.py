"""``broadcast``: one rank's pytree (parameters, optimizer state, ...) to every rank."""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np

from mpijax._src import config
from mpijax._src import mpi_util
from mpijax._src import tree_codec as _codec
from mpijax._src.train import communicator


def _some(paths: list[str], limit: int = 3) -> str:
  more = f" (and {len(paths) - limit} more)" if len(paths) > limit else ""
  return ", ".join(paths[:limit]) + more


def first_difference(mine: list[_codec.LeafSpec], theirs: list[_codec.LeafSpec], *,
                     here: str = "here", there: str = "on the reference") -> str:
  """'' when both leaf lists agree, else a sentence naming the first leaf that differs.

  ``here`` and ``there`` name where ``mine`` and ``theirs`` come from.
  """
  # Trees of different structure: name the leaves one has and the other lacks.
  # Pairing the leaves by position would name two unrelated leaves ("['w']
  # here but ['b'] on the reference") when a key is missing or added.
  mine_paths, their_paths = [s.path for s in mine], [s.path for s in theirs]
  if mine_paths != their_paths:
    mine_set, their_set = set(mine_paths), set(their_paths)
    only_mine = [p for p in mine_paths if p not in their_set]
    only_theirs = [p for p in their_paths if p not in mine_set]
    if only_mine or only_theirs:
      parts = ([f"leaves {here} but not {there}: {_some(only_mine)}"] if only_mine else []) + \
          ([f"leaves {there} but not {here}: {_some(only_theirs)}"] if only_theirs else [])
      return (f"the trees have different structures ({len(mine)} leaves {here}, {len(theirs)} "
              f"{there}); " + "; ".join(parts))
  for a, b in zip(mine, theirs):
    if a.signature() != b.signature():
      if a.path == b.path:  # name it once: "leaf ['w'] is float32[3] here but bfloat16[3] ..."
        return (f"leaf {a.path} is {a.signature()[len(a.path) + 2:]} {here} but "
                f"{b.signature()[len(b.path) + 2:]} {there}")
      return f"leaf {a.signature()} {here} but {b.signature()} {there}"
  if len(mine) != len(theirs):
    longer, which = (mine, here) if len(mine) > len(theirs) else (theirs, there)
    extra = longer[min(len(mine), len(theirs))]
    return (f"the trees have {len(mine)} leaves {here} and {len(theirs)} {there}; "
            f"first extra leaf {which}: {extra.signature()}")
  return ""


def agree_or_raise(comm: Any, problem: str, what: str) -> None:
  """Every rank raises if any rank found a problem (so no rank is left waiting in MPI)."""
  bad = mpi_util.rank_problems(comm, problem)
  if bad:
    lines = mpi_util.rank_lines(bad)
    raise ValueError(f"{what}: the ranks' trees cannot be broadcast\n{lines}\n"
                     "Every rank must pass a tree with the same structure, shapes and dtypes.")


def bcast_array(comm: Any, buf: np.ndarray, root: int) -> None:
  """In-place ``Bcast`` of a uint8 buffer, in chunks no bigger than ``max_chunk_bytes``."""
  MPI = mpi_util.import_mpi()
  chunk = max(1, int(config.get("max_chunk_bytes")))
  for start in range(0, buf.size, chunk):
    comm.Bcast([buf[start:start + chunk], MPI.BYTE], root=root)


def _unsendable(specs: list[_codec.LeafSpec], what: str = "broadcast cannot send") -> str:
  """The first leaf whose bytes do not mean anything on another rank (or in a file), or ''."""
  for s in specs:
    try:
      kind = np.dtype(s.dtype).kind
    except TypeError:  # e.g. 'str64': no dtype of that name
      kind = "U"
    if kind in "OUSMm":
      return (f"leaf {s.path} has dtype {s.dtype}, which {what} (object, "
              "string and time dtypes): use numbers, e.g. text as "
              "np.frombuffer(s.encode(), np.uint8)")
  return ""


def broadcast(tree: Any, root: int = 0, *, comm: Any | None = None) -> Any:
  """Returns ``root``'s ``tree`` on every rank.

  Every rank passes a tree of the same structure, shapes and dtypes (e.g. its
  own freshly initialized parameters); the values of ``root`` replace them.
  Leaves keep their dtype (bfloat16, int8, typed PRNG keys ...), shape and kind
  (``jax.Array``, NumPy array or Python scalar). All leaves travel as one
  packed byte buffer, so the cost is one ``MPI_Bcast`` plus two tiny messages
  that check the structures agree. A rank whose tree differs makes every rank
  raise a ``ValueError`` naming the first differing leaf, instead of hanging.

  Args:
    tree: any pytree of arrays and scalars.
    root: the rank whose values win.
    comm: an mpi4py communicator; default mpijax's (needs ``mpijax.init()``).

  Returns:
    ``tree`` with root's values.

  Raises:
    ValueError: ``root`` is not a rank of the communicator; or, on every
      rank, the ranks' trees differ or a leaf holds objects, strings or
      times (which cannot be sent).

  Examples:
    >>> params = mpijax.train.broadcast(init_params(jax.random.key(rank)))  # doctest: +SKIP
  """
  comm = communicator.get_comm(comm, "mpijax.train.broadcast")
  size = comm.Get_size()
  if not 0 <= root < size:
    raise ValueError(f"broadcast got root={root}, but the communicator has {size} ranks (0..{size - 1})")
  is_root = comm.Get_rank() == root
  try:
    specs, arrays, treedef = _codec.flatten(tree)
    problem = _unsendable(specs)
  except TypeError as e:
    # Reported through the collectives below, not raised here: a rank that
    # left now would leave the others waiting in the Bcast.
    specs, problem = None, str(e)
  # The root sends null when its own tree cannot be sent (its problem is
  # reported below); the others then have nothing to compare against.
  root_json = mpi_util.bcast_str(
      comm, json.dumps(None if specs is None else [s.to_json() for s in specs]) if is_root else None,
      root)
  root_list = json.loads(root_json)
  if not problem and not is_root and root_list is not None:
    problem = first_difference(specs, [_codec.LeafSpec.from_json(d) for d in root_list])
  agree_or_raise(comm, problem, f"mpijax.train.broadcast(root={root})")
  if size == 1:
    return tree
  buf = _codec.pack(arrays) if is_root else np.empty(sum(s.nbytes for s in specs), np.uint8)
  bcast_array(comm, buf, root)
  if is_root:
    return tree
  leaves = jax.tree_util.tree_leaves(tree)
  new = [_codec.rebuild(a, s, like) for a, s, like in zip(_codec.unpack(buf, specs), specs, leaves)]
  return jax.tree_util.tree_unflatten(treedef, new)
