"""shard_batches properties, simulated for several rank counts in one process."""

from __future__ import annotations

import numpy as np
import pytest

from mpijax.train import Batch
from mpijax.train import shard_batches


def _epoch(n, G, P, *, seed=0, epoch=0, drop_remainder=False):
  """Per rank: the list of (ids, mask, weight) for one epoch."""
  ids = np.arange(n)
  return [[(b.data["id"], b.mask, b.weight)
           for b in shard_batches({"id": ids, "x": ids * 2.0}, G, seed=seed, epoch=epoch,
                                  drop_remainder=drop_remainder, process_index=r, process_count=P)]
          for r in range(P)]


@pytest.mark.parametrize("n,G,P", [(100, 12, 4), (96, 12, 4), (7, 8, 2), (50, 10, 1), (33, 6, 3)])
def test_epoch_covers_every_sample_once_and_equal_steps(n, G, P):
  per_rank = _epoch(n, G, P)
  steps = {len(batches) for batches in per_rank}
  assert steps == {-(-n // G)}  # every rank the same number of steps
  used = np.concatenate([ids[mask > 0] for batches in per_rank for ids, mask, _ in batches])
  assert sorted(used.tolist()) == list(range(n))
  for batches in per_rank:
    for ids, mask, weight in batches:  # noqa: B007
      assert ids.shape == (G // P,) and mask.shape == (G // P,)


@pytest.mark.parametrize("P", [1, 2, 4])
def test_global_batches_independent_of_rank_count(P):
  ref = _epoch(50, 8, 1, seed=3, epoch=2)[0]
  per_rank = _epoch(50, 8, P, seed=3, epoch=2)
  for s, (ids, mask, weight) in enumerate(ref):
    np.testing.assert_array_equal(np.concatenate([per_rank[r][s][0] for r in range(P)]), ids)
    np.testing.assert_array_equal(np.concatenate([per_rank[r][s][1] for r in range(P)]), mask)
    np.testing.assert_array_equal(np.concatenate([per_rank[r][s][2] for r in range(P)]), weight)


def test_deterministic_and_epoch_dependent():
  a = _epoch(40, 8, 2, seed=1, epoch=0)
  b = _epoch(40, 8, 2, seed=1, epoch=0)
  c = _epoch(40, 8, 2, seed=1, epoch=1)
  flat = lambda e: np.concatenate([ids for r in e for ids, _, _ in r])
  np.testing.assert_array_equal(flat(a), flat(b))
  assert not np.array_equal(flat(a), flat(c))


def test_weights_give_global_mean_on_padded_batch():
  n, G, P = 10, 8, 4
  per_rank = _epoch(n, G, P)
  values = np.arange(n, dtype=np.float64) ** 2
  last = [per_rank[r][-1] for r in range(P)]
  # mean over ranks of mean(weight * value) == mean over the real samples
  got = np.mean([np.mean(w * values[ids]) for ids, _, w in last])
  real = np.concatenate([ids[m > 0] for ids, m, _ in last])
  assert real.size == n - G
  np.testing.assert_allclose(got, values[real].mean())
  # full batches have weight 1 exactly
  for ids, mask, w in per_rank[0][:-1]:  # noqa: B007
    assert (w == 1).all() and (mask == 1).all()


def test_drop_remainder():
  per_rank = _epoch(100, 12, 4, drop_remainder=True)
  assert all(len(b) == 8 for b in per_rank)
  assert all((m == 1).all() for b in per_rank for _, m, _ in b)


def test_not_divisible_error_names_both_numbers():
  with pytest.raises(ValueError, match=r"global_batch_size=10 is not divisible by process_count=4.*8 or 12"):
    shard_batches(np.zeros(20), 10, seed=0, epoch=0, process_index=0, process_count=4)


def test_mismatched_leading_dims_error():
  with pytest.raises(ValueError, match="different numbers of samples"):
    shard_batches({"a": np.zeros(5), "b": np.zeros(6)}, 2, seed=0, epoch=0, process_index=0,
                  process_count=1)


def test_start_step_resumes_mid_epoch_and_len():
  full = list(shard_batches(np.arange(30), 4, seed=5, epoch=1, process_index=1, process_count=2))
  it = shard_batches(np.arange(30), 4, seed=5, epoch=1, start_step=3, process_index=1, process_count=2)
  assert len(it) == len(full) - 3
  rest = list(it)
  assert len(rest) == len(full) - 3
  for a, b in zip(rest, full[3:]):
    np.testing.assert_array_equal(a.data, b.data)
  assert isinstance(rest[0], Batch)


def test_eval_order_without_seed():
  batches = list(shard_batches(np.arange(10), 4, seed=None, epoch=0, process_index=0, process_count=2))
  assert [b.data.tolist() for b in batches] == [[0, 1], [4, 5], [8, 9]]
  batches = list(shard_batches(np.arange(10), 4, seed=None, epoch=0, process_index=1, process_count=2))
  assert [b.data.tolist() for b in batches][:2] == [[2, 3], [6, 7]]
  assert batches[2].mask.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("seed,epoch", [(-1, 0), (0, -2), (1.5, 0)])
def test_bad_seed_or_epoch_is_named(seed, epoch):
  with pytest.raises(ValueError, match="must be a non-negative integer"):
    shard_batches(np.zeros(8), 2, seed=seed, epoch=epoch, process_index=0, process_count=1)
