"""Atomic file writes shared by the training and the global-array checkpoints."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable


class CheckpointError(ValueError):
  """A checkpoint file is missing, truncated, corrupt or does not fit the target tree."""


def fsync_dir(directory: str) -> None:
  try:
    fd = os.open(directory, os.O_RDONLY)
  except OSError:
    return  # some filesystems do not allow opening directories; the rename is still atomic
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


# What tempfile.mkstemp appends to write_atomic's "<name>.tmp-" prefix.
WRITE_ATOMIC_SUFFIX = r"[a-z0-9_]{8}"


def remove_stale_temps(path: str, suffix: str, is_ours: Callable[[str], bool]) -> None:
  """Deletes ``<path>.tmp-<suffix>`` siblings that a killed write left behind.

  A killed atomic write leaves its temporary (the published ``path`` is
  intact); the next write of the same path calls this, so repeated crashes
  cannot fill the disk with checkpoint-sized leftovers. Only names of the
  exact temporary pattern for which ``is_ours`` holds (the format's magic
  bytes, say) are touched: a user's file that merely looks alike stays.
  """
  directory = os.path.dirname(os.path.abspath(path))
  pattern = re.compile(re.escape(os.path.basename(path)) + r"\.tmp-" + suffix)
  try:
    names = os.listdir(directory)
  except OSError:
    return
  for name in names:
    stale = os.path.join(directory, name)
    try:
      if not pattern.fullmatch(name) or os.path.islink(stale) or not is_ours(stale):
        continue
      if os.path.isdir(stale):
        shutil.rmtree(stale)
      else:
        os.unlink(stale)
    except OSError:
      pass  # gone already, or not ours to delete: leave it


def write_atomic(path: str, parts: list) -> None:
  """Writes ``parts`` (bytes or any buffer, e.g. a NumPy array: not copied) to ``path`` atomically."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".tmp-", dir=directory)
  try:
    with os.fdopen(fd, "wb") as f:
      for part in parts:
        f.write(part)
      f.flush()
      os.fsync(f.fileno())  # the bytes are on disk before the name points at them
    # mkstemp creates 0600; give the file the permissions open() would have.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, path)  # atomic: readers see the old file or the new one, never a mix
    fsync_dir(directory)
  except BaseException:
    try:
      os.unlink(tmp)
    except OSError:
      pass
    raise
