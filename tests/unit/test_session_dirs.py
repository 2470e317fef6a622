"""Open MPI's session directories that mpijax-run removes: only those whose launcher is
provably gone (mpijax/_src/launch/session_dirs.py).

Real processes throughout: "launchers" are Python processes named prterun, and
the PID namespaces are real ones (``unshare --pid``, root only), as when
containers share ``/tmp``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from mpijax._src.launch import session_dirs

MODULE = session_dirs.__file__
ROOT = pytest.mark.skipif(
  os.getuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare (--pid)"
)
FIRST_NAMESPACE = pytest.mark.skipif(
  not session_dirs._sees_every_process(),
  reason="judges directories nobody recorded: only a process that sees every process can",
)

# A program that loads session_dirs alone (not mpijax, for speed), calls itself prterun,
# and runs the code it is given with `sd` the module.
PRELUDE = textwrap.dedent(
  f"""
  import ctypes, importlib.util, json, os, sys, time
  spec = importlib.util.spec_from_file_location("sd", {MODULE!r})
  sd = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(sd)
  ctypes.CDLL(None).prctl(15, b"prterun", 0, 0, 0)
  """
)


def _dead_pid() -> int:
  """The id of a process that has just ended (ids do not come round within a test)."""
  proc = subprocess.Popen(["true"])
  proc.wait()
  return proc.pid


def _start(cmd: list[str]) -> tuple[subprocess.Popen, str]:
  """Starts ``cmd``; (the process, the first line it prints)."""
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
  line = proc.stdout.readline().strip()
  assert line, proc.wait()
  return proc, line


def _launcher(tmp: str, code: str = "", wrap: list[str] = ()) -> tuple[subprocess.Popen, str]:
  """A live process named prterun that runs ``code``, prints a line and sleeps."""
  body = PRELUDE + f"tmp = {tmp!r}\n" + textwrap.dedent(code) + "\nprint(os.getpid(), flush=True)\n"
  return _start([*wrap, sys.executable, "-c", body + "time.sleep(120)"])


def _stop(*procs: subprocess.Popen) -> None:
  """Kills each process and its descendants, and waits until none of them runs."""
  tree = [p.pid for p in procs]
  for pid in tree:  # parents first
    tree += [c for c in _children(pid) if c not in tree]
  for pid in reversed(tree):
    try:
      os.kill(pid, 9)
    except ProcessLookupError:
      pass
  for p in procs:
    p.wait()
  deadline = time.monotonic() + 10
  while any(session_dirs._start_time(pid) is not None for pid in tree):
    assert time.monotonic() < deadline, [p for p in tree if os.path.exists(f"/proc/{p}")]
    time.sleep(0.05)


def _children(pid: int) -> list[int]:
  out = []
  for p in os.listdir("/proc"):
    stat = session_dirs._read(f"/proc/{p}/stat") if p.isdigit() else None
    if stat and int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
      out.append(int(p))
  return out


def _names(paths) -> list[str]:
  return sorted(os.path.basename(p) for p in paths)


@FIRST_NAMESPACE
def test_unrecorded_dirs_of_gone_launchers_are_stale_and_a_live_launchers_stays(tmp_path):
  """Seen from the first PID namespace: a directory whose id no running launcher has (the
  process is gone, or it is another program) is stale; a running launcher's, other users',
  other names and files are not."""
  dead, me = _dead_pid(), os.getpid()
  launcher, _ = _launcher(str(tmp_path))
  try:
    stale = [f"ompi.{dead}", f"prted.{dead}", f"ompi.{me}"]
    kept = [f"ompi.{launcher.pid}", "ompi.vm.0", "ompi.vm", "ompi.12x", "prte.vm.0"]
    for name in stale + kept:
      (tmp_path / name).mkdir()
    a_file = f"ompi.{_dead_pid()}"
    (tmp_path / a_file).write_text("a file, not a session directory")
    if os.getuid() == 0:  # another user's: never ours to remove
      other = tmp_path / f"ompi.{_dead_pid()}"
      other.mkdir()
      os.chown(other, 65534, 65534)
      kept.append(other.name)
    elsewhere = tmp_path / f"ompi.{_dead_pid()}"  # a launcher on another host, same <tmp>
    elsewhere.mkdir()
    (elsewhere / "pmix.some-other-host.tool").write_text("")
    kept.append(elsewhere.name)
    assert _names(session_dirs.stale(str(tmp_path))) == sorted(stale)
    removed = session_dirs.remove_stale({"TMPDIR": str(tmp_path)})
    assert _names(removed) == sorted(stale)
    assert sorted(os.listdir(tmp_path)) == sorted(kept + [a_file])
  finally:
    _stop(launcher)


def test_mpijax_runs_record_tells_a_gone_launcher_in_this_namespace(tmp_path):
  """A launcher mpijax-run recorded: its directory stays while it runs, and goes with the
  record once it has ended, or once its id belongs to a process started later."""
  env = {"TMPDIR": str(tmp_path)}
  live, _ = _launcher(str(tmp_path))
  ended, _ = _launcher(str(tmp_path))
  reused, _ = _launcher(str(tmp_path))
  try:
    for p in (live, ended, reused):
      assert session_dirs.record(p.pid, env) == str(tmp_path / f"ompi.{p.pid}.mpijax-run")
      (tmp_path / f"ompi.{p.pid}").mkdir()
    _stop(ended)
    # As if the id had come round: the record is of a process started earlier.
    rec = tmp_path / f"ompi.{reused.pid}.mpijax-run"
    data = json.loads(rec.read_text())
    rec.write_text(json.dumps({**data, "start": data["start"] - 1}))
    gone = [f"ompi.{ended.pid}", f"ompi.{reused.pid}"]
    assert _names(session_dirs.remove_stale(env)) == sorted(gone)
    assert sorted(os.listdir(tmp_path)) == sorted(
      [f"ompi.{live.pid}", f"ompi.{live.pid}.mpijax-run"]
    )
  finally:
    _stop(live, reused)
  # A record without its directory goes once its launcher has ended.
  shutil.rmtree(tmp_path / f"ompi.{live.pid}")
  assert session_dirs.remove_stale(env) == [] and os.listdir(tmp_path) == []


@ROOT
def test_a_live_launcher_in_another_pid_namespace_keeps_its_directory(tmp_path):
  """Containers that share /tmp: a launcher in a PID namespace of its own names its
  directory by its id there. Here one is id 1 (another program in this namespace) and one
  an id no process has here; both directories stay while they run, recorded by their own
  namespace's mpijax-run or not, and go once they have ended."""
  tmp = str(tmp_path)
  here = {int(p) for p in os.listdir("/proc") if p.isdigit()}
  free = random.choice([p for p in range(20000, 30000) if p + 2 not in here and p + 1 not in here])
  make = "os.mkdir(f'{tmp}/ompi.{os.getpid()}')\n"
  as_pid_1, line1 = _launcher(tmp, make, ["unshare", "--pid", "--fork", "--kill-child"])
  # Its namespace's mpijax-run recorded it; /proc of that namespace, for the record.
  as_free_id, line2 = _start(
    [
      "unshare",
      "--pid",
      "--fork",
      "--kill-child",
      "--mount-proc",
      "sh",
      "-c",
      f'echo {free} > /proc/sys/kernel/ns_last_pid && exec "$0" "$@"',
      sys.executable,
      "-c",
      PRELUDE
      + f"tmp = {tmp!r}\n"
      + "r = os.fork()\n"
      + "if r == 0:\n"
      + "  os.mkdir(f'{tmp}/ompi.{os.getpid()}')\n"
      + "  assert sd.record(os.getpid(), {'TMPDIR': tmp})\n"
      + "  print(os.getpid(), flush=True)\n"
      + "  time.sleep(120)\n"
      + "os.waitpid(r, 0)\n",
    ]
  )
  try:
    other_ids = [int(line1), int(line2)]
    assert other_ids == [1, free + 1], other_ids
    assert not os.path.exists(f"/proc/{free + 1}") or _comm(free + 1) != "prterun"
    dirs = sorted(["ompi.1", f"ompi.{free + 1}", f"ompi.{free + 1}.mpijax-run"])
    assert sorted(os.listdir(tmp_path)) == dirs
    assert session_dirs.stale(tmp) == []
    assert session_dirs.remove_stale({"TMPDIR": tmp}) == []
    assert sorted(os.listdir(tmp_path)) == dirs
  finally:
    _stop(as_pid_1, as_free_id)
  if session_dirs._sees_every_process():
    assert _names(session_dirs.remove_stale({"TMPDIR": tmp})) == ["ompi.1", f"ompi.{free + 1}"]
    assert os.listdir(tmp_path) == []


