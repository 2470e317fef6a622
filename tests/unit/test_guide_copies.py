"""The guides' code in tests/guides.py is the guides' own, character for character."""

from __future__ import annotations

import pytest

from tests import guides

SHARDED = ["DEVICES", "ARR", "ARR_SHARDING", "VISUALIZE_ARR", "MESH_2D", "ARR_SHARDED",
           "F_ELEMENTWISE", "F_CONTRACT", "F_CONTRACT_2", "SHARD_MAP_ELEMENTWISE",
           "SHARD_MAP_LOCAL_SHAPE", "SHARD_MAP_SUM", "SHARD_MAP_PSUM", "LAYER", "LAYER_DATA",
           "LAYER_SHARDED_INPUTS", "LAYER_AUTO", "LAYER_SHARD_MAP"]


@pytest.fixture(scope="module")
def seeds():
  d = guides.seeds_dir()
  if d is None:
    pytest.skip("the guides (shared/seeds) are not beside this checkout")
  return d


def test_every_code_block_of_the_sharded_computation_guide_is_copied_verbatim(seeds):
  blocks = [b for b in guides.guide_code_blocks(guides.SHARDED_FILE)
            if not b.startswith(("[", "{", "Array(", "SingleDeviceSharding", "NamedSharding(",
                                 "TPU", "shardings match", "global shape:"))
            and "TPU " not in b]
  ours = [guides.normalize(getattr(guides, n)) for n in SHARDED]
  assert ours == blocks


def test_the_multi_process_guide_session_is_copied_verbatim(seeds):
  assert guides.normalize(guides.MULTI_PROCESS_PMAP) in guides.guide_code_blocks(
      guides.MULTI_PROCESS_FILE)


def test_the_pmap_guide_functions_are_copied_verbatim(seeds):
  # That guide's text lost its line breaks; compare with whitespace collapsed.
  text = " ".join((seeds / guides.PMAP_FILE).read_text(encoding="utf-8").split())
  for name in ("PMAP_PSUM", "PMAP_PMEAN", "PMAP_PMAX"):
    assert " ".join(getattr(guides, name).split()) in text, name
