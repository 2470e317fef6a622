"""Open MPI's session directories that killed launchers left, removed around every launch.

Open MPI 5's launcher (``prterun``, which ``mpirun`` becomes) keeps its
session in ``<tmp>/ompi.<pid>`` (a daemon on another host: ``prted.<pid>``;
``<tmp>`` is ``TMPDIR``, ``TEMP``, ``TMP`` or ``/tmp``) and removes it when it
ends, unless it is killed (a time limit's SIGKILL, the out-of-memory killer).
A later launcher that gets the same process id finds the old PMIx contact
files there and stops at once with "The PMIx server's listener thread failed
to start" (exit status 213). Process ids come round again soon where
``pid_max`` is 32768, as in many containers.

So mpijax-run removes, before every launch and after it, this user's
directories whose launcher is provably gone. The ``<pid>`` in a name is the
launcher's id in its own PID namespace, and containers that share ``<tmp>``
have namespaces of their own: an id that is free here, or another program's,
may be a live launcher's there. A directory goes only if

* mpijax-run recorded its launcher (``ompi.<pid>.mpijax-run``, written when it
  starts one: its PID namespace, start time and the boot), and the record is
  of an earlier boot, or of this PID namespace and no process with that id
  and start time runs here; or
* this process sees every process of the machine (it runs in the first PID
  namespace, which holds every other one), and none that runs a launcher has
  that id in its own namespace.

Any other directory stays, and so does one whose contact file names another
host (a ``<tmp>`` shared between hosts).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
from collections.abc import Mapping

# What those launchers' processes are called (/proc/<pid>/comm).
_LAUNCHERS = frozenset({"prterun", "prted", "prte", "mpirun", "mpiexec"})
# The first PID namespace's inode (the kernel's PROC_PID_INIT_INO).
_INIT_PID_NS = "pid:[4026531836]"
_RECORD = ".mpijax-run"


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


def _read(path: str) -> str | None:
  try:
    with open(path) as f:
      return f.read()
  except OSError:
    return None


def _pid_namespace() -> str | None:
  try:
    return os.readlink("/proc/self/ns/pid")
  except OSError:
    return None


def _boot_id() -> str | None:
  text = _read("/proc/sys/kernel/random/boot_id")
  return text.strip() if text else None


def _start_time(pid: int) -> int | None:
  """Process ``pid``'s start (clock ticks after boot), or None if no such process runs
  (none is seen, or it has exited and waits to be reaped)."""
  text = _read(f"/proc/{pid}/stat")
  if text is None:
    return None
  try:  # the name, in parentheses, may hold spaces and parentheses
    fields = text[text.rindex(")") + 2 :].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])
  except (ValueError, IndexError):
    return None


def _sees_every_process() -> bool:
  """Whether this process runs in the first PID namespace, with its /proc mounted."""
  try:
    return _pid_namespace() == _INIT_PID_NS and os.readlink("/proc/self") == str(os.getpid())
  except OSError:
    return False


def _launcher_ids() -> set[int] | None:
  """Every running launcher's process id in its own PID namespace (NSpid's last entry);
  None where /proc cannot tell."""
  ids = set()
  try:
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
  except OSError:
    return None
  for pid in pids:
    text = _read(f"/proc/{pid}/status")
    if text is None:
      continue  # it ended while this looked
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    if fields.get("State", "").split()[:1] in (["Z"], ["X"]):
      continue  # it has exited
    if fields.get("Name", "").strip() in _LAUNCHERS:
      nspid = fields.get("NSpid", "").split()
      if not nspid:
        return None  # a kernel without NSpid: no way to tell
      ids.add(int(nspid[-1]))
  return ids


def record(pid: int, environ: Mapping[str, str] | None = None) -> str | None:
  """Notes that this process started launcher ``pid`` here: ``<tmp>/ompi.<pid>.mpijax-run``.

  With it, a later mpijax-run in the same PID namespace can tell that the
  launcher is gone, and remove what it left. The path written, or None.
  """
  path = os.path.join(tmp_base(environ), f"ompi.{pid}{_RECORD}")
  data = {"pid": pid, "pid_ns": _pid_namespace(), "start": _start_time(pid), "boot": _boot_id()}
  if data["pid_ns"] is None or data["start"] is None:
    return None  # nothing that could prove it gone later
  try:
    with open(path + ".tmp", "w") as f:
      json.dump(data, f)
    os.replace(path + ".tmp", path)
  except OSError:
    return None
  return path


def _recorded_gone(rec: dict, pid: int) -> bool | None:
  """From mpijax-run's record: True if that launcher is gone, False if it runs, None if the
  record cannot tell (another PID namespace's)."""
  boot = _boot_id()
  if rec.get("boot") and boot and rec["boot"] != boot:
    return True  # a reboot ended it
  if rec.get("pid_ns") != _pid_namespace() or rec.get("pid") != pid:
    return None
  if _read(f"/proc/{pid}/stat") is None and os.path.exists(f"/proc/{pid}"):
    return None  # there, but not readable: it may run
  return _start_time(pid) != rec.get("start")


def _other_host(path: str) -> bool:
  """Whether the directory's PMIx contact files name a host other than this one."""
  me = socket.gethostname().split(".")[0]
  try:
    names = os.listdir(path)
  except OSError:
    return False
  hosts = {m.group(1) for n in names if (m := re.fullmatch(r"pmix\.(.+)\.tool(\..*)?", n))}
  return any(h.split(".")[0] != me for h in hosts)


def stale(base: str) -> list[str]:
  """This user's launcher session directories in ``base``, and mpijax-run's records of
  launchers, whose launcher is provably gone."""
  if not os.path.isdir("/proc"):
    return []  # no way to tell a live launcher from a dead one
  try:
    names = sorted(os.listdir(base))
  except OSError:
    return []
  uid, out = os.getuid(), []
  launchers = None
  for name in names:
    is_record = name.endswith(_RECORD)
    pid = _pid_of(name[: -len(_RECORD)] if is_record else name)
    if pid is None:
      continue
    path = os.path.join(base, name)
    try:
      st = os.lstat(path)
    except OSError:
      continue
    if st.st_uid != uid or not (
      stat.S_ISREG(st.st_mode) if is_record else stat.S_ISDIR(st.st_mode)
    ):
      continue
    if is_record and os.path.lexists(path[: -len(_RECORD)]):
      continue  # goes with its directory
    if not is_record and _other_host(path):
      continue
    rec_path = path if is_record else path + _RECORD
    try:
      with open(rec_path) as f:
        gone = _recorded_gone(json.load(f), pid)
    except (OSError, ValueError, AttributeError):
      gone = None
    if gone is None and _sees_every_process():
      if launchers is None:
        launchers = _launcher_ids()
      gone = None if launchers is None else pid not in launchers
    if gone:
      out.append(path)
  return out


def remove_stale(environ: Mapping[str, str] | None = None) -> list[str]:
  """Removes :func:`stale` directories (with mpijax-run's records of their launchers) and
  records of the launcher's ``<tmp>``; the directories removed."""
  removed = []
  for path in stale(tmp_base(environ)):
    if path.endswith(_RECORD):
      try:
        os.unlink(path)
      except OSError:
        pass
      continue
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.lexists(path):
      removed.append(path)
      try:
        os.unlink(path + _RECORD)
      except OSError:
        pass
  return removed