@ROOT
def test_in_a_namespace_of_its_own_only_recorded_dirs_are_judged(tmp_path):
  """mpijax-run in a container (a PID namespace that does not see the others): its own
  record proves its killed launcher gone; a directory nobody recorded, or another
  namespace's record, stays, as its launcher may run elsewhere."""
  tmp = str(tmp_path)
  stranger = tmp_path / f"ompi.{_dead_pid()}"  # no record: any namespace's
  stranger.mkdir()
  foreign = tmp_path / f"ompi.{_dead_pid()}"  # recorded in this namespace, judged in another
  foreign.mkdir()
  data = {"pid": int(foreign.name[5:]), "pid_ns": session_dirs._pid_namespace(), "start": 1}
  data["boot"] = session_dirs._boot_id()
  (tmp_path / f"{foreign.name}.mpijax-run").write_text(json.dumps(data))
  code = PRELUDE + textwrap.dedent(
    f"""
    tmp = {tmp!r}
    env = {{"TMPDIR": tmp}}
    assert not sd._sees_every_process()
    child = os.fork()
    if child == 0:
      time.sleep(120)
    os.mkdir(f"{{tmp}}/ompi.{{child}}")
    assert sd.record(child, env)
    os.kill(child, 9)
    os.waitpid(child, 0)
    print(json.dumps([child, sd.remove_stale(env), sorted(os.listdir(tmp))]), flush=True)
    """
  )
  r = subprocess.run(
    ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", code],
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert r.returncode == 0, r.stdout + r.stderr
  child, removed, left = json.loads(r.stdout)
  assert removed == [f"{tmp}/ompi.{child}"]
  assert left == sorted([stranger.name, foreign.name, f"{foreign.name}.mpijax-run"])


def _comm(pid: int) -> str:
  try:
    with open(f"/proc/{pid}/comm") as f:
      return f.read().strip()
  except OSError:
    return ""
