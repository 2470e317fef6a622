"""The bucket plan of the fused gradient all-reduce (pure function, no MPI)."""

from __future__ import annotations

import numpy as np

from mpijax._src.train.gradients import plan_buckets


def test_small_leaves_share_buckets_per_dtype_in_order():
  leaves = [((10,), np.float32)] * 12 + [((3,), np.int32), ((4,), np.float16)]
  plan = plan_buckets(leaves, bucket_bytes=200)
  assert plan == [[12 + 1], [0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11], [12]]  # float16, float32..., int32


def test_big_leaves_go_alone_without_packing():
  leaves = [((1000,), np.float32), ((2,), np.float32), ((300, 300), np.float32), ((3,), np.float32)]
  plan = plan_buckets(leaves, bucket_bytes=1 << 20, fuse_leaf_bytes=4000)
  assert plan == [[0], [2], [1, 3]]
  # Packing everything (fuse_leaf_bytes >= bucket_bytes): one bucket up to bucket_bytes.
  assert plan_buckets(leaves, bucket_bytes=1 << 20) == [[0, 1, 2, 3]]


def test_every_nonempty_leaf_exactly_once_and_empty_leaves_skipped():
  rng = np.random.default_rng(0)
  leaves = [((int(n),), np.float32) for n in rng.integers(0, 5000, 200)]
  plan = plan_buckets(leaves, bucket_bytes=8192, fuse_leaf_bytes=4096)
  flat = sorted(i for b in plan for i in b)
  assert flat == [i for i, (s, _) in enumerate(leaves) if s[0] > 0]
  for b in plan:
    assert len(b) == 1 or sum(leaves[i][0][0] * 4 for i in b) <= 8192
