"""Atomic, checksummed checkpoints of replicated training state.

File layout (one file, so that ``os.replace`` makes it appear atomically)::

    b"MPIJAXCK" | u32 format version | u64 header length | header (JSON)
    | payload (all leaves' bytes, packed) | sha256(everything before it)

The header lists every leaf (path, dtype, shape, kind), the payload size and
the user's metadata. A file that was truncated, partly overwritten or is not
a checkpoint fails the size or checksum test and is refused as a whole: a
checkpoint is either loaded completely or not at all.

Data-parallel state is replicated, so rank 0 writes and every rank reads; the
file holds nothing rank-specific and restores under any rank count.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from typing import Any

import jax
import numpy as np

from mpijax._src import log
from mpijax._src import mpi_util
from mpijax._src import tree_codec as _codec
from mpijax._src.fileio import WRITE_ATOMIC_SUFFIX
from mpijax._src.fileio import CheckpointError as CheckpointError
from mpijax._src.fileio import remove_stale_temps
from mpijax._src.fileio import write_atomic as _write_atomic
from mpijax._src.runtime import state as runtime
from mpijax._src.train import broadcast as _bcast


class CheckpointMismatch(CheckpointError):
  """A readable checkpoint that does not fit the target tree (another model or optimizer)."""


MAGIC = b"MPIJAXCK"
VERSION = 1
_PREFIX = struct.Struct("<8sIQ")  # magic, version, header length
_DIGEST = 32


def _comm_or_none(comm: Any | None) -> Any | None:
  if comm is not None:
    return comm
  return runtime.get().comm if runtime.is_initialized() else None


def _encode(specs: list[_codec.LeafSpec], payload: np.ndarray, metadata: dict[str, Any]) -> list[bytes]:
  header = json.dumps({
      "format": "mpijax-checkpoint",
      "leaves": [s.to_json() for s in specs],
      "payload_bytes": int(payload.size),
      "metadata": metadata,
      "created": time.time(),
  }, sort_keys=True).encode()
  prefix = _PREFIX.pack(MAGIC, VERSION, len(header))
  h = hashlib.sha256()
  for part in (prefix, header, payload.data):
    h.update(part)
  return [prefix, header, payload.tobytes(), h.digest()]


def read_checkpoint(path: str | os.PathLike) -> tuple[dict[str, Any], list[_codec.LeafSpec], np.ndarray, str]:
  """(header, leaf specs, payload, sha256 hex) of a verified checkpoint file.

  Raises:
    CheckpointError: the file is missing, truncated or corrupt.
  """
  path = os.fspath(path)
  try:
    with open(path, "rb") as f:
      data = f.read()
  except FileNotFoundError:
    raise CheckpointError(f"no checkpoint at {path!r}") from None
  except OSError as e:
    raise CheckpointError(f"cannot read checkpoint {path!r}: {e}") from None
  if len(data) < _PREFIX.size + _DIGEST or data[:8] != MAGIC:
    raise CheckpointError(f"{path!r} is not an mpijax checkpoint (bad magic or only {len(data)} bytes)")
  _, version, header_len = _PREFIX.unpack_from(data)
  if version != VERSION:
    raise CheckpointError(f"{path!r} has checkpoint format version {version}; this mpijax reads {VERSION}")
  body, digest = data[:-_DIGEST], data[-_DIGEST:]
  if hashlib.sha256(body).digest() != digest:
    raise CheckpointError(
        f"checkpoint {path!r} is corrupt or truncated ({len(data)} bytes; checksum mismatch); "
        "refusing to load any of it. Restore an older checkpoint.")
  try:
    header = json.loads(data[_PREFIX.size:_PREFIX.size + header_len])
    specs = [_codec.LeafSpec.from_json(d) for d in header["leaves"]]
    expected = sum(s.nbytes for s in specs)  # also checks every dtype name is known
    payload_bytes = header["payload_bytes"]
  except (ValueError, KeyError, TypeError) as e:
    raise CheckpointError(f"checkpoint {path!r} has an unreadable header: {e}") from None
  payload = np.frombuffer(body, np.uint8, offset=_PREFIX.size + header_len)
  if payload.size != payload_bytes or payload.size != expected:
    raise CheckpointError(f"checkpoint {path!r}: payload has {payload.size} bytes, "
                          f"header says {payload_bytes}")
  return header, specs, payload, digest.hex()


def _is_checkpoint_or_empty(path: str) -> bool:
  if not os.path.isfile(path):
    return False
  with open(path, "rb") as f:
    head = f.read(len(MAGIC))
  return head in (b"", MAGIC)


def save_checkpoint(path: str | os.PathLike, state: Any, *, metadata: dict[str, Any] | None = None,
                    comm: Any | None = None, check_replicated: bool = True) -> str:
  """Writes the replicated ``state`` to ``path`` atomically (rank 0 writes, all ranks return after).

  ``state`` is any pytree: parameters, optimizer state, step, PRNG keys
  (typed or raw), Python ints such as the epoch and the step within it. The
  file is written to a temporary name in the same directory, fsynced, then
  renamed over ``path``: a crash at any moment leaves either the previous
  checkpoint or the new one, never a partial file under ``path``.

  Args:
    path: the checkpoint file.
    state: the pytree to save (the same on every rank).
    metadata: JSON-serializable extras stored in the header (see
      :func:`checkpoint_metadata`).
    comm: an mpi4py communicator; default mpijax's (or none in a plain
      single process).
    check_replicated: compare a hash of the state across ranks and warn
      (naming the ranks) if replicas have drifted apart.

  Returns:
    ``path`` as a string.

  Raises:
    TypeError: on every rank, when a rank's ``state`` has a leaf that
      cannot be stored (objects, strings, times) or ``metadata`` is not
      JSON-serializable; nothing is written.
    OSError: on every rank, when rank 0 could not write the file.
  """
  path = os.fspath(path)
  comm = _comm_or_none(comm)
  rank = comm.Get_rank() if comm is not None else 0
  size = comm.Get_size() if comm is not None else 1
  problem, payload = "", None
  try:
    specs, arrays, _ = _codec.flatten(state)
    # Object/string/time leaves would be written as pointers or in a dtype
    # the reader cannot rebuild: refuse them now, not at restore time.
    problem = _bcast._unsendable(specs, "a checkpoint cannot store")
  except TypeError as e:
    problem = str(e)
  if not problem:
    try:
      json.dumps(metadata or {})
    except (TypeError, ValueError) as e:
      problem = f"metadata is not JSON-serializable: {e}"
  if not problem:
    payload = _codec.pack(arrays)
  if size > 1:
    # One small allgather: any rank's problem stops every rank (a rank that
    # raised alone would leave the others waiting), and the state hashes
    # show replicas that drifted apart.
    digest = hashlib.sha256(payload.data).hexdigest() if check_replicated and not problem else ""
    reports = mpi_util.allgather_str(comm, ("error:" + problem) if problem else ("ok:" + digest))
    bad = [(r, p[len("error:"):]) for r, p in enumerate(reports) if p.startswith("error:")]
    if bad:
      raise TypeError(f"save_checkpoint({path!r}) wrote nothing:\n" +
                      mpi_util.rank_lines(bad))
    differ = [r for r, d in enumerate(reports) if d != reports[0]]
    if check_replicated and differ and rank == 0:
      log.warning(f"save_checkpoint({path!r}): the state on ranks {differ} differs from rank "
                  "0's; saving rank 0's. Replicated state should be identical on every rank "
                  "(did every rank apply the same all-reduced update?).")
  elif problem:
    raise TypeError(f"save_checkpoint({path!r}) wrote nothing:\n  rank {rank}: {problem}")
  error = ""
  if rank == 0:
    try:
      # A write that was killed left its temporary, empty or starting with
      # MAGIC. The next save removes it.
      remove_stale_temps(path, WRITE_ATOMIC_SUFFIX, _is_checkpoint_or_empty)
      _write_atomic(path, _encode(specs, payload, metadata or {}))
    except Exception as e:  # reported to every rank below, then raised
      error = f"{type(e).__name__}: {e}"
  if comm is not None and comm.Get_size() > 1:
    error = mpi_util.bcast_str(comm, error if rank == 0 else None, 0)
  if error:
    raise OSError(f"save_checkpoint({path!r}) failed on rank 0: {error}")
  return path


def restore_checkpoint(path: str | os.PathLike, like: Any, *, comm: Any | None = None) -> Any:
  """Reads a checkpoint into a tree with the structure (and leaf kinds) of ``like``.

  Every rank reads and verifies the file; the ranks then agree that all of
  them read the same bytes (a 64-byte allgather) before anything is returned.
  Works with any rank count, not only the one that saved.

  Args:
    path: the checkpoint file.
    like: a tree of the same structure, shapes and dtypes (e.g. a freshly
      initialized state); its leaves' kinds (``jax.Array``, NumPy, Python
      scalar, typed PRNG key) and devices are used for the result.
    comm: an mpi4py communicator; default mpijax's (or none in a single process).

  Returns:
    The restored tree.

  Raises:
    CheckpointError: on every rank, if any rank cannot read the file, the
      file is corrupt, or it does not match ``like`` (naming the first
      differing leaf).
  """
  path = os.fspath(path)
  comm = _comm_or_none(comm)
  problem, digest, result, mismatch = "", "", None, False
  try:
    _, specs, payload, digest = read_checkpoint(path)
    like_specs, _, treedef = _codec.flatten(like)
    diff = _bcast.first_difference(like_specs, specs, here="in the target", there="in the checkpoint")
    if diff:
      mismatch = True
      raise CheckpointError(f"checkpoint {path!r} does not fit the target tree: {diff}. Pass as "
                            "`like` a tree built like the saved one (same model, optimizer and "
                            "extra entries).")
    leaves = jax.tree_util.tree_leaves(like)
    result = jax.tree_util.tree_unflatten(treedef, [
        _codec.rebuild(a, s, l) for a, s, l in zip(_codec.unpack(payload, specs), specs, leaves)])
  except CheckpointError as e:
    problem = str(e)
  except Exception as e:  # e.g. rebuilding a leaf on its device: still report it on every rank
    problem = f"checkpoint {path!r}: {type(e).__name__}: {e}"
  if comm is not None and comm.Get_size() > 1:
    kind = "mismatch:" if mismatch else "error:"
    reports = mpi_util.allgather_str(comm, (kind + problem) if problem else ("ok:" + digest))
    bad = [(r, p.split(":", 1)[1]) for r, p in enumerate(reports) if not p.startswith("ok:")]
    if bad:
      # Another model's checkpoint on every failing rank: a mismatch, not damage.
      error = CheckpointMismatch if all(reports[r].startswith("mismatch:") for r, _ in bad) \
          else CheckpointError
      raise error("restore_checkpoint failed:\n" + mpi_util.rank_lines(bad))
    if len(set(reports)) > 1:
      raise CheckpointError(
          f"ranks read different files at {path!r} (checksums differ: {sorted(set(reports))}); "
          "put checkpoints on a filesystem every rank sees")
  elif problem:
    raise (CheckpointMismatch if mismatch else CheckpointError)(problem)
  return result


def checkpoint_metadata(path: str | os.PathLike) -> dict[str, Any]:
  """The ``metadata`` dict stored by :func:`save_checkpoint` (file verified first)."""
  return read_checkpoint(path)[0]["metadata"]
