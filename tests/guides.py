"""The code of the JAX guides mpijax is built from, as the guides print it.

Each block is copied verbatim from the guide whose address heads its section.
The tests in tests/mpi run every one of them (tests/unit/test_guide_examples.py
checks that none is left out) with :func:`run`, statement by statement in one
namespace, as a reader runs a notebook. Where a guide's code cannot run as
printed, :func:`adapt` changes it in plain sight: the test names the text it
replaces and why.
"""

from __future__ import annotations

import ast
import contextlib
import io

# --- 001: sharded computation (jax.readthedocs.io/en/latest/sharded-computation.html) ---

DEVICES = """\
import jax
jax.devices()
"""

ARR = """\
import jax.numpy as jnp
arr = jnp.arange(32.0).reshape(4, 8)
arr.devices()
"""

ARR_SHARDING = """\
arr.sharding
"""

VISUALIZE_ARR = """\
jax.debug.visualize_array_sharding(arr)
"""

MESH_2D = """\
# Pardon the boilerplate; constructing a sharding will become easier in future!
from jax.sharding import Mesh
from jax.sharding import PartitionSpec
from jax.sharding import NamedSharding
from jax.experimental import mesh_utils

P = jax.sharding.PartitionSpec
devices = mesh_utils.create_device_mesh((2, 4))
mesh = jax.sharding.Mesh(devices, ('x', 'y'))
sharding = jax.sharding.NamedSharding(mesh, P('x', 'y'))
print(sharding)
"""

ARR_SHARDED = """\
arr_sharded = jax.device_put(arr, sharding)

print(arr_sharded)
jax.debug.visualize_array_sharding(arr_sharded)
"""

F_ELEMENTWISE = """\
@jax.jit
def f_elementwise(x):
  return 2 * jnp.sin(x) + 1

result = f_elementwise(arr_sharded)

print("shardings match:", result.sharding == arr_sharded.sharding)
"""

F_CONTRACT = """\
@jax.jit
def f_contract(x):
  return x.sum(axis=0)

result = f_contract(arr_sharded)
jax.debug.visualize_array_sharding(result)
print(result)
"""

F_CONTRACT_2 = """\
@jax.jit
def f_contract_2(x):
  out = x.sum(axis=0)
  # mesh = jax.create_mesh((8,), 'x')
  devices = mesh_utils.create_device_mesh(8)
  mesh = jax.sharding.Mesh(devices, 'x')
  sharding = jax.sharding.NamedSharding(mesh, P('x'))
  return jax.lax.with_sharding_constraint(out, sharding)

result = f_contract_2(arr_sharded)
jax.debug.visualize_array_sharding(result)
print(result)
"""

SHARD_MAP_ELEMENTWISE = """\
from jax.experimental.shard_map import shard_map
P = jax.sharding.PartitionSpec
mesh = jax.sharding.Mesh(jax.devices(), 'x')

f_elementwise_sharded = shard_map(
    f_elementwise,
    mesh=mesh,
    in_specs=P('x'),
    out_specs=P('x'))

arr = jnp.arange(32)
f_elementwise_sharded(arr)
"""

SHARD_MAP_LOCAL_SHAPE = """\
x = jnp.arange(32)
print(f"global shape: {x.shape=}")

def f(x):
  print(f"device local shape: {x.shape=}")
  return x * 2

y = shard_map(f, mesh=mesh, in_specs=P('x'), out_specs=P('x'))(x)
"""

SHARD_MAP_SUM = """\
def f(x):
  return jnp.sum(x, keepdims=True)

shard_map(f, mesh=mesh, in_specs=P('x'), out_specs=P('x'))(x)
"""

SHARD_MAP_PSUM = """\
def f(x):
  sum_in_shard = x.sum()
  return jax.lax.psum(sum_in_shard, 'x')

shard_map(f, mesh=mesh, in_specs=P('x'), out_specs=P())(x)
"""

LAYER = """\
@jax.jit
def layer(x, weights, bias):
  return jax.nn.sigmoid(x @ weights + bias)
"""

LAYER_DATA = """\
import numpy as np
rng = np.random.default_rng(0)

x = rng.normal(size=(32,))
weights = rng.normal(size=(32, 4))
bias = rng.normal(size=(4,))

layer(x, weights, bias)
"""

LAYER_SHARDED_INPUTS = """\
P = jax.sharding.PartitionSpec
mesh = jax.sharding.Mesh(jax.devices(), 'x')
sharding = jax.sharding.NamedSharding(mesh, P('x'))

x_sharded = jax.device_put(x, sharding)
weights_sharded = jax.device_put(weights, sharding)

layer(x_sharded, weights_sharded, bias)
"""

LAYER_AUTO = """\
@jax.jit
def layer_auto(x, weights, bias):
  x = jax.lax.with_sharding_constraint(x, sharding)
  weights = jax.lax.with_sharding_constraint(weights, sharding)
  return layer(x, weights, bias)

layer_auto(x, weights, bias)  # pass in unsharded inputs
"""

