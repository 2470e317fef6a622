"""mpijax-run as an ordinary user (the rest of the suite runs as root).

Runs as `nobody` through `runuser`: the dry-run command has no
--allow-run-as-root, and a real 2-rank job starts and reports its ranks. The
test gives `nobody` search (x) permission on the directories above this
Python and this checkout that lack it (e.g. /root), and restores them.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests._launch import REPO
from tests._launch import tail

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("runuser") is None,
    reason="needs root (to switch to the user 'nobody' with runuser)")


def _ancestors(path: Path) -> list[Path]:
  path = path.resolve()
  return [p for p in [path, *path.parents] if p.is_dir()]


@pytest.fixture
def nobody_env():
  changed = []
  # A venv's python is a link to the base interpreter (e.g. under /root/.pyenv).
  dirs = {*_ancestors(Path(sys.prefix)), *_ancestors(Path(sys.base_prefix)),
          *_ancestors(Path(sys.executable).parent),
          *_ancestors(Path(sys.executable).resolve().parent), *_ancestors(REPO)}
  for d in sorted(dirs):
    mode = d.stat().st_mode
    if not mode & stat.S_IXOTH:
      os.chmod(d, mode | stat.S_IXOTH)
      changed.append((d, mode))
  home = tempfile.mkdtemp(prefix="mpijax-nobody-")
  shutil.chown(home, "nobody")
  env = {"HOME": home, "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
         "PYTHONPATH": str(REPO), "TMPDIR": home}
  try:
    yield env, home
  finally:
    for d, mode in changed:
      os.chmod(d, mode)
    shutil.rmtree(home, ignore_errors=True)


def _as_nobody(env, *argv, timeout=180):
  cmd = ["runuser", "-u", "nobody", "--", "env", "-i", *[f"{k}={v}" for k, v in env.items()],
         sys.executable, "-m", "mpijax.launch", *argv]
  return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=env["HOME"])


def test_mpijax_run_as_an_ordinary_user(nobody_env):
  env, home = nobody_env
  dry = _as_nobody(env, "-n", "2", "--dry-run", "--", "python", "-c", "pass")
  assert dry.returncode == 0, dry.stderr
  assert "--allow-run-as-root" not in dry.stdout and "-m mpijax -c pass" in dry.stdout, dry.stdout
  run = _as_nobody(env, "-n", "2", "--timeout", "120", "--", "python", "-c",
                   "import os, mpijax; rt = mpijax.init(); print('UID', os.getuid(), rt.rank, rt.size)")
  out = run.stdout + run.stderr
  assert run.returncode == 0, tail(out)
  rows = sorted(line.split("UID", 1)[1].split() for line in out.splitlines() if "UID" in line)
  assert [r[1:] for r in rows] == [["0", "2"], ["1", "2"]], tail(out)
  assert all(r[0] != "0" for r in rows), "the ranks ran as root"
