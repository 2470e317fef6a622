"""Checkpoints of sharded global arrays: each rank writes only its own shards.

Layout of a checkpoint directory ``path``::

    path/metadata.json   leaves (tree path, shape, dtype, spec, mesh) and, per
                         shard, its file, global index, size and sha256; plus
                         a sha256 of the metadata itself
    path/a<leaf>.<k>     the bytes of shard k of leaf <leaf> (C order)
    path/a<leaf>.full    a leaf that is not a GlobalArray (saved by rank 0)

Writing is atomic: every rank writes into ``path.tmp-<uuid>`` (fsynced),
the ranks meet (an allgather of what each wrote), rank 0 writes the metadata
last and renames the directory to ``path``. A crash before the rename leaves
only the ``.tmp-`` directory, which :func:`load` refuses (no metadata) and
the next save to ``path`` deletes. Each
distinct block is written once, by the lowest global device that holds it.

Loading reads, on each rank, the saved shard files that overlap its part of
the target layout, so the target may use another spec, mesh or rank count.
All ranks agree that every rank succeeded before anything is returned.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import uuid
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from mpijax._src import mpi_util
from mpijax._src import tree_codec as _codec

# The training checkpoint's atomic file write, directory fsync and error type.
from mpijax._src.fileio import CheckpointError
from mpijax._src.fileio import fsync_dir as _fsync_dir
from mpijax._src.fileio import remove_stale_temps
from mpijax._src.fileio import write_atomic as _write_atomic
from mpijax._src.runtime import state as runtime
from mpijax._src.sharding.geometry import device_indices
from mpijax._src.sharding.geometry import process_index_of
from mpijax._src.sharding.global_array import GlobalArray

FORMAT = "mpijax-array-checkpoint"
VERSION = 1
METADATA = "metadata.json"


def _spec_to_json(spec: PartitionSpec) -> list:
  return [e if e is None or isinstance(e, str) else list(e) for e in spec]


def _sha256(data) -> str:
  return hashlib.sha256(data).hexdigest()


# --- save ------------------------------------------------------------------------------


def save(path: str | os.PathLike, tree: Any, *, overwrite: bool = False) -> str:
  """Saves a pytree of GlobalArrays (and plain arrays/scalars) to directory ``path``.

  Collective: every rank calls it with its part of the same tree. Each rank
  writes the shards its devices own (replicated blocks once, by the lowest
  device holding them); rank 0 writes plain leaves and the metadata.

  Args:
    path: the checkpoint directory (created; on a filesystem every rank sees).
    tree: the pytree to save.
    overwrite: replace an existing checkpoint at ``path`` (the old one is
      moved aside to ``path.old-<uuid>``, the new one renamed in, then the
      old one removed; if the job dies between the two renames, :func:`load`
      of ``path`` names the old copy). Only a directory holding nothing but an
      mpijax checkpoint is replaced; any other file or directory is an error.

  Returns:
    ``path`` as an absolute path.

  Raises:
    OSError: on every rank, if any rank failed to write (nothing is published).
  """
  rt = runtime.get("mpijax.save")
  comm = rt.comm
  path = os.path.abspath(os.fspath(path))
  token, error = "", ""
  if rt.rank == 0:
    try:
      if os.path.lexists(path):
        if not overwrite:
          raise FileExistsError(
            f"{path!r} exists; pass overwrite=True to replace it, or save to a new path"
          )
        _check_replaceable(path)
      # A save that was killed left its '.tmp-' directory (load refuses it):
      # remove it now, or every crash would leave a checkpoint's worth of disk.
      remove_stale_temps(path, r"[0-9a-f]{32}", _is_partial_checkpoint)
      token = uuid.uuid4().hex
      os.makedirs(f"{path}.tmp-{token}")
    except OSError as e:
      error = f"{type(e).__name__}: {e}"
  status = json.loads(mpi_util.bcast_str(comm, json.dumps({"token": token, "error": error})))
  if status["error"]:
    raise OSError(f"mpijax.save({path!r}) failed on rank 0: {status['error']}")
  tmp = f"{path}.tmp-{status['token']}"

  with_paths, _ = jax.tree_util.tree_flatten_with_path(
    tree, is_leaf=lambda x: isinstance(x, GlobalArray)
  )
  leaves_meta: list[dict[str, Any]] = []
  written: list[dict[str, Any]] = []
  error = ""
  try:
    for i, (kpath, leaf) in enumerate(with_paths):
      meta, files = _save_leaf(rt, tmp, i, jax.tree_util.keystr(kpath), leaf)
      leaves_meta.append(meta)
      written += files
  except Exception as e:  # reported to every rank below, then raised
    error = f"{type(e).__name__}: {e}"
  # Also the barrier: after it every rank's shards are fsynced in tmp.
  reports = [
    json.loads(r)
    for r in mpi_util.allgather_str(comm, json.dumps({"files": written, "error": error}))
  ]
  bad = [(r, p["error"]) for r, p in enumerate(reports) if p["error"]]

  error = ""
  if rt.rank == 0:
    try:
      if bad:
        shutil.rmtree(tmp, ignore_errors=True)
      else:
        shards: dict[int, list] = {}
        for p in reports:
          for f in p["files"]:
            shards.setdefault(f.pop("leaf"), []).append(f)
        for i, meta in enumerate(leaves_meta):
          meta["files"] = sorted(shards.get(i, []), key=lambda f: f["file"])
          if meta["kind"] == "global" and len(meta["files"]) != meta["blocks"]:
            raise RuntimeError(
              f"leaf {meta['path']}: {len(meta['files'])} shard files written, "
              f"{meta['blocks']} expected"
            )
        body = {
          "format": FORMAT,
          "version": VERSION,
          "leaves": leaves_meta,
          "process_count": rt.size,
          "local_device_count": rt.local_device_count,
        }
        text = json.dumps(body, sort_keys=True)
        doc = json.dumps({"checkpoint": body, "sha256": _sha256(text.encode())}, sort_keys=True)
        _write_atomic(os.path.join(tmp, METADATA), [doc.encode()])
        _publish(tmp, path, status["token"])
    except Exception as e:
      shutil.rmtree(tmp, ignore_errors=True)
      error = f"{type(e).__name__}: {e}"
  if bad:
    raise OSError(
      f"mpijax.save({path!r}) failed (nothing was published):\n" + mpi_util.rank_lines(bad)
    )
  error = mpi_util.bcast_str(comm, error if rt.rank == 0 else None, 0)
  if error:
    raise OSError(f"mpijax.save({path!r}) failed on rank 0: {error}")
  return path


_CHECKPOINT_FILE = re.compile(r"(metadata\.json|a\d+\.(\d+|full))")


def _is_partial_checkpoint(path: str) -> bool:
  """A save's '.tmp-' directory: shard files, metadata and their temporaries only."""
  return os.path.isdir(path) and all(
    _CHECKPOINT_FILE.fullmatch(e.split(".tmp-")[0]) for e in os.listdir(path)
  )


