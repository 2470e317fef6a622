"""Checkpoint directories, resume_or_init, restart_attempt and the preemption handler (single process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import jax.numpy as jnp
import pytest

from mpijax import train
from mpijax._src.guards import failure
from mpijax._src.train import preemption


def test_numbered_checkpoints_keep_the_newest_and_resume_from_it(tmp_path):
  d = tmp_path / "ckpt"
  tree = lambda v: {"w": jnp.full(2, float(v)), "n": v}
  assert train.latest_checkpoint(d) is None
  assert train.resume_or_init(d, lambda: tree(0))["n"] == 0  # nothing yet: init_fn's tree
  for step in (3, 10, 7):
    train.save_step_checkpoint(d, tree(step), step, keep=2, metadata={"k": step})
  # Ordered by step, not by time of writing: 3 was pruned after 10 was written.
  assert train.list_checkpoints(d) == [(7, train.checkpoint_path(d, 7)), (10, train.checkpoint_path(d, 10))]
  assert train.resume_or_init(d, lambda: tree(0))["n"] == 10
  assert train.checkpoint_metadata(train.latest_checkpoint(d)) == {"step": 10, "k": 10}
  # Temporaries of killed writes and other files are not checkpoints.
  (d / "step_000000099.ckpt.tmp-abcdefgh").write_bytes(b"")
  (d / "notes.txt").write_text("x")
  assert [s for s, _ in train.list_checkpoints(d)] == [7, 10]
  with pytest.raises(ValueError, match=r"keep=0 must be an integer >= 1"):
    train.save_step_checkpoint(d, tree(1), 1, keep=0)


def test_a_tree_that_carries_its_step_must_carry_the_saved_one(tmp_path):
  # A loop that resumes from state["step"] would start over if the tree kept
  # step 0 while the file says 121: refused, naming the fix.
  with pytest.raises(ValueError, match=r"own step is 0: a run resumed from it would start again "
                                       r"at step 0.*state\['step'\] = step \+ 1"):
    train.save_step_checkpoint(tmp_path, {"step": 0, "x": jnp.zeros(2)}, 121)
  assert train.list_checkpoints(tmp_path) == []
  train.save_step_checkpoint(tmp_path, {"step": jnp.int32(121), "x": jnp.zeros(2)}, 121)
  state = train.resume_or_init(tmp_path, lambda: {"step": jnp.int32(0), "x": jnp.ones(2)})
  assert int(state["step"]) == 121


def test_resume_falls_back_over_a_damaged_newest_and_refuses_all_damaged(tmp_path):
  tree = lambda v: {"w": jnp.full(2, float(v))}
  train.save_step_checkpoint(tmp_path, tree(1), 1)
  train.save_step_checkpoint(tmp_path, tree(2), 2)
  with open(train.checkpoint_path(tmp_path, 2), "r+b") as f:
    f.seek(-3, os.SEEK_END)
    f.write(b"xyz")
  assert float(train.resume_or_init(tmp_path, lambda: tree(0))["w"][0]) == 1.0
  with open(train.checkpoint_path(tmp_path, 1), "wb") as f:
    f.write(b"junk")
  with pytest.raises(train.CheckpointError, match=r"no checkpoint could be read.*\n.*step_000000002"):
    train.resume_or_init(tmp_path, lambda: tree(0))


def test_restart_attempt_reads_the_launchers_variable(monkeypatch):
  monkeypatch.delenv("MPIJAX_RESTART_ATTEMPT", raising=False)
  assert train.restart_attempt() == 0
  monkeypatch.setenv("MPIJAX_RESTART_ATTEMPT", "2")
  assert train.restart_attempt() == 2
  monkeypatch.setenv("MPIJAX_RESTART_ATTEMPT", "-1")
  with pytest.raises(ValueError, match=r"MPIJAX_RESTART_ATTEMPT='-1' is not valid: expected an integer >= 0"):
    train.restart_attempt()


def test_signal_requests_preemption_and_a_second_sigterm_falls_back():
  calls = []
  previous = signal.signal(signal.SIGTERM, lambda s, f: calls.append(s))
  try:
    assert train.install_preemption_handler()
    assert not train.preemption_requested()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert train.preemption_requested() and train.stop_requested()  # one process: its own flag
    os.kill(os.getpid(), signal.SIGTERM)  # a request is pending: the previous handler runs
    assert calls == [signal.SIGTERM]
  finally:
    train.uninstall_preemption_handler()
    signal.signal(signal.SIGTERM, previous)
  assert not train.preemption_requested()


def test_preempted_exits_75_through_mpijax_run_without_abort(tmp_path):
  script = tmp_path / "p.py"
  script.write_text("import mpijax.train as t\nraise t.Preempted(5, 'x')\n")
  result = subprocess.run([sys.executable, "-m", "mpijax", str(script)], capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 75, result.stderr
  assert "aborting" not in result.stderr, result.stderr
  e = train.Preempted(3, "p")
  assert e.code == train.PREEMPTED_EXIT_CODE == 75 and e.step == 3
  assert 75 in failure._agreed_exit_codes
  preemption._requested.clear()
