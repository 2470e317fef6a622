"""The README's Python examples run as printed, and give the values it shows.

Each example is taken from README.md at test time (not a copy), executed on
every rank of the job, and the results its comments promise are checked.
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpijax
from mpijax._src import mpi_util

README = Path(__file__).resolve().parents[2] / "README.md"


def _block(marker: str) -> str:
  """The README's one ```python block that contains ``marker``."""
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
  found = [b for b in blocks if marker in b]
  assert len(found) == 1, f"README: expected one python block containing {marker!r}, found {len(found)}"
  return found[0]


def _run(source: str, namespace: dict) -> dict[str, object]:
  """Executes ``source`` statement by statement; returns each expression statement's value.

  The key is the expression's source text, so checks name the README line; for
  ``print(expr)`` the value and the key are ``expr``'s (tests/test_docs.py checks
  what it prints against the comments at 2 ranks).
  """
  values = {}
  for node in ast.parse(source).body:
    expr = node.value if isinstance(node, ast.Expr) else None
    if (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "print"
        and len(expr.args) == 1):
      expr = expr.args[0]
    if expr is not None:
      code = ast.get_source_segment(source, expr)
      values[code] = eval(compile(ast.Expression(expr), "README.md", "eval"), namespace)
    else:
      exec(compile(ast.Module([node], []), "README.md", "exec"), namespace)
  return values


def _value(values: dict[str, object], prefix: str) -> np.ndarray:
  found = [v for k, v in values.items() if k.startswith(prefix)]
  assert len(found) == 1, f"README: expected one expression starting with {prefix!r}"
  return np.asarray(found[0])


@pytest.fixture
def in_shared_dir(rt, tmp_path):
  """Runs the test in a directory every rank sees (rank 0's tmp_path; one machine)."""
  path = mpi_util.bcast_str(rt.comm, str(tmp_path) if rt.rank == 0 else None, 0)
  old = os.getcwd()
  os.chdir(path)
  try:
    yield path
  finally:
    os.chdir(old)
    rt.comm.Barrier()  # nobody leaves while another rank still reads the files


def test_quick_start(rt):
  values = _run(_block("rt = mpijax.init()            #"), {})
  out = _value(values, "mpijax.pmap(lambda x: mpijax.lax.psum(x")
  np.testing.assert_array_equal(out, np.full(rt.local_device_count, float(len(mpijax.devices()))))
  assert f"rank={rt.rank}, size={rt.size}" in repr(values["rt.topology"])


def test_plain_jax_across_ranks(rt):
  if not rt.jax_distributed:
    pytest.skip("the README's plain-JAX example needs JAX's distributed runtime (on by default)")
  values = _run(_block("make_array_from_process_local_data(NamedSharding"), {})
  p = rt.size
  # Each process's 2 rows hold its index: the column sums are 2 * (0 + ... + p-1).
  np.testing.assert_array_equal(_value(values, "np.asarray(total.addressable_data(0))"),
                                np.full(4, float(p * (p - 1)), np.float32))


def test_tour_of_the_guides(rt):
  L, r = mpijax.local_device_count(), mpijax.process_index()
  if L * rt.size != 4:
    pytest.skip(f"the README's tour is written for 4 devices in the job, this job has {L * rt.size}")
  values = _run(_block("layer_sharded"), {})
  mine = np.array([2., 3., 1., 4.])[r * L:(r + 1) * L]
  g = r * L + np.arange(L)
  expect = {
      "mpijax.pmap(lambda x: lax.psum(": np.full(L, 10.),
      "mpijax.pmap(lambda x: lax.pmean(": np.full(L, 2.5),
      "mpijax.pmap(lambda x: lax.pmax(": np.full(L, 4.),
      "mpijax.pmap(lambda x: lax.pmin(": np.full(L, 1.),
      "mpijax.pmap(lambda x: lax.all_gather(": np.tile([2., 3., 1., 4.], (L, 1)),
      "mpijax.pmap(lambda x: lax.axis_index(": g,
      "mpijax.pmap(lambda x: lax.ppermute(": np.array([2., 3., 1., 4.])[(g - 1) % 4],
      "mpijax.shard_map(lambda x: x * 2": 2 * np.arange(32)[r * 32 // rt.size:(r + 1) * 32 // rt.size],
      "mpijax.shard_map(lambda x: lax.psum(x.sum()": np.array(496),
  }
  assert mine.shape == (L,)
  for prefix, want in expect.items():
    np.testing.assert_array_equal(_value(values, prefix), want, err_msg=prefix)
  # The guide's printed result. Its own unsharded and sharded runs differ in
  # the 7th digit (float32 sums in another order); so do ours.
  np.testing.assert_allclose(_value(values, "layer_sharded(x[r * n"),
                             [0.02138914, 0.89311206, 0.5989201, 0.97742516], rtol=2e-6)


def test_global_arrays(rt, in_shared_dir):
  if 8 % rt.size:
    pytest.skip(f"the README's example splits 8 rows over the ranks; {rt.size} ranks do not divide 8")
  with contextlib.redirect_stdout(None):
    ns: dict = {}
    _run(_block("GlobalArray.from_global(np.arange(32.0)"), ns)
  want = np.tanh(np.arange(32.0).reshape(8, 4))
  np.testing.assert_allclose(ns["w3"].gather(), want, rtol=1e-6)
  assert ns["cols"].spec == jax.sharding.PartitionSpec(None, ("data", "model"))
  np.testing.assert_array_equal(ns["cols"].gather(), np.arange(32.0).reshape(8, 4))


def test_data_parallel_training(rt, in_shared_dir):
  if 256 % rt.size:
    pytest.skip(f"the README's example uses a global batch of 256; {rt.size} ranks do not divide it")
  # The names the README's snippet leaves to the reader: a linear classifier
  # on a separable two-class problem that it must learn.
  rng = np.random.default_rng(0)
  x = rng.normal(size=(512, 8)).astype(np.float32)
  y = (x @ np.arange(1.0, 9.0) > 0).astype(np.int32)

  def loss_fn(params, batch):
    xb, yb = batch
    logits = xb @ params["w"] + params["b"]
    losses = jnp.logaddexp(0.0, logits) - yb * logits  # per-example sigmoid cross-entropy
    return losses, {"accuracy": ((logits > 0) == (yb == 1)).astype(jnp.float32)}

  params = {"w": jnp.zeros(8), "b": jnp.zeros(())}
  # The README's optax.adamw(1e-3) would need many more steps on this small problem.
  source = _block("train.DataParallel(")
  assert "adamw(1e-3)" in source, "README: the DataParallel example no longer uses adamw(1e-3)"
  source = source.replace("adamw(1e-3)", "adamw(1e-1)")
  ns = {"loss_fn": loss_fn, "params": params, "x": x, "y": y, "x_test": x, "y_test": y, "epochs": 10}
  _run(source, ns)
  final = ns["dp"].evaluate(ns["state"], (x, y), batch_size=512)
  assert final["accuracy"] > 0.95, final
  restored = mpijax.train.restore_checkpoint("train.ckpt", {"state": ns["state"], "epoch": 0})
  assert restored["epoch"] == 10
  jax.tree.map(np.testing.assert_array_equal, restored["state"].params, ns["state"].params)