LAYER_SHARD_MAP = """\
from functools import partial

@jax.jit
@partial(shard_map, mesh=mesh,
         in_specs=(P('x'), P('x', None), P(None)),
         out_specs=P(None))
def layer_sharded(x, weights, bias):
  return jax.nn.sigmoid(jax.lax.psum(x @ weights, 'x') + bias)

layer_sharded(x, weights, bias)
"""

# The values the guide prints (8 TPU cores; float32).
F_ELEMENTWISE_SHARDED_VALUES = [
    1., 2.682942, 2.818595, 1.28224, -0.513605, -0.9178486, 0.44116896, 2.3139732,
    2.9787164, 1.824237, -0.08804226, -0.99998045, -0.07314599, 1.8403342, 2.9812148,
    2.3005757, 0.42419332, -0.92279506, -0.50197446, 1.2997544, 2.8258905, 2.6733112,
    0.98229736, -0.69244075, -0.81115675, 0.7352965, 2.525117, 2.912752, 1.5418116,
    -0.32726777, -0.97606325, 0.19192469]
F_CONTRACT_VALUES = [48., 52., 56., 60., 64., 68., 72., 76.]
LAYER_VALUES = [0.02138912, 0.893112, 0.59892005, 0.97742504]
LAYER_SHARDED_VALUES = [0.02138914, 0.89311206, 0.5989201, 0.97742516]

# --- 002: multi-process JAX (jax.readthedocs.io/en/latest/multi_process.html) ---------

# The guide's session, as printed (a doctest: outputs for 4 hosts x 8 devices).
MULTI_PROCESS_PMAP = """\
# The following is run in parallel on each host on a GPU cluster or TPU pod slice.
>>> import jax
>>> jax.distributed.initialize()  # On GPU, see above for the necessary arguments.
>>> jax.device_count()  # total number of accelerator devices in the cluster
32
>>> jax.local_device_count()  # number of accelerator devices attached to this host
8
# The psum is performed over all mapped devices across the pod slice
>>> xs = jax.numpy.ones(jax.local_device_count())
>>> jax.pmap(lambda x: jax.lax.psum(x, 'i'), axis_name='i')(xs)
ShardedDeviceArray([32., 32., 32., 32., 32., 32., 32., 32.], dtype=float32)
"""

# --- 000: collectives under pmap (a Chinese guide to jax.pmap's collectives) ----------

# The guide's three functions (its usage lines are comments there: 4 devices).
PMAP_PSUM = """\
import jax
import jax.numpy as jnp

# 旨在通过 pmap 运行的函数
def sum_across_devices(local_value):
  # 'batch_axis' 必须与 pmap 调用中的 axis_name 匹配
  total_sum = jax.lax.psum(local_value, axis_name='batch_axis')
  # 现在每个设备都拥有总和。
  # 比如,我们可以用它来缩放本地计算
  return total_sum
"""

PMAP_PMEAN = """\
import jax
import jax.numpy as jnp

# 旨在通过 pmap 运行的函数
def average_across_devices(local_value):
  # 'batch_axis' 必须与 pmap 调用中的 axis_name 匹配
  average_value = jax.lax.pmean(local_value, axis_name='batch_axis')
  return average_value
"""

PMAP_PMAX = """\
import jax
import jax.numpy as jnp

# 旨在通过 pmap 运行的函数
def get_max_value(local_value):
  max_val = jax.lax.pmax(local_value, axis_name='data_split')
  return max_val
"""


# --- running them ------------------------------------------------------------------------


def doctest_source(session: str) -> str:
  """The Python statements of a ``>>>`` session (prompts removed, outputs dropped)."""
  return "".join(line[4:] + "\n" for line in session.splitlines() if line.startswith(">>> "))


def adapt(block: str, old: str, new: str) -> str:
  """``block`` with ``old`` (which must occur in it) replaced by ``new``."""
  assert old in block, f"the guide's code no longer contains {old!r}:\n{block}"
  return block.replace(old, new)


def run(block: str, namespace: dict, name: str = "guide") -> tuple[dict[str, object], str]:
  """Executes ``block`` statement by statement in ``namespace``.

  Returns each expression statement's value (keyed by its source text, as a
  notebook shows it) and everything printed.
  """
  values: dict[str, object] = {}
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    for node in ast.parse(block).body:
      code = ast.get_source_segment(block, node)
      if isinstance(node, ast.Expr):
        values[code] = eval(compile(ast.Expression(node.value), name, "eval"), namespace)
      else:
        exec(compile(ast.Module([node], []), name, "exec"), namespace)
  return values, out.getvalue()


def value(values: dict[str, object], prefix: str) -> object:
  """The one value whose expression starts with ``prefix``."""
  found = [v for k, v in values.items() if k.startswith(prefix)]
  assert len(found) == 1, f"expected one expression starting with {prefix!r}, got {list(values)}"
  return found[0]
