"""Open MPI's session directories that killed launchers left, removed around every launch.

Open MPI 5's launcher (``prterun``, which ``mpirun`` becomes) keeps its
session in ``<tmp>/ompi.<pid>`` (a daemon on another host: ``prted.<pid>``;
``<tmp>`` is ``TMPDIR``, ``TEMP``, ``TMP`` or ``/tmp``) and removes it when it
ends, unless it is killed (a time limit's SIGKILL, the out-of-memory killer).
A later launcher that gets the same process id finds the old PMIx contact
files there and stops at once with "The PMIx server's listener thread failed
to start" (exit status 213). Process ids come round again soon where
``pid_max`` is 32768, as in many containers. So mpijax-run removes, before
every launch and after it, the directories of this user whose process is
gone or is no launcher any more; a running launcher's stays.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from collections.abc import Mapping

# What those launchers' processes are called (/proc/<pid>/comm).
_LAUNCHERS = frozenset({"prterun", "prted", "prte", "mpirun", "mpiexec"})


def tmp_base(environ: Mapping[str, str] | None = None) -> str:
  """Where Open MPI's launcher puts its session directory (PRRTE's choice)."""
  env = os.environ if environ is None else environ
  for key in ("TMPDIR", "TEMP", "TMP"):
    if env.get(key):
      return env[key]
  return "/tmp"


def _pid_of(name: str) -> int | None:
  """The launcher's process id in a session directory's name, or None if it is not one.

  Only ``ompi.<pid>`` and ``prted.<pid>``: ``ompi.<host>.<uid>`` is the MPI
  processes' own session directory, which a running singleton may use.
  """
  m = re.fullmatch(r"(ompi|prted)\.(\d+)", name)
  return None if m is None else int(m.group(2))


def _runs_a_launcher(pid: int) -> bool | None:
  """Whether process ``pid`` is a launcher; None where /proc cannot tell."""
  try:
    with open(f"/proc/{pid}/comm") as f:
      return f.read().strip() in _LAUNCHERS
  except FileNotFoundError:
    return False
  except OSError:
    return None


def stale(base: str) -> list[str]:
  """This user's launcher session directories in ``base`` whose launcher is gone."""
  if not os.path.isdir("/proc"):
    return []  # no way to tell a live launcher from a dead one
  try:
    names = sorted(os.listdir(base))
  except OSError:
    return []
  uid, out = os.getuid(), []
  for name in names:
    pid = _pid_of(name)
    if pid is None:
      continue
    path = os.path.join(base, name)
    try:
      st = os.lstat(path)
    except OSError:
      continue
    if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and _runs_a_launcher(pid) is False:
      out.append(path)
  return out


def remove_stale(environ: Mapping[str, str] | None = None) -> list[str]:
  """Removes :func:`stale` directories of the launcher's ``<tmp>``; the paths removed."""
  removed = []
  for path in stale(tmp_base(environ)):
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.lexists(path):
      removed.append(path)
  return removed