def _check_replaceable(path: str) -> None:
  """Raises unless ``path`` is a directory holding only an mpijax array checkpoint.

  ``overwrite=True`` deletes the old directory, so it must never be a user's
  file or a directory with anything else in it (a typo'd path, a home directory).
  """
  if os.path.islink(path) or not os.path.isdir(path):
    raise FileExistsError(
      f"{path!r} exists and is not a checkpoint directory; overwrite=True "
      "only replaces an mpijax checkpoint. Remove it yourself or save to "
      "another path."
    )
  entries = os.listdir(path)
  other = sorted(e for e in entries if not _CHECKPOINT_FILE.fullmatch(e))
  if METADATA not in entries or other:
    what = (
      f"it holds {other[:5]}{' ...' if len(other) > 5 else ''}"
      if other
      else f"it has no {METADATA}"
    )
    raise FileExistsError(
      f"{path!r} is not an mpijax checkpoint ({what}); overwrite=True only "
      "replaces an mpijax checkpoint. Remove it yourself or save to another "
      "path."
    )


def _publish(tmp: str, path: str, token: str) -> None:
  _fsync_dir(tmp)
  old = None
  if os.path.exists(path):
    old = f"{path}.old-{token}"
    os.rename(path, old)
  os.rename(tmp, path)  # atomic: path is either absent/old or the complete new checkpoint
  _fsync_dir(os.path.dirname(path))
  if old is not None:
    shutil.rmtree(old, ignore_errors=True)


