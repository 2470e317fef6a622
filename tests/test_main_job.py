"""The README's main job, as a user runs it: 4-rank training on the bundled digits.

Then, started again with more epochs under another rank count (2), it resumes
from its last checkpoint and trains one epoch on.
"""

from __future__ import annotations

import json
import re
import sys

from tests._launch import run_mpi
from tests._launch import tail


def _digits(out, *args: str) -> list[str]:
  return [
    sys.executable,
    "-m",
    "mpijax.examples.digits",
    "--out",
    str(out),
    "--no-progress",
    "--min-accuracy",
    "0.97",
    *args,
  ]


def test_several_devices_per_rank_are_refused_with_the_command_that_uses_them(tmp_path):
  import os
  import subprocess

  from tests._launch import REPO

  env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "SLURM_"))}
  env.update(MPIJAX_DEVICES_PER_PROCESS="2", MPIJAX_LAUNCHER="single")
  out = subprocess.run(
    _digits(tmp_path / "out"), capture_output=True, text=True, timeout=180, cwd=REPO, env=env
  )
  assert out.returncode == 1, out.stdout + out.stderr
  assert "this rank has 2 local devices" in out.stderr, out.stderr
  assert "mpijax-run -n 2 -- python -m mpijax.examples.digits" in out.stderr, out.stderr
  assert not (tmp_path / "out").exists()  # refused before any training or checkpoint


def test_main_job_then_resume_at_another_rank_count(digits_4_ranks):
  out, result = digits_4_ranks  # conftest.MAIN_JOB, shared with tests/test_restart.py
  assert result.returncode == 0, tail(result.stdout)
  summary = json.loads((out / "metrics.json").read_text())["summary"]
  assert summary["ranks"] == 4 and summary["test_accuracy"] >= 0.97, summary
  assert summary["train_samples_per_s"] > 0, summary
  assert (out / "checkpoints" / f"step_{summary['steps']:09d}.ckpt").is_file()
  assert (out / "curves.png").stat().st_size > 0
  assert "final test accuracy" in result.stdout, tail(result.stdout)
  assert f"params sha256 {summary['params_sha256']}" in result.stdout, tail(result.stdout)

  # Started again with the same --out, it resumes by itself.
  resumed, _ = run_mpi(2, _digits(out, "--epochs", str(summary["epochs"] + 1)), timeout=300)
  assert resumed.returncode == 0, tail(resumed.stdout)
  assert f"at step {summary['steps']} (epoch {summary['epochs']}, step 0 " in resumed.stdout, tail(
    resumed.stdout
  )
  after = json.loads((out / "metrics.json").read_text())
  assert after["summary"]["ranks"] == 2 and after["summary"]["steps"] > summary["steps"]
  assert len(after["history"]["test_accuracy"]) == summary["epochs"] + 1
  assert after["summary"]["test_accuracy"] >= 0.97, after["summary"]


def test_rank_0_draws_the_progress_bar_under_mpijax_run(digits_4_ranks):
  # Open MPI hands each rank a terminal 0 columns wide and passes its output on
  # line by line: the bar comes as lines, from rank 0 only, one at least per epoch,
  # each with one prefix.
  _, result = digits_4_ranks
  bars = re.findall(
    r"^\[rank(\d+)\]: (epoch (\d+)/12: +\d+%\|[█▏▎▍▌▋▊▉ ]+\| \d+/23 .*)$",
    result.stdout,
    flags=re.M,
  )
  assert bars, tail(result.stdout)
  assert {rank for rank, _, _ in bars} == {"0"}, bars
  assert {int(epoch) for _, _, epoch in bars} == set(range(1, 13)), bars
  finished = [bar for _, bar, _ in bars if "100%|" in bar and "23/23" in bar]
  assert len(finished) == 12 and len(finished[0]) >= 60, finished


def test_another_models_checkpoint_says_how_to_start_fresh(digits_4_ranks):
  # The CNN's directory given to the Flax model: refused, naming --fresh and --out.
  out, _ = digits_4_ranks
  result, _ = run_mpi(2, _digits(out, "--model", "flax-bn"), timeout=300)
  assert result.returncode != 0, tail(result.stdout)
  assert (
    f"{out / 'checkpoints'} holds the checkpoints of another run than --model flax-bn"
    in result.stdout
  ), tail(result.stdout)
  assert "pass --fresh to start over there, or --out DIR" in result.stdout, tail(result.stdout)
