"""The compile cache's key holds what changes the executable: a program compiled
under another jaxlib, other XLA flags, another device count or other settings
that shape mpijax's lowering misses; the same program in a fresh process hits."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# One process: mpijax's compile hook over a cache directory, a jitted program on
# device 0, and how the hook got it. No MPI job is needed for the key.
SCRIPT = r"""
import json, os, sys
import jax, jax.numpy as jnp
if os.environ.get("FAKE_JAXLIB"):
  import jaxlib
  jaxlib.__version__ = os.environ["FAKE_JAXLIB"]  # as if another jaxlib had compiled it
from mpijax._src.xla import compile_hook
compile_hook.install(0, "key-test")
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
f = jax.jit(lambda x: jnp.tanh(x @ x) + 1, device=jax.devices()[0])
f(jnp.ones((8, 8))).block_until_ready()
print("OUTCOMES " + json.dumps(compile_hook.outcomes()))
"""


def _how(cache, **env) -> str:
  full = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith("MPIJAX_")}
  full.update(env)
  out = subprocess.run(
    [sys.executable, "-c", SCRIPT, str(cache)],
    env=full,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  line = next(line for line in out.stdout.splitlines() if line.startswith("OUTCOMES "))
  hows = {name: how for name, how, _ in json.loads(line[len("OUTCOMES ") :])}
  return hows["jit__lambda"]


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
  cache = tmp_path_factory.mktemp("cache")
  assert _how(cache) == "compiled"
  assert _how(cache) == "loaded"  # the same program, a fresh process: a hit
  return cache


@pytest.mark.parametrize(
  "change",
  [
    {"FAKE_JAXLIB": "0.10.99"},
    {"XLA_FLAGS": "--xla_cpu_enable_fast_math=true"},
    {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
    {"MPIJAX_HIERARCHICAL_MIN_BYTES": "1234"},
    {"MPIJAX_DEVICE_ALLREDUCE": "0"},
  ],
  ids=["jaxlib", "xla-flag", "device-count", "lowering-threshold", "lowering-switch"],
)
def test_what_changes_the_executable_misses(warm, change):
  assert _how(warm, **change) == "compiled"


def test_a_setting_that_does_not_shape_programs_still_hits(warm):
  assert _how(warm, MPIJAX_TIMEOUT="17") == "loaded"