def _save_leaf(rt, tmp: str, i: int, kpath: str, leaf: Any) -> tuple[dict, list[dict]]:
  files = []
  if isinstance(leaf, GlobalArray):
    mesh, L = leaf.mesh, leaf.mesh.local_device_count
    idx = device_indices(leaf.shape, mesh, leaf.spec)
    keys = [tuple((s.start, s.stop) for s in index) for index in idx]
    distinct = sorted(set(keys))
    owner = {k: min(g for g in range(len(keys)) if keys[g] == k) for k in distinct}
    shards = {s.global_device_index: s for s in leaf.addressable_shards}
    for k, key in enumerate(distinct):
      g = owner[key]
      if g // L != rt.rank:
        continue
      data = np.ascontiguousarray(np.asarray(shards[g].data))
      raw = data.reshape(-1).view(np.uint8)
      name = f"a{i}.{k}"
      _write_atomic(os.path.join(tmp, name), [raw])  # no bytes copy of a large shard
      files.append(
        {
          "leaf": i,
          "file": name,
          "index": [list(b) for b in key],
          "nbytes": int(raw.size),
          "sha256": _sha256(raw),
        }
      )
    meta = {
      "path": kpath,
      "kind": "global",
      "shape": list(leaf.shape),
      "dtype": leaf.dtype.name,
      "spec": _spec_to_json(leaf.spec),
      "mesh": {
        "axis_names": list(mesh.axis_names),
        "shape": [mesh.shape[n] for n in mesh.axis_names],
      },
      "blocks": len(distinct),
    }
    return meta, files
  arr, kind, impl = _codec.leaf_to_numpy(leaf)
  arr = np.ascontiguousarray(arr) if arr.ndim else arr.copy()
  if rt.rank == 0:
    raw = arr.reshape(-1).view(np.uint8)
    name = f"a{i}.full"
    _write_atomic(os.path.join(tmp, name), [raw])
    files.append(
      {
        "leaf": i,
        "file": name,
        "index": [[0, n] for n in arr.shape],
        "nbytes": int(raw.size),
        "sha256": _sha256(raw),
      }
    )
  meta = {
    "path": kpath,
    "kind": kind,
    "shape": list(arr.shape),
    "dtype": arr.dtype.name,
    "impl": impl,
    "blocks": 1,
  }
  return meta, files


# --- load ------------------------------------------------------------------------------


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
  """The verified metadata of the checkpoint at ``path``.

  Raises:
    CheckpointError: no (complete) checkpoint at ``path``, or its metadata is
      corrupt or of another format.
  """
  path = os.fspath(path)
  meta_path = os.path.join(path, METADATA)
  if not os.path.isdir(path):
    # An overwrite that died between its two renames leaves the previous
    # checkpoint complete under path.old-<token>: point at it.
    old = sorted(glob.glob(glob.escape(path) + ".old-*"), key=os.path.getmtime)
    hint = (
      f"; an interrupted mpijax.save(overwrite=True) left the previous checkpoint at "
      f"{old[-1]!r}: rename it to {path!r} to use it"
      if old
      else ""
    )
    raise CheckpointError(f"no checkpoint directory at {path!r}{hint}")
  try:
    with open(meta_path, "rb") as f:
      doc = json.loads(f.read())
    body = doc["checkpoint"]
    digest = doc["sha256"]
  except FileNotFoundError:
    raise CheckpointError(
      f"{path!r} has no {METADATA}: it is not a complete mpijax checkpoint (an unfinished "
      "save leaves only a '.tmp-' directory). Refusing to load it."
    ) from None
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise CheckpointError(
      f"{meta_path!r} is unreadable or corrupt ({e}); refusing to load the checkpoint"
    ) from None
  if _sha256(json.dumps(body, sort_keys=True).encode()) != digest:
    raise CheckpointError(f"{meta_path!r} is corrupt (checksum mismatch); refusing to load")
  if body.get("format") != FORMAT or body.get("version") != VERSION:
    raise CheckpointError(
      f"{path!r} is a {body.get('format')!r} v{body.get('version')} "
      f"checkpoint; this mpijax reads {FORMAT!r} v{VERSION}"
    )
  return body


def _read_shard(path: str, f: dict) -> np.ndarray:
  file = os.path.join(path, f["file"])
  try:
    raw = np.fromfile(file, dtype=np.uint8)
  except FileNotFoundError:
    raise CheckpointError(f"shard file {file!r} is missing; the checkpoint is incomplete") from None
  except OSError as e:
    raise CheckpointError(f"cannot read shard file {file!r}: {e}") from None
  if raw.size != f["nbytes"] or _sha256(raw) != f["sha256"]:
    raise CheckpointError(
      f"shard file {file!r} is corrupt or truncated ({raw.size} bytes, metadata says "
      f"{f['nbytes']}; checksum {'ok' if _sha256(raw) == f['sha256'] else 'mismatch'}). "
      "Refusing to load any of the checkpoint."
    )
  return raw


