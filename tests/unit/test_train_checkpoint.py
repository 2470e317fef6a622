"""Checkpoint round trip, atomicity and corruption detection (single process)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mpijax._src.train import replicated_checkpoint as ckpt_mod
from mpijax.train import CheckpointError
from mpijax.train import checkpoint_metadata
from mpijax.train import restore_checkpoint
from mpijax.train import save_checkpoint


def _state(seed=0):
  k = jax.random.key(seed)
  return {
      "params": {"w": jax.random.normal(k, (3, 4)), "b": jnp.arange(4, dtype=jnp.bfloat16)},
      "opt": (jnp.int32(7), np.arange(5, dtype=np.int8)),
      "rng": jax.random.key(seed + 1),
      "raw_rng": jax.random.PRNGKey(seed + 2),
      "data": {"epoch": 3, "step_in_epoch": 11},
      "lr": 0.5,
  }


def _assert_same(a, b):
  la, ta = jax.tree_util.tree_flatten(a)
  lb, tb = jax.tree_util.tree_flatten(b)
  assert ta == tb
  for x, y in zip(la, lb):
    assert type(x) is type(y) or (isinstance(x, jax.Array) and isinstance(y, jax.Array))
    if hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    assert np.asarray(x).dtype == np.asarray(y).dtype
    assert np.shape(x) == np.shape(y)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_keeps_dtypes_kinds_and_metadata(tmp_path):
  path = tmp_path / "ckpt"
  save_checkpoint(path, _state(0), metadata={"note": "hi", "epoch": 3})
  restored = restore_checkpoint(path, like=_state(99))
  _assert_same(restored, _state(0))
  assert checkpoint_metadata(path) == {"note": "hi", "epoch": 3}
  assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temp files left


def test_crash_mid_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
  path = tmp_path / "ckpt"
  save_checkpoint(path, _state(0))
  before = path.read_bytes()

  def crash(*args, **kwargs):
    raise OSError("simulated crash before rename")

  monkeypatch.setattr(ckpt_mod.os, "replace", crash)
  with pytest.raises(OSError, match="simulated crash"):
    save_checkpoint(path, _state(1))
  monkeypatch.undo()
  assert path.read_bytes() == before
  assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
  _assert_same(restore_checkpoint(path, like=_state(5)), _state(0))


def test_half_written_temp_file_is_never_under_the_name(tmp_path, monkeypatch):
  # A writer killed after writing half the bytes leaves only a temp file.
  path = tmp_path / "ckpt"
  real_write = ckpt_mod._write_atomic

  def half(p, parts):
    data = b"".join(parts)
    with open(str(p) + ".tmp-killed", "wb") as f:
      f.write(data[: len(data) // 2])
    raise KeyboardInterrupt

  monkeypatch.setattr(ckpt_mod, "_write_atomic", half)
  with pytest.raises(KeyboardInterrupt):
    save_checkpoint(path, _state(0))
  monkeypatch.setattr(ckpt_mod, "_write_atomic", real_write)
  with pytest.raises(CheckpointError, match="no checkpoint"):
    restore_checkpoint(path, like=_state(0))


def test_next_save_removes_a_killed_writes_temp_file(tmp_path):
  # What a writer killed inside write_atomic leaves: mkstemp's name, partial bytes.
  path = tmp_path / "ckpt"
  stale = [tmp_path / "ckpt.tmp-a1b2_c3d", tmp_path / "ckpt.tmp-killed00"]
  stale[0].write_bytes(ckpt_mod.MAGIC + b"half a checkpoint")
  stale[1].write_bytes(b"")  # killed before its first byte
  # Look-alike names, or the right name with a user's bytes, are not ours.
  keep = [tmp_path / "ckpt.tmp-notes.txt", tmp_path / "other.tmp-a1b2_c3d",
          tmp_path / "ckpt.tmp-backup01"]
  for p in keep:
    p.write_bytes(b"not ours")
  save_checkpoint(path, _state(0))
  assert not any(p.exists() for p in stale) and all(p.exists() for p in keep)
  _assert_same(restore_checkpoint(path, like=_state(5)), _state(0))


@pytest.mark.parametrize("cut", [1, 40, 100, -1])
def test_truncated_file_is_refused(tmp_path, cut):
  path = tmp_path / "ckpt"
  save_checkpoint(path, _state(0))
  data = path.read_bytes()
  path.write_bytes(data[:cut] if cut > 0 else data[:len(data) + cut])
  with pytest.raises(CheckpointError, match="corrupt|truncated|not an mpijax checkpoint"):
    restore_checkpoint(path, like=_state(0))


def test_flipped_byte_is_refused(tmp_path):
  path = tmp_path / "ckpt"
  save_checkpoint(path, _state(0))
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0xFF
  path.write_bytes(bytes(data))
  with pytest.raises(CheckpointError, match="checksum mismatch"):
    restore_checkpoint(path, like=_state(0))


def test_mismatched_target_names_the_leaf(tmp_path):
  path = tmp_path / "ckpt"
  save_checkpoint(path, _state(0))
  like = _state(0)
  like["params"]["w"] = jnp.zeros((3, 5))
  with pytest.raises(CheckpointError, match=r"\['params'\]\['w'\] is float32\[3, 5\] in the target but "
                     r"float32\[3, 4\] in the checkpoint"):
    restore_checkpoint(path, like=like)
  # A missing or added key names that key (leaves used to be paired by
  # position: "['params']['w'] here but ['params']['b'] in the checkpoint").
  like = _state(0)
  del like["params"]["b"]
  with pytest.raises(CheckpointError, match=r"leaves in the checkpoint but not in the target: \['params'\]\['b'\]\."):
    restore_checkpoint(path, like=like)
  like = _state(0)
  like["params"]["a"] = jnp.zeros(2)
  with pytest.raises(CheckpointError, match=r"leaves in the target but not in the checkpoint: \['params'\]\['a'\]\."):
    restore_checkpoint(path, like=like)


def test_overwrite_replaces_atomically(tmp_path):
  path = tmp_path / "ckpt"
  save_checkpoint(path, _state(0))
  save_checkpoint(path, _state(1))
  _assert_same(restore_checkpoint(path, like=_state(0)), _state(1))


@pytest.mark.parametrize("leaf", [np.array(["text"]), 2**70, "name"])
def test_unstorable_leaf_is_refused_at_save_naming_it(tmp_path, leaf):
  # A string array used to be written and then fail at restore time.
  path = str(tmp_path / "ck")
  with pytest.raises(TypeError, match=r"wrote nothing:\n  rank 0: leaf \['bad'\]"):
    save_checkpoint(path, {"w": jnp.ones(2), "bad": leaf})
  assert not os.path.exists(path)


def test_numpy_scalar_leaf_stays_a_scalar(tmp_path):
  save_checkpoint(str(tmp_path / "ck"), {"n": np.int64(5)})
  out = restore_checkpoint(str(tmp_path / "ck"), {"n": np.int64(0)})
  assert type(out["n"]) is np.int64 and out["n"] == 5
