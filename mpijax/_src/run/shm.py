"""The shared-memory files of a job, removed after every attempt however it ended.

Open MPI's shared-memory transport keeps one 16 MiB file per rank in
``/dev/shm`` (``sm_segment.<host>.<uid>.<job>.<rank>``), which its launcher
removes at the job's end, unless the job ended too abruptly for it (an
abort, a killed launcher). MPICH keeps one file per node
(``mpich_shm_<id>_<n>``) until its ranks finalize, so a killed rank leaves
it. mpijax's own node-local segments
(``/dev/shm/mpijax-<pid>-...``) are unlinked as soon as every rank mapped
them, so only a job that dies in that moment leaves one. Each rank notes its
process id and the segment files it maps in the job's directory
(``MPIJAX_JOB_FILES``, :mod:`mpijax._src.mpi_util`); after an attempt
mpijax-run removes what of that is left on this host, never another job's.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import tempfile

JOB_FILES_ENV = "MPIJAX_JOB_FILES"
# Open MPI's, MPICH's (mpi_util.SEGMENT_PREFIXES, which the ranks note) and
# mpijax's own.
_PREFIXES = ("sm_segment.", "mpich_shm_", "mpijax-")


class JobFiles:
  """The directory in which the ranks of one mpijax-run job note their files."""

  def __init__(self):
    self.path = tempfile.mkdtemp(prefix="mpijax-run-")

  def clean(self) -> list[str]:
    """Removes the noted files still left on this host (and the notes); the paths removed."""
    removed, host = [], socket.gethostname()
    for name in sorted(os.listdir(self.path)):
      note_path = os.path.join(self.path, name)
      try:
        with open(note_path) as f:
          note = json.load(f)
        os.unlink(note_path)
      except (OSError, ValueError):
        continue
      if note.get("host") != host:
        continue  # another host's files: its launcher's to remove
      pid = int(note.get("pid", 0))
      own = glob.glob(f"/dev/shm/mpijax-{pid}-*") if pid > 0 else []
      for path in list(note.get("segments", [])) + own:
        if _remove(path):
          removed.append(path)
    return removed

  def close(self) -> list[str]:
    """The last :meth:`clean`, then the directory goes."""
    try:
      return self.clean()
    finally:
      shutil.rmtree(self.path, ignore_errors=True)


def _remove(path: str) -> bool:
  """Unlinks a shared-memory file of this user; False if it is gone or not one of ours."""
  if os.path.dirname(path) != "/dev/shm":
    return False
  name = os.path.basename(path)
  if not name.startswith(_PREFIXES):
    return False
  try:
    if os.stat(path).st_uid != os.getuid():
      return False
    os.unlink(path)
    return True
  except OSError:
    return False