def _load_global(path: str, meta: dict, like: GlobalArray, rank: int) -> GlobalArray:
  shape = tuple(meta["shape"])
  dtype = np.dtype(like.dtype)
  if shape != like.shape or meta["dtype"] != dtype.name:
    raise CheckpointError(
      f"leaf {meta['path']}: the checkpoint has {meta['dtype']}{list(shape)}, the target "
      f"`like` has {dtype.name}{list(like.shape)}; load into a matching tree (and astype/"
      "reshape after loading)"
    )
  region = process_index_of(shape, like.mesh, like.spec, rank)
  out = np.empty(tuple(s.stop - s.start for s in region), dtype)
  covered = 0
  for f in meta["files"]:
    src = [slice(a, b) for a, b in f["index"]]
    lo = [max(s.start, r.start) for s, r in zip(src, region)]
    hi = [min(s.stop, r.stop) for s, r in zip(src, region)]
    if any(l >= h for l, h in zip(lo, hi)):
      continue
    block = _read_shard(path, f).view(dtype).reshape([s.stop - s.start for s in src])
    block_sel = tuple(slice(l - s.start, h - s.start) for l, h, s in zip(lo, hi, src))
    out_sel = tuple(slice(l - r.start, h - r.start) for l, h, r in zip(lo, hi, region))
    out[out_sel] = block[block_sel]
    del block  # before the next shard is read: at most one shard in memory at a time
    covered += int(np.prod([h - l for l, h in zip(lo, hi)], dtype=np.int64))
  if covered != out.size:
    raise CheckpointError(
      f"leaf {meta['path']}: the saved shards cover {covered} of the "
      f"{out.size} elements this rank needs; the checkpoint is incomplete"
    )
  return GlobalArray.from_global_part(out, like.shape, like.mesh, like.spec)


def load(path: str | os.PathLike, like: Any) -> Any:
  """Loads a checkpoint written by :func:`save` into the layout of ``like``.

  Collective. ``like`` is a tree with the structure, shapes and dtypes of the
  saved one; its GlobalArrays give the target mesh and spec, which may differ
  from the saved ones (also the rank count): each rank reads the saved shards
  overlapping its part. Every shard read is verified against its sha256.

  Args:
    path: the checkpoint directory.
    like: the target tree (e.g. ``mpijax.GlobalArray.zeros(...)`` leaves).

  Returns:
    The loaded tree.

  Raises:
    CheckpointError: on every rank, if any rank found the checkpoint missing,
      incomplete, corrupt or not matching ``like``; nothing is returned then.
  """
  rt = runtime.get("mpijax.load")
  path = os.path.abspath(os.fspath(path))
  error, result, digest = "", None, ""
  try:
    body = read_metadata(path)
    digest = _sha256(json.dumps(body, sort_keys=True).encode())
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(
      like, is_leaf=lambda x: isinstance(x, GlobalArray)
    )
    saved = [m["path"] for m in body["leaves"]]
    want = [jax.tree_util.keystr(p) for p, _ in with_paths]
    if saved != want:
      diff = next(
        (
          f"leaf {k}: checkpoint {a!r}, target {b!r}"
          for k, (a, b) in enumerate(zip(saved, want))
          if a != b
        ),
        f"checkpoint has {len(saved)} leaves, target {len(want)}",
      )
      raise CheckpointError(f"checkpoint {path!r} does not fit the target tree ({diff})")
    out = []
    for meta, (_, leaf) in zip(body["leaves"], with_paths):
      if isinstance(leaf, GlobalArray):
        if meta["kind"] != "global":
          raise CheckpointError(
            f"leaf {meta['path']} was saved as a plain {meta['kind']} "
            "leaf, but the target is a GlobalArray"
          )
        out.append(_load_global(path, meta, leaf, rt.rank))
      else:
        if meta["kind"] == "global":
          raise CheckpointError(
            f"leaf {meta['path']} was saved as a GlobalArray; give a GlobalArray in `like` for it"
          )
        spec = _codec.LeafSpec(
          meta["path"], meta["kind"], meta["dtype"], tuple(meta["shape"]), meta.get("impl", "")
        )
        arr = _read_shard(path, meta["files"][0]).view(np.dtype(meta["dtype"])).reshape(spec.shape)
        out.append(_codec.rebuild(arr.copy(), spec, leaf))
    result = jax.tree_util.tree_unflatten(treedef, out)
  except CheckpointError as e:
    error = str(e)
  except Exception as e:  # any failure must reach the other ranks, or they would hang below
    error = f"{type(e).__name__}: {e}"
  reports = mpi_util.allgather_str(rt.comm, ("error:" + error) if error else ("ok:" + digest))
  bad = [(r, p[len("error:") :]) for r, p in enumerate(reports) if p.startswith("error:")]
  if bad:
    raise CheckpointError(f"mpijax.load({path!r}) failed:\n" + mpi_util.rank_lines(bad))
  if len(set(reports)) > 1:
    raise CheckpointError(
      f"ranks read different metadata at {path!r}; put checkpoints on a filesystem every rank sees"
    )
  return result
