"""Reference: jax.shard_map / jax.pmap in one process with n CPU devices.

Differential test of mpijax.lax against jax.lax (cases in cases.py):

  python tests/scripts/difflax/ref.py 4          # -> $DIFFLAX_OUT/ref4.pkl (default /tmp)
  timeout 1500 python -m mpijax.launch -n 2 --devices-per-process 2 -- \
      python tests/scripts/difflax/run.py        # each rank prints a SUMMARY line
  timeout 1500 python -m mpijax.launch -n 4 -- python tests/scripts/difflax/run.py

run.py takes an optional filter: substrings joined by '|', or '>N' for cases from N on.
Where jax.shard_map itself fails on a case (bugs of JAX 0.10: zero-size outputs, the
untiled all_to_all transpose, complex pmax), ref.py falls back to nested named vmaps.
"""
import os
import pickle
import sys

n = int(sys.argv[1])
import jax

jax.config.update("jax_num_cpu_devices", n)
jax.config.update("jax_platforms", "cpu")
import numpy as np
from jax.sharding import Mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cases as C

OUT = os.environ.get("DIFFLAX_OUT", "/tmp")

JAX_BUGS = ["could not broadcast input array", "Expected cotangent type",
            "cannot be zero", "Cannot lower jaxpr", "axis size doesn't match", "Unsupported reduction"]


def vmap_smap(f, *, mesh, in_specs, out_specs, check_vma=False):
  """shard_map emulated by nested named vmaps (pmap semantics per mesh axis)."""
  shape, names = tuple(mesh.shape.values()), mesh.axis_names
  def g(*xs):
    fn = f
    for nm in reversed(names):
      fn = jax.vmap(fn, axis_name=nm)
    xs = [x.reshape(shape + (1,) + x.shape[1:]) for x in xs]
    out = fn(*xs)
    return jax.tree.map(lambda o: o.reshape((int(np.prod(shape)),) + o.shape[len(shape) + 1:]), out)
  return g


only = sys.argv[2] if len(sys.argv) > 2 else None
res = {}
meshes = {}
for case in C.build(n):
  if not C.selected(case, only):
    continue
  key = (case.mesh_shape, case.mesh_names)
  if key not in meshes:
    meshes[key] = Mesh(np.array(jax.devices()[:n]).reshape(case.mesh_shape), case.mesh_names)
  if os.environ.get("VERBOSE"): print(case.name, flush=True)  # noqa: E701
  smap = jax.shard_map
  try:
    fn = C.make_runner(case, jax.lax, smap, meshes[key], case.mesh_names, 0, pmap_fn=jax.pmap)
    out = fn(*C.prepare_inputs(case))
    res[case.name] = ("ok", jax.tree.map(np.asarray, out))
  except Exception as e:
    msg = f"{type(e).__name__}: {str(e)[:300]}"
    res[case.name] = ("err", msg)
    if any(p in msg for p in JAX_BUGS) and case.mode not in ("pmap", "pmap_grad"):
      try:
        fn = C.make_runner(case, jax.lax, vmap_smap, meshes[key], case.mesh_names, 0)
        out = fn(*C.prepare_inputs(case))
        res[case.name] = ("ok", jax.tree.map(np.asarray, out), "vmapref")
      except Exception as e2:
        res[case.name] = ("err", msg + f" || vmapref: {type(e2).__name__}: {str(e2)[:200]}")
with open(os.path.join(OUT, f"ref{n}.pkl"), "wb") as f:
  pickle.dump(res, f)
print("ref cases", len(res), "errors", sum(v[0] == "err" for v in res.values()))
