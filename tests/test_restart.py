"""Fault injection under the real launcher: one rank of the digits job SIGKILLed at a random step.

``mpijax-run --max-restarts 1`` restarts the job; the digits example resumes
from the last complete checkpoint in its output directory (with its data
position) and must finish with >= 97 % test accuracy and parameters bit for
bit equal to an uninterrupted run at the same rank count (compared through
the parameter digest the example prints at the end). The test also prints
how long the restart took, from the kill to the restarted job's "resumed
from" line (the first step follows after JAX's compilation).

The seed of the random choice (which epoch, how far into it, which rank) is
printed; MPIJAX_TEST_KILL_SEED repeats a run.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

from tests._launch import REPO
from tests._launch import tail

RANKS = 4
EPOCHS = 12
TIMEOUT = 420

_DIGEST = re.compile(r"params sha256 ([0-9a-f]{64})")
_ACCURACY = re.compile(r"final test accuracy ([0-9.]+)")
_RESUMED = re.compile(r"resumed from \S+ at step (\d+)")


class _Job:
  """mpijax-run in the background; every output line kept with the time it arrived."""

  def __init__(self, argv: list[str], env: dict[str, str]):
    self.lines: list[tuple[float, str]] = []
    self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, start_new_session=True)
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self) -> None:
    for line in self.proc.stdout:
      self.lines.append((time.time(), line.rstrip("\n")))

  def wait_for(self, pattern: str, timeout: float, after: float = 0.0) -> float | None:
    """Arrival time of the first line (arrived after ``after``) containing ``pattern``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
      for t, line in list(self.lines):
        if t >= after and pattern in line:
          return t
      if self.proc.poll() is not None and not self._reader.is_alive():
        return None
      time.sleep(0.05)
    return None

  def finish(self, timeout: float) -> int:
    try:
      self.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      self.proc.terminate()  # mpijax-run stops every rank
      try:
        self.proc.wait(timeout=20)
      except subprocess.TimeoutExpired:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
    self._reader.join(10)
    return self.proc.returncode

  @property
  def text(self) -> str:
    return "\n".join(line for _, line in self.lines)


def _digits(out, marker: str, max_restarts: int) -> tuple[list[str], dict[str, str]]:
  argv = [sys.executable, "-m", "mpijax.launch", "-n", str(RANKS), "--timeout", str(TIMEOUT),
          "--max-restarts", str(max_restarts), "--restart-backoff", "0", "--",
          sys.executable, "-m", "mpijax.examples.digits", "--out", str(out), "--no-progress",
          "--epochs", str(EPOCHS)]
  env = {**os.environ, "MPIJAX_DEVICES_PER_PROCESS": "1", "MPIJAX_TEST_MARKER": marker}
  return argv, env


def _rank_pid(marker: str, rank: int) -> int | None:
  """The process of ``rank`` of the job tagged with ``marker`` (not mpijax-run, mpirun or prted)."""
  want = [f"MPIJAX_TEST_MARKER={marker}".encode()]
  ranks = [f"{v}={rank}".encode() for v in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")]
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/environ", "rb") as f:
        env = f.read().split(b"\0")
      with open(f"/proc/{entry}/cmdline", "rb") as f:
        cmdline = f.read()
    except OSError:
      continue
    if all(w in env for w in want) and any(r in env for r in ranks) and b"mpijax.examples.digits" in cmdline:
      return int(entry)
  return None


def _result(text: str) -> tuple[float, str]:
  accuracy = _ACCURACY.findall(text)
  digest = _DIGEST.findall(text)
  assert accuracy, "the digits example printed no final accuracy:\n" + tail(text)
  assert digest, ("the digits example printed no parameter digest ('params sha256 <hex>') at the "
                  "end:\n" + tail(text))
  return float(accuracy[-1]), digest[-1]


def test_digits_rank_killed_at_a_random_step_resumes_bit_for_bit(tmp_path, digits_4_ranks):
  seed = int(os.environ.get("MPIJAX_TEST_KILL_SEED", str(random.randrange(1 << 30))))
  rng = random.Random(seed)
  epoch, delay, victim = rng.randint(1, EPOCHS - 3), rng.uniform(0.0, 0.6), rng.randrange(RANKS)
  print(f"MPIJAX_TEST_KILL_SEED={seed}: SIGKILL rank {victim} {delay:.2f} s after epoch {epoch}")

  # The uninterrupted run: the README's main job (tests/conftest.py), the same
  # digits training at the same rank count and epochs.
  _, reference = digits_4_ranks
  assert reference.returncode == 0, tail(reference.stdout)
  assert f"epoch {EPOCHS:3d}/{EPOCHS}" in reference.stdout, tail(reference.stdout)
  ref_accuracy, ref_digest = _result(reference.stdout)

  # The same run, one rank killed in the middle; mpijax-run restarts it once.
  marker = uuid.uuid4().hex
  job = _Job(*_digits(tmp_path / "killed", marker, max_restarts=1))
  try:
    seen = job.wait_for(f"epoch {epoch:3d}/{EPOCHS}", timeout=TIMEOUT)
    assert seen is not None, f"epoch {epoch} never finished:\n" + tail(job.text)
    time.sleep(delay)
    pid = _rank_pid(marker, victim)
    assert pid is not None, f"rank {victim} not found:\n" + tail(job.text)
    os.kill(pid, signal.SIGKILL)
    killed = time.time()
    failed = job.wait_for("mpijax-run: attempt 0:", timeout=120, after=killed)
    resumed = job.wait_for("resumed from", timeout=TIMEOUT, after=killed)
  finally:
    status = job.finish(TIMEOUT + 30)
  text = job.text
  assert status == 0, tail(text)
  # The reason names the killed rank's signal, or what another rank hit first when it
  # noticed (an MPI error, an abort): it depends on when the kill landed.
  reason = [line for line in text.splitlines() if "mpijax-run: attempt 0:" in line]
  assert reason and ", failed: " in reason[0] and "restart 1 of 1" in text, tail(text)
  assert failed is not None and resumed is not None, tail(text)
  after_kill = text[text.index("restart 1 of 1"):]
  steps = [int(s) for s in _RESUMED.findall(after_kill)]
  assert steps and steps[0] > 0, "the restarted job did not resume from its checkpoint:\n" + tail(text)

  accuracy, digest = _result(text)
  assert accuracy >= 0.97, tail(text)
  assert digest == ref_digest, (f"parameters differ from the uninterrupted run's: {digest} vs "
                                f"{ref_digest}\n" + tail(text))
  assert accuracy == ref_accuracy
  print(reason[0])
  print(f"killed rank {victim} after epoch {epoch}: the launcher saw it {failed - killed:.1f} s later, "
        f"the restarted job resumed {resumed - killed:.1f} s after the kill; final accuracy "
        f"{accuracy:.4f}, digest {digest} (equal to the uninterrupted run's)")
