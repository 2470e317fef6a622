"""Differential cases: mpijax.lax under mpijax maps vs jax.lax under jax maps (n devices)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass
class Case:
  name: str
  mesh_shape: tuple
  mesh_names: tuple
  body: Callable  # body(lx, *per_device_arrays) -> pytree
  inputs: list    # global arrays, leading dim n (device-major)
  mode: str = "plain"  # plain | jit | grad_out | grad_in | vmap_out | scan | pmap
  exact: bool = False
  tol: float = 1e-5
  check_vma: bool = False


def _arr(rng, shape, dtype, ties=False):
  dtype = np.dtype(dtype) if dtype != "bfloat16" else jnp.bfloat16
  if dtype == np.bool_:
    return rng.integers(0, 2, size=shape).astype(bool)
  if np.dtype(dtype).kind in "iu":
    lo = -50 if np.dtype(dtype).kind == "i" else 0
    return rng.integers(lo, 50, size=shape).astype(dtype)
  v = rng.normal(size=shape)
  if ties:
    v = np.round(v)
  return v.astype(dtype)


def is_float(dt):
  return jnp.issubdtype(dt, jnp.floating)


def tol_for(dt):
  dt = jnp.dtype(dt)
  if dt == jnp.bfloat16:
    return 3e-2
  if dt == jnp.float16:
    return 3e-3
  return 2e-5


def axis_choices(names):
  if len(names) == 1:
    return [names[0], (names[0],)]
  a, b = names
  return [a, b, (a, b), (b, a)]


def _pick_axis(rng, ax_all, names, n):
  """A random axis (name or tuple) of the mesh and its size."""
  ax = ax_all[rng.integers(len(ax_all))]
  size = n if isinstance(ax, tuple) and len(ax) == 2 or len(names) == 1 else 2
  if ax in ("one", ("one",)):
    size = 1
  elif ax in ("all", ("all",)):
    size = 4
  return ax, size


def _pick_mode(rng, dt):
  """How a case runs; gradients only of float32."""
  mode = ["plain", "jit", "vmap_out", "scan", "grad_out", "grad_in"][rng.integers(6)]
  return "jit" if mode.startswith("grad") and dt != "float32" else mode


def selected(case, only):
  """Whether the command-line filter (substrings joined by '|', or '>N') keeps ``case``."""
  if not only:
    return True
  if only.startswith(">"):
    return int(case.name[:4]) >= int(only[1:])
  return any(o in case.name for o in only.split("|"))


def build(n: int, seed: int = 0) -> list[Case]:
  rng = np.random.default_rng(seed)
  cases: list[Case] = []
  meshes = [((n,), ("x",))]
  if n == 4:
    meshes.append(((2, 2), ("data", "model")))
    meshes.append(((1, 4), ("one", "all")))
  dtypes = ["float32", "bfloat16", "float16", "int32", "int8", "uint8", "bool"]

  def add(name, shape, names, body, inputs, mode="plain", exact=None, tol=None, vma=False):
    dts = [x.dtype for x in inputs]
    if exact is None:
      exact = not any(is_float(d) for d in dts)
    if tol is None:
      tol = max([tol_for(d) for d in dts if is_float(d)] or [1e-5])
    cases.append(Case(f"{len(cases):04d}:{name}", shape, names, body, inputs, mode, exact, tol,
                      vma))

  for shape, names in meshes:
    ms = f"{shape}"
    ax_all = axis_choices(names)
    # --- reductions
    for op in ["psum", "pmean", "pmax", "pmin"]:
      for dt in dtypes:
        if op == "pmean" and not is_float(jnp.dtype(dt) if dt != "bfloat16" else jnp.bfloat16):
          continue
        for dshape in [(), (3,), (2, 0), (2, 3)]:
          ax = ax_all[rng.integers(len(ax_all))]
          x = _arr(rng, (n,) + dshape, dt, ties=op in ("pmax", "pmin"))
          add(f"{ms} {op} {dt} {dshape} {ax}", shape, names,
              lambda lx, x, op=op, ax=ax: getattr(lx, op)(x, ax), [x],
              mode=["plain", "jit"][rng.integers(2)])
      # hierarchical path
      ax = ax_all[rng.integers(len(ax_all))]
      x = _arr(rng, (n, 20000), "float32", ties=op in ("pmax", "pmin"))
      add(f"{ms} {op} big {ax}", shape, names, lambda lx, x, op=op, ax=ax: getattr(lx, op)(x, ax),
          [x], mode="jit")
      for mode in ["grad_out", "grad_in", "vmap_out", "scan"]:
        ax = ax_all[rng.integers(len(ax_all))]
        big = mode in ("grad_out",) and rng.integers(2)
        x = _arr(rng, (n, 20000 if big else 3), "float32", ties=op in ("pmax", "pmin"))
        add(f"{ms} {op} {mode} big={big} {ax}", shape, names,
            lambda lx, x, op=op, ax=ax: getattr(lx, op)(x, ax), [x], mode=mode)
    # pytree
    ax = ax_all[-1]
    add(f"{ms} psum pytree {ax}", shape, names,
        lambda lx, a, b, ax=ax: lx.psum({"a": a, "b": (b, a * 2)}, ax),
        [_arr(rng, (n, 2), "float32"), _arr(rng, (n,), "int32")])
    # --- axis_index
    for ax in ax_all:
      add(f"{ms} axis_index {ax}", shape, names,
          lambda lx, x, ax=ax: lx.axis_index(ax) + 0 * x, [_arr(rng, (n,), "int32")])
    # --- all_gather
    for _ in range(24):
      ax = ax_all[rng.integers(len(ax_all))]
      dt = dtypes[rng.integers(len(dtypes))]
      nd = int(rng.integers(0, 3))
      dshape = tuple(int(s) for s in rng.integers(1, 4, size=nd))
      if rng.integers(6) == 0 and nd:
        dshape = dshape[:-1] + (0,)
      tiled = bool(rng.integers(2)) and nd > 0
      valid = nd if tiled else nd + 1
      axis = int(rng.integers(-valid, valid))
      mode = ["plain", "jit", "vmap_out", "scan", "grad_out", "grad_in"][rng.integers(6)]
      if mode.startswith("grad") and dt not in ("float32",):
        mode = "jit"
      x = _arr(rng, (n,) + dshape, dt)
      add(f"{ms} all_gather {dt} {dshape} axis={axis} tiled={tiled} {ax} {mode}", shape, names,
          lambda lx, x, ax=ax, axis=axis, tiled=tiled: lx.all_gather(x, ax, axis=axis, tiled=tiled),
          [x], mode=mode)
    # --- psum_scatter
    for _ in range(20):
      ax, size = _pick_axis(rng, ax_all, names, n)
      dt = ["float32", "int32", "bfloat16", "float16", "bool"][rng.integers(5)]
      nd = int(rng.integers(1, 4))
      dshape = [int(s) for s in rng.integers(1, 3, size=nd)]
      d = int(rng.integers(-nd, nd))
      tiled = bool(rng.integers(2))
      dshape[d] = size * (int(rng.integers(1, 3)) if tiled else 1)
      mode = _pick_mode(rng, dt)
      x = _arr(rng, (n,) + tuple(dshape), dt)
      add(f"{ms} psum_scatter {dt} {tuple(dshape)} d={d} tiled={tiled} {ax} {mode}", shape, names,
          lambda lx, x, ax=ax, d=d, tiled=tiled: lx.psum_scatter(
              x, ax, scatter_dimension=d % x.ndim if lx is jax.lax else d, tiled=tiled), [x], mode=mode)
    # --- all_to_all
    for _ in range(24):
      ax, size = _pick_axis(rng, ax_all, names, n)
      dt = ["float32", "int32", "bfloat16", "bool", "uint8"][rng.integers(5)]
      nd = int(rng.integers(1, 4))
      dshape = [int(s) for s in rng.integers(1, 4, size=nd)]
      sa = int(rng.integers(-nd, nd))
      ca = int(rng.integers(-nd, nd))
      tiled = bool(rng.integers(2))
      dshape[sa] = size * (int(rng.integers(1, 3)) if tiled else 1)
      mode = _pick_mode(rng, dt)
      x = _arr(rng, (n,) + tuple(dshape), dt)
      add(f"{ms} all_to_all {dt} {tuple(dshape)} sa={sa} ca={ca} tiled={tiled} {ax} {mode}", shape,
          names, lambda lx, x, ax=ax, sa=sa, ca=ca, tiled=tiled: lx.all_to_all(
              x, ax, *((sa % x.ndim, ca % x.ndim) if lx is jax.lax else (sa, ca)), tiled=tiled), [x], mode=mode)
    # --- ppermute (mesh-ordered tuples only: README documents the difference)
    for _ in range(16):
      ax = ax_all[rng.integers(len(ax_all))]
      if isinstance(ax, tuple) and len(ax) == 2 and ax != names:
        ax = names
      size = {"x": n, "data": 2, "model": 2, "one": 1, "all": 4}[ax] if isinstance(ax, str) else (
          n if len(ax) == 2 or len(names) == 1 else {"data": 2, "model": 2, "one": 1, "all": 4}[ax[0]])
      p = rng.permutation(size)
      k = int(rng.integers(1, size + 1))
      srcs = rng.permutation(size)[:k]
      perm = [(int(s), int(p[s])) for s in srcs]
      dt = ["float32", "int32", "bfloat16", "bool"][rng.integers(4)]
      mode = _pick_mode(rng, dt)
      x = _arr(rng, (n, 2), dt)
      add(f"{ms} ppermute {dt} perm={perm} {ax} {mode}", shape, names,
          lambda lx, x, ax=ax, perm=perm: lx.ppermute(x, ax, perm), [x], mode=mode)
    # --- vmapped named axis mixed with mesh axes (inside the body)
    for op in ["psum", "pmax", "all_gather", "axis_index", "all_to_all", "pmean"]:
      for order in ["vfirst", "vlast"]:
        mesh_ax = ax_all[rng.integers(len(ax_all))]
        mesh_ax = (mesh_ax,) if isinstance(mesh_ax, str) else mesh_ax
        if op == "ppermute":
          mesh_ax = names if len(mesh_ax) == 2 else mesh_ax
        ax = ("v",) + mesh_ax if order == "vfirst" else mesh_ax + ("v",)
        V = 2
        tot = V * {"x": n, "data": 2, "model": 2, "one": 1, "all": 4}.get(mesh_ax[0], n) * (
            {"x": n, "data": 2, "model": 2, "one": 1, "all": 4}[mesh_ax[1]] if len(mesh_ax) > 1 else 1)
        if op in ("psum_scatter", "all_to_all"):
          x = _arr(rng, (n, V, tot, 2), "float32")
        else:
          x = _arr(rng, (n, V, 3), "float32")
        perm = [(i, (i + 1) % tot) for i in range(tot)]

        def body(lx, x, op=op, ax=ax, perm=perm):
          def inner(y):
            if op == "axis_index":
              return lx.axis_index(ax) + 0 * y.astype(jnp.int32)
            if op == "all_gather":
              return nested_gather(lx, y, ax, 1)
            if op == "psum_scatter":
              return lx.psum_scatter(y, ax, scatter_dimension=0, tiled=False)
            if op == "all_to_all":
              return lx.all_to_all(y, ax, 0, 1, tiled=False)
            if op == "ppermute":
              return lx.ppermute(y, ax, perm)
            return getattr(lx, op)(y, ax)
          return jax.vmap(inner, axis_name="v")(x)
        mode = ["plain", "jit", "grad_out"][rng.integers(3)]
        if op == "axis_index" and mode == "grad_out":
          mode = "jit"
        add(f"{ms} vmap-inside {op} {ax} {mode}", shape, names, body, [x], mode=mode)
    # --- axis_index_groups
    for op in ["psum", "pmax", "pmin", "pmean", "all_gather", "psum_scatter", "all_to_all"]:
      for ax in ax_all[:1]:
        size = {"x": n, "data": 2, "model": 2, "one": 1, "all": 4}[ax]
        if size < 2:
          continue
        perm = [int(i) for i in rng.permutation(size)]
        if size == 4:
          groups = [perm[:2], perm[2:]]
        else:
          groups = [[i] for i in perm]
        if op in ("psum_scatter", "all_to_all"):
          gs = len(groups[0])
          x = _arr(rng, (n, gs * 2, 3), "float32")
        else:
          x = _arr(rng, (n, 3), "float32" if op != "psum" else "int32")

        def body(lx, x, op=op, ax=ax, groups=groups):
          if op == "all_gather":
            return lx.all_gather(x, ax, axis_index_groups=groups, tiled=True)
          if op == "psum_scatter":
            return lx.psum_scatter(x, ax, axis_index_groups=groups, tiled=True)
          if op == "all_to_all":
            return lx.all_to_all(x, ax, 0, 1, axis_index_groups=groups, tiled=True)
          return getattr(lx, op)(x, ax, axis_index_groups=groups)
        add(f"{ms} groups {op} {groups} {ax}", shape, names, body, [x], mode="pmap"
            if len(names) == 1 else "plain")
    # --- errors jax raises
    add(f"{ms} err psum_scatter wrong size", shape, names,
        lambda lx, x, names=names: lx.psum_scatter(x, names[0], tiled=False), [_arr(rng, (n, n + 1), "float32")])
    add(f"{ms} err all_to_all split out of range", shape, names,
        lambda lx, x, names=names: lx.all_to_all(x, names[0], 3, 0), [_arr(rng, (n, n), "float32")])
    add(f"{ms} err all_gather axis out of range", shape, names,
        lambda lx, x, names=names: lx.all_gather(x, names[0], axis=3), [_arr(rng, (n, 2), "float32")])
    add(f"{ms} err ppermute dup", shape, names,
        lambda lx, x, names=names: lx.ppermute(x, names[0], [(0, 1), (1, 1)]), [_arr(rng, (n, 2), "float32")])
    add(f"{ms} err psum_scatter scalar", shape, names,
        lambda lx, x, names=names: lx.psum_scatter(x, names[0]), [_arr(rng, (n,), "float32")])
    add(f"{ms} err all_gather tiled scalar", shape, names,
        lambda lx, x, names=names: lx.all_gather(x, names[0], tiled=True), [_arr(rng, (n,), "float32")])
  # --- pmap mode (1-D)
  for op in ["psum", "pmean", "pmax", "pmin", "all_gather", "ppermute", "axis_index",
             "psum_scatter", "all_to_all"]:
    x = _arr(rng, (n, n, 2), "float32")
    perm = [(i, (i * 3 + 1) % n) for i in range(n)] if n != 3 else [(0, 2), (2, 1), (1, 0)]

    def body(lx, x, op=op, perm=perm):
      if op == "all_gather":
        return lx.all_gather(x, "x", axis=-1)
      if op == "ppermute":
        return lx.ppermute(x, "x", perm)
      if op == "axis_index":
        return lx.axis_index("x")
      if op == "psum_scatter":
        return lx.psum_scatter(x, "x", scatter_dimension=0)
      if op == "all_to_all":
        return lx.all_to_all(x, "x", 0, 1, tiled=True)
      return getattr(lx, op)(x, "x")
    add(f"pmap {op}", (n,), ("x",), body, [x], mode="pmap")
    if op != "axis_index":
      add(f"pmap grad {op}", (n,), ("x",), body, [x], mode="pmap_grad")
  extra(n, add, meshes)
  return cases


def extra(n, add, meshes):
  rng = np.random.default_rng(1)
  for shape, names in meshes:
    ms = f"{shape}"
    ax_all = axis_choices(names)
    sizes = dict(zip(names, shape))
    size_of = lambda ax: int(np.prod([sizes[a] for a in ((ax,) if isinstance(ax, str) else ax)]))
    # pmean of ints / bools; complex
    for dt in ["int32", "bool", "int8"]:
      ax = ax_all[rng.integers(len(ax_all))]
      add(f"{ms} pmean {dt} {ax}", shape, names, lambda lx, x, ax=ax: lx.pmean(x, ax),
          [_arr(rng, (n, 3), dt)], exact=False)
    for op in ["psum", "pmax", "pmin", "pmean"]:
      ax = ax_all[rng.integers(len(ax_all))]
      x = (np.round(_arr(rng, (n, 3), "float32")) + 1j * _arr(rng, (n, 3), "float32")).astype(
          np.complex64)
      add(f"{ms} {op} complex {ax}", shape, names, lambda lx, x, op=op, ax=ax: getattr(lx, op)(x, ax),
          [x], exact=op in ("pmax", "pmin"), tol=1e-5, mode=["plain", "jit"][rng.integers(2)])
    # NaN / inf / signed zeros in pmax/pmin (plain and hierarchical)
    for op in ["pmax", "pmin", "psum"]:
      for size in [5, 20000]:
        for dt in ["float32", "bfloat16"]:
          ax = ax_all[rng.integers(len(ax_all))]
          x = _arr(rng, (n, size), dt, ties=True).astype(np.float32)
          x[rng.integers(n), 0] = np.nan
          x[:, 1] = np.nan
          x[0, 2] = np.inf
          x[1, 3] = -np.inf
          x[:, 4] = [(-0.0 if i % 2 else 0.0) for i in range(n)]
          if dt == "bfloat16":
            x = x.astype(jnp.bfloat16)
          add(f"{ms} {op} nan/inf {dt} {size} {ax}", shape, names,
              lambda lx, x, op=op, ax=ax: getattr(lx, op)(x, ax), [x], mode="jit", exact=True)
    # big int / bool reductions (hierarchical path)
    for op in ["psum", "pmax", "pmin"]:
      for dt in ["int32", "bool", "int8", "uint8"]:
        ax = ax_all[rng.integers(len(ax_all))]
        add(f"{ms} {op} big {dt} {ax}", shape, names,
            lambda lx, x, op=op, ax=ax: getattr(lx, op)(x, ax), [_arr(rng, (n, 70001), dt)],
            mode="jit")
    # check_vma=True
    for op in ["psum", "pmean", "all_gather", "ppermute", "psum_scatter", "all_to_all",
               "axis_index", "pmax"]:
      for mode in ["jit", "grad_out"]:
        if op in ("axis_index", "pmax") and mode == "grad_out":
          continue
        ax = ax_all[rng.integers(len(ax_all))]
        if op == "ppermute" and not isinstance(ax, str):
          ax = names
        k = size_of(ax)
        perm = [(i, (i + 1) % k) for i in range(k)]
        x = _arr(rng, (n, k, 3), "float32")

        def body(lx, x, op=op, ax=ax, perm=perm):
          if op == "all_gather":
            return lx.all_gather(x, ax, axis=1)
          if op == "ppermute":
            return lx.ppermute(x, ax, perm)
          if op == "psum_scatter":
            return lx.psum_scatter(x, ax)
          if op == "all_to_all":
            return lx.all_to_all(x, ax, 0, 1)
          if op == "axis_index":
            return lx.axis_index(ax)
          return getattr(lx, op)(x, ax)
        add(f"{ms} vma {op} {ax} {mode}", shape, names, body, [x], mode=mode, vma=True)
    # groups over other axes / tuples
    for ax in ax_all:
      k = size_of(ax)
      if k < 2:
        continue
      for groups in ([list(range(k))], [list(reversed(range(k)))],
                     [[i, i + k // 2] for i in range(k // 2)] if k >= 4 else [[1, 0]]):
        for op in ["psum", "pmax", "pmean", "all_gather", "psum_scatter", "all_to_all"]:
          gs = len(groups[0])
          if op in ("psum_scatter", "all_to_all"):
            x = _arr(rng, (n, gs, 2), "float32")
          else:
            x = _arr(rng, (n, 2), "float32")
          mode = ["plain", "jit", "grad_out"][rng.integers(3)]
          if op == "pmax" and mode == "grad_out":
            mode = "jit"

          def body(lx, x, op=op, ax=ax, groups=groups):
            if op == "all_gather":
              return lx.all_gather(x, ax, axis_index_groups=groups, axis=1)
            if op == "psum_scatter":
              return lx.psum_scatter(x, ax, axis_index_groups=groups)
            if op == "all_to_all":
              return lx.all_to_all(x, ax, 0, 1, axis_index_groups=groups)
            return getattr(lx, op)(x, ax, axis_index_groups=groups)
          add(f"{ms} groups2 {op} {groups} {ax} {mode}", shape, names, body, [x], mode=mode)
    # an outer vmap axis named inside the body
    for op in ["psum", "all_gather", "axis_index", "pmax"]:
      ax = ax_all[rng.integers(len(ax_all))]
      ax2 = ("b",) + ((ax,) if isinstance(ax, str) else ax)

      def body(lx, x, op=op, ax2=ax2):
        if op == "all_gather":
          return nested_gather(lx, x, ax2, 0)
        if op == "axis_index":
          return lx.axis_index(ax2)
        return getattr(lx, op)(x, ax2)
      add(f"{ms} outer-vmap {op} {ax2}", shape, names, body, [_arr(rng, (n, 3), "float32")],
          mode="vmap_named")


# ------------------------------------------------------------------------------------------


def nested_gather(lx, y, ax, axis):
  """all_gather over a tuple; for jax.lax (whose batching rule asserts on mixed vmap/mesh
  tuples) one name at a time, innermost first."""
  if lx is not jax.lax:
    return lx.all_gather(y, ax, axis=axis)
  g = y[None]
  for nm in reversed(ax):
    g = jax.lax.all_gather(g, nm)
    g = g.reshape((g.shape[0] * g.shape[1],) + y.shape)
  return jnp.moveaxis(g, 0, axis)


def _weights(leaf, off, nrow_dim=0):
  """Deterministic weights for a leaf whose dim nrow_dim is the global device index."""
  shape = leaf.shape
  idx = jnp.arange(int(np.prod(shape)), dtype=jnp.float32).reshape(shape) if shape else jnp.float32(0)
  rows = jnp.arange(shape[nrow_dim], dtype=jnp.float32) + off
  rows = rows.reshape((1,) * nrow_dim + (-1,) + (1,) * (len(shape) - nrow_dim - 1))
  per_row = int(np.prod(shape)) // max(shape[nrow_dim], 1)
  within = (idx % max(per_row, 1)) if shape else idx
  return jnp.cos(0.37 * rows + 0.11 * within)


def _loss(out, off):
  tot = 0.0
  for leaf in jax.tree.leaves(out):
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      tot = tot + (leaf.astype(jnp.float32) * _weights(leaf, off)).sum()
  return tot


def make_runner(case: Case, lx, smap, mesh, all_axes, off: int, pmap_fn=None):
  """Returns f(*inputs) -> outputs, in terms of (global|local) device-major arrays."""
  spec = jax.sharding.PartitionSpec(all_axes)

  def dev_body(*xs):
    xs = [x[0] for x in xs]
    if case.mode == "scan":
      def step(c, xt):
        return c, case.body(lx, *xt)
      _, out = jax.lax.scan(step, 0, tuple(xs))
    elif case.mode == "grad_in":
      def loss(*ys):
        out = case.body(lx, *ys)
        tot = 0.0
        for leaf in jax.tree.leaves(out):
          w = jnp.cos(0.3 * jnp.arange(leaf.size, dtype=jnp.float32).reshape(leaf.shape)
                      + 0.7 * lx.axis_index(all_axes).astype(jnp.float32))
          tot = tot + (leaf.astype(jnp.float32) * w).sum()
        return tot
      out = jax.grad(loss, argnums=tuple(range(len(xs))))(*xs)
    else:
      out = case.body(lx, *xs)
    return jax.tree.map(lambda o: jnp.asarray(o)[None], out)

  if case.mode in ("pmap", "pmap_grad"):
    def pbody(*xs):
      if case.mode == "pmap_grad":
        def loss(*ys):
          out = case.body(lx, *ys)
          return sum((leaf * jnp.cos(0.3 * jnp.arange(leaf.size, dtype=jnp.float32).reshape(
              leaf.shape) + 0.7 * lx.axis_index("x"))).sum() for leaf in jax.tree.leaves(out))
        return jax.grad(loss)(*xs)
      return case.body(lx, *xs)
    return pmap_fn(pbody, axis_name="x")

  mapped = smap(dev_body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=case.check_vma)
  if case.mode == "plain" or case.mode in ("scan", "grad_in"):
    return mapped
  if case.mode == "jit":
    return jax.jit(mapped)
  if case.mode == "grad_out":
    def g(*xs):
      return jax.grad(lambda *ys: _loss(mapped(*ys), off), argnums=tuple(range(len(xs))))(*xs)
    return jax.jit(g)
  if case.mode == "vmap_out":
    return jax.jit(jax.vmap(mapped))
  if case.mode == "vmap_named":
    return jax.jit(jax.vmap(mapped, axis_name="b"))
  raise ValueError(case.mode)


def prepare_inputs(case: Case):
  """Global inputs as fed to the global function (vmap_out: batch dim 0; scan: T dim 1)."""
  xs = case.inputs
  if case.mode in ("vmap_out", "vmap_named"):
    xs = [np.stack([x, x[::-1].copy() if x.shape and True else x]) for x in xs]
  if case.mode == "scan":
    xs = [np.stack([x, x[::-1].copy()], axis=1) for x in xs]
  return xs


def row_dim(case: Case) -> int:
  return 1 if case.mode in ("vmap_out", "vmap_named") else 0
