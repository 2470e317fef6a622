"""Fault injection: no silent hang, no lost work.

Each test starts its own small bounded job (4 ranks) with a script from
tests/scripts/ and checks that the job ends non-zero within the timeout with
a message that names the culprit, and that no process is left behind.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests._launch import REPO
from tests._launch import assert_failed_without_hanging
from tests._launch import mpirun_command
from tests._launch import run_mpi
from tests._launch import tail

SCRIPTS = REPO / "tests" / "scripts"
STALL_TIMEOUT = 5  # MPIJAX_TIMEOUT for these jobs, seconds


def _leftovers(script: str) -> list[str]:
  """Processes still running this checkout's script (by its full path: another
  checkout on the same machine may run the same test)."""
  out = subprocess.run(["pgrep", "-af", str(SCRIPTS / script)], capture_output=True, text=True).stdout
  return [line for line in out.splitlines() if "pgrep" not in line]


def _run(script: str, *args: str, env: dict[str, str] | None = None, timeout: float = 120):
  full_env = {"MPIJAX_TIMEOUT": str(STALL_TIMEOUT), **(env or {})}
  result, seconds = run_mpi(4, [sys.executable, str(SCRIPTS / script), *args],
                            timeout=timeout, env=full_env)
  assert not _leftovers(script), _leftovers(script)
  return result.returncode, result.stdout, seconds


# --- the three hangs of JAX's multi-process guide ----------------------------------


def test_different_shapes_raise_a_mismatch_error_on_every_rank():
  rc, out, seconds = _run("fault_hangs.py", "shapes")
  assert_failed_without_hanging(rc, out)
  for r in range(4):  # every rank got the error (each prints it before the abort)
    assert re.search(rf"rank {r} raised: .*collective mismatch on communicator 0", out), tail(out)
  assert ("ranks 0,2,3 run allreduce(float32[8,4], sum) at fault_hangs.py" in out
          and "but rank 1 runs allreduce(float32[6,4], sum)" in out), tail(out)
  assert seconds < 60, f"took {seconds:.0f}s"


@pytest.mark.parametrize("n", [4, 1 << 18], ids=["MPI_Allreduce", "ring"])
def test_a_divergence_after_the_first_run_check_ends_the_job_with_a_report(n):
  rc, out, seconds = _run("fault_hangs.py", "seen_shapes", str(n),
                          env={"MPIJAX_SHM_MAX_BYTES": "0", "MPIJAX_CMA_MIN_BYTES": "0"})
  assert_failed_without_hanging(rc, out)
  assert re.search(r"mpijax: rank \d: MPI_\w+\(.*failed in mpijax.ops.allreduce on float32", out), tail(out)
  assert "MPIJAX_CHECK=1 compares every call" in out, tail(out)
  if n > 4:  # in the ring both ranks see the error; with MPI_Allreduce the rank
    # with the larger buffer may finish (with a partial sum) before the abort
    # reaches it: MPIJAX_CHECK=1 is what prevents that.
    assert "finished with" not in out, tail(out)
  assert seconds < 60, f"took {seconds:.0f}s"


def test_a_divergence_after_the_first_run_check_on_the_cma_path_is_a_mismatch_error():
  # The cross-memory all-reduce compares what every rank reduces before any
  # copy: every rank raises the full mismatch error, naming both shapes.
  rc, out, seconds = _run("fault_hangs.py", "seen_shapes", str(1 << 18))
  assert_failed_without_hanging(rc, out)
  # mpijax-run shows the report once and says that every rank raised it alike.
  assert re.search(r"\[rank\d\]: ValueError: .*collective mismatch on communicator 0 "
                   r"\(call #3\)", out), tail(out)
  assert re.search(r"mpijax-run: attempt 0: .*uncaught ValueError: .*collective mismatch on "
                   r"communicator 0 \(call #3\).*\(ranks 0-3 alike\)", out), tail(out)
  assert ("ranks 0,2,3 run allreduce(float32[262144], sum) at fault_hangs.py" in out
          and "but rank 1 runs allreduce(float32[524288], sum)" in out), tail(out)
  assert "finished with" not in out, tail(out)
  assert seconds < 60, f"took {seconds:.0f}s"


def test_last_batch_stall_names_the_rank_that_left():
  rc, out, seconds = _run("fault_hangs.py", "last_batch", "/tmp")
  assert_failed_without_hanging(rc, out)
  assert "mpijax: stall: rank" in out, tail(out)
  # The waiting ranks name rank 3 and what it did last (its 3rd and last call).
  assert re.search(r"Not arrived: rank 3 \(idle since [\d.]+ s; last: allreduce\(float32\[4\], "
                   r"sum\) at fault_hangs.py:\d+, call #3[;)]", out), tail(out)
  # ... and the Python line it is running now (it left the loop to save).
  assert re.search(r"Python: fault_hangs.py:\d+ in <module>: mt.save_checkpoint", out), tail(out)
  assert "epoch finished" not in out, tail(out)
  assert seconds < 60, f"took {seconds:.0f}s"


def test_shard_batches_prevents_the_last_batch_hang(tmp_path):
  rc, out, _ = _run("fault_hangs.py", "last_batch_fixed", str(tmp_path))
  assert rc == 0, tail(out)
  assert out.count("5 steps done") == 4 and out.count("epoch finished") == 4, tail(out)


def test_per_rank_set_order_raises_a_mismatch_error_on_every_rank():
  rc, out, seconds = _run("fault_hangs.py", "set_order")
  assert_failed_without_hanging(rc, out)
  orders = set(re.findall(r"rank \d order (\[.*?\])", out))
  assert len(orders) > 1, tail(out)  # the scenario really has different orders
  for r in range(4):
    assert re.search(rf"rank {r} raised: .*collective mismatch on communicator 0 \(call #1\)",
                     out), tail(out)
  assert seconds < 60, f"took {seconds:.0f}s"


@pytest.mark.parametrize("mode,shape,transport", [
    # 12 B messages: node-local shared memory (the default), a blocking
    # MPI_Allreduce, which the watchdog thread reports, or a polled one.
    ("late", "3", {}),
    ("late", "3", {"MPIJAX_SHM_MAX_BYTES": "0"}),
    ("late", "3", {"MPIJAX_SHM_MAX_BYTES": "0", "MPIJAX_BLOCKING_MIN_BYTES": str(1 << 30)}),
    # 512 KiB messages: cross-memory attach (the default), or mpijax's ring,
    # whose exchanges are polled.
    ("late_large", "65536", {}),
    ("late_large", "65536", {"MPIJAX_RING_MIN_BYTES": "1", "MPIJAX_CMA_MIN_BYTES": "0"}),
], ids=["shm", "blocking", "polled", "cma", "ring"])
def test_stall_action_warn_reports_and_keeps_waiting(mode, shape, transport):
  rc, out, _ = _run("fault_hangs.py", mode,
                    env={"MPIJAX_STALL_ACTION": "warn", "MPIJAX_TIMEOUT": "2", **transport})
  assert rc == 0, tail(out)
  assert re.search(rf"mpijax: stall: rank [012] waited 2\.\d s in allreduce\(float32\[{shape}\], "
                   r"sum\) at fault_hangs.py:\d+ \(call #2 on communicator 0\)\. Not arrived: "
                   r"rank 3 \(idle since", out), tail(out)
  assert "MPIJAX_STALL_ACTION=warn" in out and out.count("[8. 8. 8.]") == 4, tail(out)


def test_stall_report_names_the_late_rank_in_a_program_with_xla_collectives_over_mpi():
  rc, out, _ = _run("fault_hangs.py", "late_mixed",
                    env={"MPIJAX_STALL_ACTION": "warn", "MPIJAX_TIMEOUT": "2"})
  assert rc == 0, tail(out)
  assert re.search(r"mpijax: stall: rank [012] waited 2\.\d s in allreduce\(float32\[1,3\], "
                   r"sum\) at fault_hangs.py:\d+ \(call #2 on communicator \d+\)\. Not arrived: "
                   r"rank 3 \(idle since", out), tail(out)
  assert out.count("(mpi): [8. 8. 8.]") == 4, tail(out)


# --- a rank dies or raises ---------------------------------------------------------


def _train(tmp, name, fault=""):
  ckpt_dir = tmp / name
  ckpt_dir.mkdir(exist_ok=True)
  out_file = tmp / f"{name}.npy"
  env = {"FAULT": fault} if fault else {}
  rc, out, seconds = _run("fault_train.py", str(ckpt_dir), str(out_file), env=env)
  return rc, out, seconds, ckpt_dir / "state.ckpt", out_file


# tests/test_restart.py kills a rank of the digits job and restarts it under
# mpijax-run --max-restarts, bit for bit: this by-hand restart is the slow twin.
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("MPIJAX_TEST_SLOW") != "1",
                    reason="covered by tests/test_restart.py: set MPIJAX_TEST_SLOW=1")
def test_sigkill_mid_training_ends_the_job_and_a_restart_resumes(tmp_path):
  from mpijax._src.train.replicated_checkpoint import read_checkpoint

  rc, out, _, _, ref_file = _train(tmp_path, "reference")
  assert rc == 0 and ref_file.exists(), tail(out)

  rc, out, _, ckpt, out_file = _train(tmp_path, "killed", fault="kill")
  end = time.time()
  assert_failed_without_hanging(rc, out)
  killed_at = float(re.search(r"rank 2: SIGKILL at ([\d.]+)", out).group(1))
  assert end - killed_at < 15, f"job ended {end - killed_at:.1f}s after the kill\n{tail(out)}"
  assert re.search(r"process rank 2 with PID \d+ on node \S+ exited on\s+signal 9", out), tail(out)
  assert not out_file.exists()
  header, _, _, _ = read_checkpoint(ckpt)  # intact: magic, header, checksum
  assert header["payload_bytes"] > 0

  rc, out, _, _, out_file = _train(tmp_path, "killed")  # restart, same directory
  assert rc == 0, tail(out)
  assert "rank 0: resumed at step 10" in out, tail(out)
  np.testing.assert_array_equal(np.load(out_file), np.load(ref_file))


def test_rank_raising_inside_a_jitted_step_ends_the_job_with_its_traceback(tmp_path):
  rc, out, _, _, _ = _train(tmp_path, "raise", fault="raise")
  assert_failed_without_hanging(rc, out)
  assert "[rank1]: mpijax: uncaught" in out, tail(out)
  assert "deliberate failure inside the jitted step on rank 1" in out, tail(out)
  assert "finished" not in out, tail(out)


# --- SIGTERM to the launcher during a checkpoint write ------------------------------


def test_sigterm_during_checkpoint_write_keeps_the_previous_checkpoint(tmp_path):
  from mpijax._src.train.replicated_checkpoint import read_checkpoint

  path = tmp_path / "state.ckpt"
  script = "fault_ckpt_sigterm.py"
  env = dict(os.environ, MPIJAX_DEVICES_PER_PROCESS="1")
  cmd = mpirun_command(4, 1, True, 120) + [sys.executable, str(SCRIPTS / script), str(path)]
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env, cwd=str(REPO), start_new_session=True)
  lines = []
  try:
    deadline = time.monotonic() + 120
    for line in proc.stdout:
      lines.append(line)
      if "rank 0: saving version 3" in line or time.monotonic() > deadline:
        break
    time.sleep(0.3)  # rank 0 is inside save_checkpoint (packing or writing)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
  text = "".join(lines) + (out or "")
  assert any("saving version 3" in l for l in lines), tail(text)
  # mpijax-run stopped every rank on the SIGTERM (not on its --timeout, not by our kill).
  assert proc.returncode == 128 + signal.SIGTERM, f"exit {proc.returncode}\n{tail(text)}"
  header, _, payload, _ = read_checkpoint(path)  # a whole checkpoint, never a partial one
  assert header["payload_bytes"] == payload.size > 0
  assert not _leftovers(script), _leftovers(script)
