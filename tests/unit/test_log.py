"""The "mpijax" logger: rank tags, notices on rank 0 only, the default stderr handler."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import pytest

from mpijax._src import log
from tests._launch import REPO
from tests._launch import run_mpi
from tests._launch import tail

_LAUNCH_VARS = ("OMPI_", "PMI_", "PMIX_", "SLURM_", "MPIJAX_LOG_LEVEL")

SAY = "from mpijax._src import log; log.warning('careful'); log.notice('fyi')"


def _python(code: str, prelude: str = "", **env: str) -> subprocess.CompletedProcess:
  """Runs ``prelude``, ``import mpijax``, ``code`` in a fresh interpreter (no MPI, no
  pytest logging) with ``env`` added."""
  clean = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_VARS)}
  return subprocess.run(
    [sys.executable, "-c", f"{prelude}\nimport mpijax\n{code}"],
    capture_output=True,
    text=True,
    timeout=120,
    cwd=REPO,
    env={**clean, **env},
  )


def test_without_logging_setup_warnings_and_rank_0_notices_reach_stderr():
  out = _python(SAY, OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="4")
  assert out.returncode == 0, out.stderr
  assert out.stderr == "mpijax[rank 0/4]: warning: careful\nmpijax[rank 0/4]: fyi\n", out.stderr
  assert out.stdout == ""


def test_other_ranks_notices_show_only_at_debug():
  out = _python(SAY, PMI_RANK="2", PMI_SIZE="4")
  assert out.stderr == "mpijax[rank 2/4]: warning: careful\n", out.stderr
  out = _python(SAY, PMI_RANK="2", PMI_SIZE="4", MPIJAX_LOG_LEVEL="debug")
  assert out.stderr == "mpijax[rank 2/4]: warning: careful\nmpijax[rank 2/4]: fyi\n", out.stderr


def test_outside_a_job_the_tag_has_no_rank():
  out = _python(SAY)
  assert out.stderr == "mpijax: warning: careful\nmpijax: fyi\n", out.stderr


def test_under_mpijax_run_the_tag_has_no_rank():
  # mpijax-run starts every line of the rank's output with "[rank1]: " itself.
  out = _python(SAY, OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="4", MPIJAX_RUN="1")
  assert out.stderr == "mpijax: warning: careful\n", out.stderr


ABORT = """
import jax, jax.numpy as jnp
from mpijax._src.guards import failure
failure.install()
def main():
  jax.jit(lambda x: x.reshape(7))(jnp.ones(4))  # JAX shortens this error's traceback
main()
"""


@pytest.mark.parametrize("tagged", [False, True])
def test_an_abort_report_ends_with_the_exception(tagged):
  env = dict(OMPI_COMM_WORLD_RANK="2", OMPI_COMM_WORLD_SIZE="4")
  out = _python(ABORT, **env, **({"MPIJAX_RUN": "1"} if tagged else {}))
  assert out.returncode == 1, out.stderr
  lines = out.stderr.splitlines()
  p = "" if tagged else "[rank 2/4] "
  assert lines[0].startswith(f"{p}mpijax: uncaught TypeError on rank 2/4, aborting the job"), lines
  assert lines[1] == f"{p}Traceback (most recent call last):", lines
  assert all(line.startswith(p) for line in lines), lines
  # JAX's note on its shortened traceback ("... of the following exception") is left out.
  assert "internal frames" not in out.stderr and "-----" not in out.stderr, out.stderr
  assert lines[-1].startswith(f"{p}TypeError: cannot reshape array of shape (4,)"), lines


def test_log_level_setting():
  assert _python(SAY, MPIJAX_LOG_LEVEL="WARNING").stderr == "mpijax: warning: careful\n"
  assert _python(SAY, MPIJAX_LOG_LEVEL="error").stderr == ""
  bad = _python(SAY, MPIJAX_LOG_LEVEL="loud")
  assert bad.returncode != 0
  assert "MPIJAX_LOG_LEVEL='loud' is not valid: expected a logging level" in bad.stderr, bad.stderr


def test_a_level_the_program_set_before_import_is_kept():
  out = _python(SAY, "import logging; logging.getLogger('mpijax').setLevel(logging.WARNING)")
  assert out.stderr == "mpijax: warning: careful\n", out.stderr


def test_the_programs_logging_setup_replaces_the_default_handler():
  # Configured after the import: the records go to the program's handler, once.
  code = (
    "import logging; logging.basicConfig(format='APP %(levelname)s %(name)s %(message)s')\n" + SAY
  )
  out = _python(code, SLURM_PROCID="0", SLURM_NTASKS="2")
  assert out.stderr == (
    "APP WARNING mpijax mpijax[rank 0/2]: warning: careful\nAPP INFO mpijax mpijax[rank 0/2]: fyi\n"
  ), out.stderr
  # A handler on the "mpijax" logger itself also replaces it.
  code = (
    "import logging, sys; h = logging.StreamHandler(sys.stdout); "
    "logging.getLogger('mpijax').addHandler(h)\n" + SAY
  )
  out = _python(code)
  assert out.stderr == "" and out.stdout == "mpijax: warning: careful\nmpijax: fyi\n", out


def _without_a_job(monkeypatch):
  """This process as outside any job: no launcher variables, no MPI to ask."""
  for var in [v for v in os.environ if v.startswith(_LAUNCH_VARS)]:
    monkeypatch.delenv(var)
  monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)


def test_records_reach_caplog(caplog, monkeypatch):
  _without_a_job(monkeypatch)
  log.warning("careful")
  [record] = [r for r in caplog.records if r.name == "mpijax"]
  assert record.levelno == logging.WARNING
  assert record.getMessage() == "mpijax: warning: careful"


def test_rank_label_from_the_launchers_variables(monkeypatch):
  _without_a_job(monkeypatch)
  assert log.rank_label() == "rank ?"
  monkeypatch.setenv("PMIX_RANK", "3")
  assert log.rank_label() == "rank 3"
  monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
  monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")
  assert log.rank_label() == "rank 1/8"


JOB = """
import numpy as np
import mpijax
from mpijax import train
from mpijax._src import log
rt = mpijax.init()
log.warning(f"careful on {rt.rank}")
log.notice("fyi")
# A real warning of mpijax's: replicas that drifted apart, said by rank 0.
train.save_checkpoint(__import__("sys").argv[1], {"x": np.full(3, float(rt.rank == 1))})
"""


def test_in_a_job_every_rank_warns_and_rank_0_notices(tmp_path):
  script = tmp_path / "job.py"
  script.write_text(JOB)
  result, _ = run_mpi(2, [sys.executable, str(script), str(tmp_path / "ckpt")], timeout=240)
  out = result.stdout
  assert result.returncode == 0, tail(out)
  # mpijax-run prefixes each line with the rank: mpijax's messages leave theirs out.
  for r in (0, 1):
    assert f"[rank{r}]: mpijax: warning: careful on {r}" in out, tail(out)
  assert "[rank0]: mpijax: fyi" in out and "[rank1]: mpijax: fyi" not in out, tail(out)
  assert "mpijax[rank" not in out, tail(out)
  drift = re.findall(
    r"\[rank(\d)\]: mpijax: warning: save_checkpoint\(.*\): the state on "
    r"ranks \[1\] differs from rank 0's",
    out,
  )
  assert drift == ["0"], tail(out)
