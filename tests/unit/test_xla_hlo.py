"""The one HLO parser: the collectives of a program as XLA compiles it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from mpijax._src.xla import cliques as xla_cliques
from mpijax._src.xla import hlo as xla_hlo


def _compiled_text() -> tuple[str, str]:
  mesh = Mesh(np.array(jax.devices()[:1]), ("i",))

  def f(x, y):
    return (
      jax.lax.psum(x, "i"),
      jax.lax.pmax(y, "i"),
      jax.lax.all_gather(x, "i"),
      jax.lax.ppermute(x, "i", [(0, 0)]),
      jax.lax.psum_scatter(x, "i", tiled=True),
    )

  specs = dict(in_specs=(P("i"), P("i")), out_specs=(P(), P(), P(), P("i"), P("i")))
  g = jax.jit(jax.shard_map(f, mesh=mesh, check_vma=False, **specs))
  compiled = g.lower(jnp.ones(4, jnp.float32), jnp.ones(2, jnp.int32)).compile()
  (module,) = compiled.runtime_executable().hlo_modules()
  return module.name, module.to_string()


def test_reads_every_collective_of_a_compiled_program():
  name, text = _compiled_text()
  module = xla_hlo.Module(name, text)
  calls = sorted(module.calls())
  assert calls == sorted([
    ("all-reduce", "float32", 4, "sum", "jit(f)/psum"),
    ("all-reduce", "int32", 2, "max", "jit(f)/pmax"),
    ("all-gather", "float32", 4, "", "jit(f)/all_gather"),
    ("collective-permute", "bytes", 16, "", "jit(f)/ppermute"),
    ("reduce-scatter", "float32", 4, "sum", "jit(f)/reduce_scatter"),
  ])
  psum = next(c for c in module.collectives if c.label == "jit(f)/psum")
  assert psum.attribute("replica_groups") == "{{0}}"
  assert psum.attribute("use_global_device_ids") == "true"
  assert psum.attribute("channel_id") == "1"
  # One device: every collective's clique is that device.
  assert xla_cliques.program_cliques(module.collectives, [0], 1, 1) == [[(0,)]] * 5


SAMPLE = """HloModule jit_g, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

%mul (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %m = f32[] multiply(%a, %b)
}

ENTRY %main (x: f32[8], y: bf16[2,3]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %y = bf16[2,3]{1,0} parameter(1)
  %ar = (f32[8]{0}, bf16[2,3]{1,0}) all-reduce-start(%x, %y), channel_id=2, replica_groups=[2,2]<=[2,2]T(1,0), use_global_device_ids=true, to_apply=%mul
  %done = (f32[8]{0}, bf16[2,3]{1,0}) all-reduce-done(%ar)
  %a2a = f32[8]{0} all-to-all(%x), replica_groups={{0,1},{2,3}}, dimensions={0}
  ROOT %out = f32[8]{0} get-tuple-element(%done), index=0
}
"""  # noqa: E501


def test_tuples_async_starts_iota_groups_and_instructions_without_metadata():
  module = xla_hlo.Module("jit_g", SAMPLE)
  assert [c.kind for c in module.collectives] == ["all-reduce", "all-to-all"]
  assert module.calls() == [
    ("all-reduce", "float32", 8, "product", "jit_g %ar"),
    ("all-reduce", "bfloat16", 6, "product", "jit_g %ar"),
    ("all-to-all", "bytes", 32, "", "jit_g %a2a"),
  ]
  ar, a2a = module.collectives
  assert ar.attribute("replica_groups") == "[2,2]<=[2,2]T(1,0)"
  assert a2a.attribute("channel_id") is None
  # Cross-replica without a channel id; flattened ids through the iota form.
  assert xla_cliques.program_cliques(module.collectives, [10, 11, 12, 13], 4, 1) == [
    [(10, 12), (11, 13)],
    [(10, 11), (12, 13)],
  ]
