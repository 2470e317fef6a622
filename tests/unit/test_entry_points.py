"""The abort-on-exception wrapper: ``python -m mpijax``."""

from __future__ import annotations

import os
import subprocess
import sys

from tests._launch import REPO

_LAUNCH_VARS = ("OMPI_", "PMI_", "PMIX_", "SLURM_")


def _run(*argv: str) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_VARS)}
  return subprocess.run(
    [sys.executable, *argv], capture_output=True, text=True, timeout=120, cwd=REPO, env=env
  )


def test_runs_code_script_and_module_with_their_arguments(tmp_path):
  out = _run("-m", "mpijax", "-c", "import sys; print(sys.argv)", "a", "b")
  assert out.returncode == 0 and out.stdout == "['-c', 'a', 'b']\n", out
  script = tmp_path / "s.py"
  script.write_text("import sys; print(__name__, sys.argv[1:])\n")
  out = _run("-m", "mpijax", str(script), "x")
  assert out.returncode == 0 and out.stdout == "__main__ ['x']\n", out
  out = _run("-m", "mpijax", "-m", "json.tool", "--help")
  assert out.returncode == 0 and "json.tool" in out.stdout, out


def test_an_uncaught_exception_or_exit_status_ends_the_process():
  out = _run("-m", "mpijax", "-c", "raise ValueError('deliberate')")
  assert out.returncode == 1, out
  assert "mpijax: uncaught ValueError" in out.stderr and "ValueError: deliberate" in out.stderr
  assert _run("-m", "mpijax", "-c", "raise SystemExit(3)").returncode == 3


def test_usage_names_python_m_mpijax():
  out = _run("-m", "mpijax", "--help")
  assert out.returncode == 0
  assert out.stdout.startswith(
    "usage: python -m mpijax (script.py | -m module | -c code | --exec PROGRAM)"
  ), out
  assert _run("-m", "mpijax").returncode == 2
