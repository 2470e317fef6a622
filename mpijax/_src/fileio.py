"""Atomic file writes shared by the training and the global-array checkpoints."""

from __future__ import annotations

import os
import tempfile


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
