"""Training jobs as a scheduler sees them: preemption signals, resume, the Flax BatchNorm example.

Each test starts real ``mpijax-run`` jobs, bounded by timeouts.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests._launch import REPO
from tests._launch import mpirun_command
from tests._launch import run_mpi
from tests._launch import tail

SCRIPT = str(REPO / "tests" / "scripts" / "train_preempt.py")
STEPS = 60
TIMEOUT = 240


def _start(n: int, directory: Path, pace: float) -> subprocess.Popen:
  env = dict(os.environ, MPIJAX_DEVICES_PER_PROCESS="1", MPIJAX_TIMEOUT="60")
  cmd = mpirun_command(n, 1, True, TIMEOUT) + [sys.executable, SCRIPT, str(directory), str(STEPS),
                                                str(pace)]
  return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env, cwd=str(REPO), start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = TIMEOUT) -> str:
  try:
    out, _ = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate()
    pytest.fail(f"the job did not end within {timeout}s (a hang):\n{tail(out)}")
  return out


def _wait_for_progress(proc: subprocess.Popen, directory: Path, steps: int, ranks: int) -> None:
  deadline = time.monotonic() + TIMEOUT
  progress = directory / "progress"
  while time.monotonic() < deadline:
    if (progress.exists() and int(progress.read_text() or 0) >= steps
        and len(list((directory / "pids").glob("*"))) == ranks):
      return
    if proc.poll() is not None:
      pytest.fail(f"the job ended before step {steps}:\n{tail(_finish(proc))}")
    time.sleep(0.1)
  os.killpg(proc.pid, signal.SIGKILL)
  pytest.fail(f"no step {steps} within {TIMEOUT}s:\n{tail(_finish(proc))}")


def _pids(directory: Path) -> dict[int, int]:
  return {int(p.name): int(p.read_text()) for p in (directory / "pids").iterdir()}


def _digests(out: str, ranks: int) -> set[str]:
  found = re.findall(rf"rank (\d+): finished at step {STEPS}, state sha256 (\w+)", out)
  assert sorted(int(r) for r, _ in found) == list(range(ranks)), tail(out)
  return {d for _, d in found}


def _preempt(tmp_path: Path, name: str, ranks: int, sig: int, victims: str) -> tuple[Path, int]:
  """Starts a paced run, signals one rank or all, and checks the stop; returns (dir, step)."""
  from mpijax._src.train.replicated_checkpoint import read_checkpoint

  directory = tmp_path / name
  proc = _start(ranks, directory, pace=0.1)
  _wait_for_progress(proc, directory, 5, ranks)
  pids = _pids(directory)
  for rank in ([ranks - 1] if victims == "one" else range(ranks)):
    os.kill(pids[rank], sig)
  out = _finish(proc)
  assert proc.returncode == 75, f"exit {proc.returncode}\n{tail(out)}"
  stops = re.findall(r"rank (\d+): preempted after step (\d+), checkpoint (\S+), exit status 75", out)
  assert sorted(int(r) for r, _, _ in stops) == list(range(ranks)), tail(out)
  steps = {int(s) for _, s, _ in stops}
  assert len(steps) == 1, f"the ranks stopped at different steps {steps}\n{tail(out)}"
  step = steps.pop()
  assert 5 <= step < STEPS, tail(out)
  assert "MPI_ABORT" not in out, tail(out)  # a clean exit on every rank, not an abort
  # One complete checkpoint (magic, header, checksum verified), no temporary left.
  files = sorted(os.listdir(directory / "checkpoints"))
  assert files == [f"step_{step:09d}.ckpt"], files
  header, _, _, _ = read_checkpoint(directory / "checkpoints" / files[0])
  assert header["metadata"]["step"] == step
  return directory, step


def test_preemption_of_one_rank_checkpoints_exits_75_and_the_restart_ends_bit_for_bit(tmp_path):
  reference, _ = run_mpi(4, [sys.executable, SCRIPT, str(tmp_path / "reference"), str(STEPS)],
                         timeout=TIMEOUT)
  assert reference.returncode == 0, tail(reference.stdout)
  want = _digests(reference.stdout, 4)
  assert len(want) == 1, want

  directory, step = _preempt(tmp_path, "preempted", 4, signal.SIGUSR1, victims="one")
  # mpijax-run numbers the attempts it makes itself; a fresh launch is attempt 0.
  resumed, _ = run_mpi(4, [sys.executable, SCRIPT, str(directory), str(STEPS)], timeout=TIMEOUT)
  assert resumed.returncode == 0, tail(resumed.stdout)
  assert f"rank 0: resumed at step {step} (attempt 0)" in resumed.stdout, tail(resumed.stdout)
  assert _digests(resumed.stdout, 4) == want


def test_sigterm_to_every_rank_checkpoints_once_and_exits_75(tmp_path):
  _preempt(tmp_path, "terminated", 2, signal.SIGTERM, victims="all")


# --- the Flax BatchNorm example: 4 ranks train as 1 -----------------------------------------

def _digits_flax(out: Path, ranks: int, *extra: str) -> str:
  argv = [sys.executable, "-m", "mpijax.examples.digits", "--model", "flax-bn", "--epochs", "3",
          "--out", str(out), "--no-progress", "--checkpoint-every", "5", "--keep-checkpoints", "100",
          *extra]
  result, _ = run_mpi(ranks, argv, timeout=TIMEOUT)
  assert result.returncode == 0, tail(result.stdout)
  return result.stdout


def test_flax_batchnorm_example_4_ranks_equal_1_rank(tmp_path):
  from mpijax._src import tree_codec
  from mpijax._src.train.replicated_checkpoint import read_checkpoint

  out = _digits_flax(tmp_path / "four", 4, "--min-accuracy", "0.97")
  assert re.search(r"params sha256 [0-9a-f]{64} \(step 69\)", out), tail(out)
  four = json.loads((tmp_path / "four" / "metrics.json").read_text())["summary"]
  assert four["test_accuracy"] >= 0.97, four
  _digits_flax(tmp_path / "one", 1, "--max-steps", "5")  # the same global batches, on one rank
  # Compared after 5 steps: Adam turns last-bit differences of near-zero
  # gradients into differences of up to the learning rate per step, so two
  # summation orders drift apart over a whole run while both learn alike.
  leaves = {}
  for name in ("four", "one"):
    _, specs, payload, _ = read_checkpoint(tmp_path / name / "checkpoints" / "step_000000005.ckpt")
    leaves[name] = dict(zip((s.path for s in specs), tree_codec.unpack(payload, specs)))
  compared = [p for p in leaves["four"] if p.startswith((".params", ".model_state"))]
  assert any("batch_stats" in p for p in compared) and len(compared) == 17, compared
  for path in compared:
    a, b = leaves["four"][path], leaves["one"][path]
    # float32 sums in another order: equal to a few ulps of the leaf's scale per step
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * float(np.abs(b).max()) + 1e-7, err_msg=path)
