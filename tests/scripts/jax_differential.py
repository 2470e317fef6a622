"""Randomized differential test of JAX's own collectives across ranks against one process.

Plain JAX after ``mpijax.init()``: global ``jax.Array``s, ``jax.jit`` with
``NamedSharding`` (Auto and Explicit mesh axes) and
``with_sharding_constraint`` (the collectives XLA's partitioner inserts for
resharding, reductions, matmuls, roll, flip, cumsum, ...), and
``jax.shard_map`` with ``jax.lax`` psum/pmean/pmax/pmin, all_gather,
psum_scatter, all_to_all and ppermute (1-3 in a row, tiled or not, over one
mesh axis or both in either order). Case ``k`` is drawn from a seeded RNG
and depends only on the seed, the layout and ``k``: a mesh (1-D or 2-D over
the global devices, in rank-major, local-major, reversed or shuffled device
order, so that replica groups lie within a rank, span ranks, or both), a
shape (a tenth of the cases large: up to ``--large-elems`` elements), a
dtype (float32, int32, bfloat16) and the computation. The same cases run
once in a single process with as many CPU devices (``reference``), then on
every rank of an MPI job (``check``), which compares each of its shards with
the reference's block; shard_map cases compare every device's own result.

  python jax_differential.py reference --ranks P --local L --out ref.npz [--cases N] [--seed S]
  mpijax-run -n P --devices-per-process L -- \\
      python jax_differential.py check --ref ref.npz [--cases N] [--seed S]

Many cases share one jitted program (``--batch``; compilation dominates the
cost). ``--only K[,K...]`` runs those cases, each as its own program
(``--together``: batched as usual), and ``--repeat R`` calls every program R
times: to reproduce a mismatch.

Exactness: the data are small integers, bounded so that every partial sum in
any order is exact in its dtype (bfloat16: at most 256), and the results
must be bit-equal; data that only move are distinct values. A quarter of
the float32 cases use normal-distributed data instead; where such a case
sums, MPI and one process may sum in another order, and the tolerance is
``|got - ref| <= 1e-5 * max(1, max|ref|)`` (reordering changes ~1e-7 of
that; a lost or doubled contribution ~1).

Each rank prints ``DIFF rank R: C cases, M mismatches [...]``, the
collectives in its compiled programs (``DIFF HLO rank R``) and the calls XLA
made through mpijax's bridge while they ran, by kind (``DIFF BRIDGE rank
R``); rank 0 prints ``DIFF TOTAL``, the cases by collective and
replica-group kind (``DIFF COVERAGE``), the collectives of every program
(``DIFF HLO``) and the ones the cases' shard_map steps must produce
(``DIFF EXPECT``: in the HLO, and through the bridge where a step's groups
span ranks). A mismatch prints the case in full, the first differing
elements and the commands that rerun it alone; any mismatch makes every rank
exit 1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import time
from collections import Counter

FLOAT_TOL = 1e-5
SHOW = 5  # mismatches printed in full per rank


def parse_args() -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("mode", choices=["reference", "check"])
  p.add_argument("--ranks", type=int, help="reference: the MPI job's ranks")
  p.add_argument("--local", type=int, help="reference: the MPI job's devices per rank")
  p.add_argument("--out", help="reference: where to save the results (.npz)")
  p.add_argument("--ref", help="check: the reference's .npz")
  p.add_argument("--cases", type=int, default=70)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--batch", type=int, default=24, help="cases per jitted program")
  p.add_argument(
    "--max-elems",
    type=int,
    default=4096,
    help="elements of one case's global input, at most (sizes are drawn below it)",
  )
  p.add_argument("--large-elems", type=int, default=1 << 19, help="the same, for a large case")
  p.add_argument("--p-large", type=float, default=0.1, help="the share of large cases")
  p.add_argument("--only", help="comma-separated case indices, each run as its own program")
  p.add_argument("--together", action="store_true", help="--only's cases batched as usual")
  p.add_argument("--repeat", type=int, default=1, help="check: calls of each program")
  return p.parse_args()


ARGS = parse_args()
if ARGS.mode == "reference":
  if ARGS.ranks is None or ARGS.local is None or ARGS.out is None:
    raise SystemExit("reference needs --ranks, --local and --out")
  import jax

  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", ARGS.ranks * ARGS.local)
else:
  if ARGS.ref is None:
    raise SystemExit("check needs --ref (the reference's .npz)")
  import jax

  import mpijax
  from mpijax._src import jax_runtime

  RT = mpijax.init()

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec  # noqa: E402

DTYPES = {"float32": np.float32, "int32": np.int32, "bfloat16": jnp.bfloat16}


# ---------------------------------------------------------------------------
# Drawing the cases (pure NumPy: the same on every rank and in the reference)


def device_orders(seed: int, P: int, L: int) -> dict[str, list[int]]:
  """Orders of the global devices (index = rank * L + local) that meshes are built from."""
  n = P * L
  orders = {"rank-major": list(range(n)), "reversed": list(range(n))[::-1]}
  if L > 1 and P > 1:
    orders["local-major"] = [r * L + l for l in range(L) for r in range(P)]
  shuffled = [int(i) for i in np.random.default_rng([seed, P, L, 1 << 30]).permutation(n)]
  if shuffled not in orders.values():
    orders["shuffled"] = shuffled
  return orders


def mesh_shapes(n: int) -> list[tuple[int, ...]]:
  return [(n,)] + [(a, n // a) for a in range(1, n + 1) if n % a == 0]


def pick(rng, options, weights=None):
  if weights is not None:
    w = np.asarray(weights, dtype=float)
    return options[int(rng.choice(len(options), p=w / w.sum()))]
  return options[int(rng.integers(len(options)))]


def axis_options(names: list[str]) -> list[list[str]]:
  """One axis, or both in either order (the order linearizes the group)."""
  if len(names) == 1:
    return [names]
  return [[names[0]], [names[1]], list(names), list(names)[::-1]]


def draw_spec(rng, shape, names, sizes, p_shard=0.6):
  """A PartitionSpec (as a list) for ``shape``: every mesh axis used at most once."""
  free = list(names)
  spec = []
  for d in shape:
    opts = [nm for nm in free if d % sizes[nm] == 0]
    if len(free) == 2 and d % (sizes[free[0]] * sizes[free[1]]) == 0:
      opts += [list(free), list(free)[::-1]]
    if opts and rng.random() < p_shard:
      s = pick(rng, opts)
      spec.append(s)
      for nm in s if isinstance(s, list) else [s]:
        free.remove(nm)
    else:
      spec.append(None)
  return spec


def spec_split(spec, sizes):
  """Per dimension, the product of the mesh axis sizes the dimension is split over."""
  out = []
  for s in spec:
    if s is None:
      out.append(1)
    else:
      out.append(int(np.prod([sizes[nm] for nm in (s if isinstance(s, list) else [s])])))
  return out


def draw_dim(rng, n):
  return int(pick(rng, [1, 2, 3, 4, 5, 6, 8, 12, 16])) * int(pick(rng, [1, n], [2, 1]))


def draw_shape(rng, n, max_elems, large=0):
  """A shape of at most ``max_elems`` elements, or if ``large``, doubled up to near that."""
  ndim = int(pick(rng, [1, 2, 3], [2, 3, 2]))
  shape = [n] * ndim
  for _ in range(100):
    draw = [draw_dim(rng, n) for _ in range(ndim)]
    if int(np.prod(draw)) <= max_elems:
      shape = draw
      break
  target = large >> int(rng.integers(3))  # doubling keeps every dimension's divisors
  while large and int(np.prod(shape)) * 2 <= target:
    shape[int(rng.integers(ndim))] *= 2
  return shape


def draw_smap_steps(rng, local, names, sizes, max_local):
  """1-3 collectives applied in turn to the local block; returns (steps, shape, growth)."""
  steps = []
  growth = 1  # how much a sum can grow the data's magnitude
  shape = list(local)
  for _ in range(int(pick(rng, [1, 2, 3], [7, 2, 1]))):
    axes = pick(rng, axis_options(names))
    k = int(np.prod([sizes[a] for a in axes]))
    form = "name" if len(axes) == 1 and rng.random() < 0.5 else "tuple"
    ops = ["psum", "pmax", "pmin", "pmean", "ppermute"]  # pbroadcast: no CPU lowering
    elems = int(np.prod(shape))
    if elems * k <= max_local * 4:
      ops.append("all_gather")
    if any(d % k == 0 for d in shape):
      ops += ["psum_scatter", "all_to_all"]
    op = pick(rng, ops)
    st = {"op": op, "axes": axes, "form": form}
    if op in ("psum", "pmean"):
      growth *= k
    elif op == "all_gather":
      st["tiled"] = bool(rng.random() < 0.5)
      st["axis"] = int(rng.integers(len(shape) + (0 if st["tiled"] else 1)))
      if st["tiled"]:
        shape[st["axis"]] *= k
      else:
        shape.insert(st["axis"], k)
    elif op == "psum_scatter":
      dims = [i for i, d in enumerate(shape) if d % k == 0]
      st["dim"] = int(pick(rng, dims))
      st["tiled"] = bool(shape[st["dim"]] != k or rng.random() < 0.5 or len(shape) == 1)
      if st["tiled"]:
        shape[st["dim"]] //= k
      else:
        shape.pop(st["dim"])
      growth *= k
    elif op == "all_to_all":
      dims = [i for i, d in enumerate(shape) if d % k == 0]
      st["split"] = int(pick(rng, dims))
      st["concat"] = int(rng.integers(len(shape)))
      st["tiled"] = bool(shape[st["split"]] != k or rng.random() < 0.6)
      if st["tiled"]:
        shape[st["split"]] //= k
        shape[st["concat"]] *= k
      else:  # the split dimension (of size k) moves to concat
        shape.insert(st["concat"], shape.pop(st["split"]))
    elif op == "ppermute":
      perm = [int(i) for i in rng.permutation(k)]
      keep = rng.random(k) < pick(rng, [1.0, 0.7])
      st["perm"] = [[i, perm[i]] for i in range(k) if keep[i]]
    steps.append(st)
  return steps, shape, growth


def draw_jit(rng, n, names, sizes, max_elems, large):
  """A computation on global arrays that XLA's partitioner turns into collectives."""
  op = pick(
    rng,
    ["reshard", "reduce", "matmul", "roll", "flip", "transpose", "cumsum", "concat", "constraints"],
  )
  c = {"kind": "jit", "op": op}
  growth = 1
  if op == "matmul":
    m, k, p = (draw_dim(rng, n) for _ in range(3))
    while m * k > max_elems or k * p > max_elems:
      m, k, p = max(1, m // 2), max(1, k // 2), max(1, p // 2)
    c["inputs"] = [[m, k], [k, p]]
    out_shape = [m, p]
    growth = k
  else:
    shape = draw_shape(rng, n, max_elems, large)
    c["inputs"] = [shape]
    out_shape = list(shape)
    c["axis"] = int(rng.integers(len(shape)))
    if op == "reduce":
      c["reduce"] = pick(rng, ["sum", "max", "min"])
      red = sorted(
        {int(i) for i in rng.integers(len(shape), size=int(rng.integers(1, len(shape) + 1)))}
      )
      c["dims"] = red
      out_shape = [d for i, d in enumerate(shape) if i not in red]
      if c["reduce"] == "sum":
        growth = int(np.prod([shape[i] for i in red]))
    elif op == "roll":
      c["shift"] = int(rng.integers(-shape[c["axis"]], shape[c["axis"]] + 1))
    elif op == "transpose":
      c["perm"] = [int(i) for i in rng.permutation(len(shape))]
      out_shape = [shape[i] for i in c["perm"]]
    elif op == "cumsum":
      growth = shape[c["axis"]]
    elif op == "concat":
      out_shape[c["axis"]] *= 2
    elif op == "constraints":
      c["mid"] = draw_spec(rng, shape, names, sizes)
      growth = 4
  # Explicit sharding (jax.make_mesh's default axis type): reshard and the sharding rules
  # of jnp; roll, cumsum and with_sharding_constraint refuse sharded operands there.
  c["explicit"] = bool(op not in ("roll", "cumsum", "constraints") and rng.random() < 0.3)
  c["in_specs"] = [draw_spec(rng, s, names, sizes) for s in c["inputs"]]
  for _ in range(5):  # a reshard to the same spec moves nothing
    c["out_spec"] = draw_spec(rng, out_shape, names, sizes)
    if op != "reshard" or c["out_spec"] != c["in_specs"][0]:
      break
  return c, growth


def draw_case(seed: int, P: int, L: int, idx: int, args, orders: dict) -> dict:
  rng = np.random.default_rng([seed, P, L, idx])
  n = P * L
  max_elems = args.max_elems
  large = args.large_elems if rng.random() < args.p_large else 0
  order_names = sorted(orders)
  weights = {"rank-major": 4, "local-major": 2}
  order = pick(rng, order_names, [weights.get(o, 1) for o in order_names])
  shapes = mesh_shapes(n)
  mshape = pick(rng, shapes, [3 if len(s) == 1 else (6 if min(s) > 1 else 1) for s in shapes])
  names = ["x"] if len(mshape) == 1 else ["a", "b"]
  sizes = dict(zip(names, mshape))
  if rng.random() < 0.6:
    local = draw_shape(rng, n, max(1, max_elems // n), large // n)
    spec = draw_spec(rng, local, names, sizes, p_shard=0.7)
    split = spec_split(spec, sizes)
    steps, _, growth = draw_smap_steps(rng, local, names, sizes, max(1, max_elems, large) // n)
    c = {
      "kind": "smap",
      "inputs": [[d * s for d, s in zip(local, split)]],
      "in_specs": [spec],
      "steps": steps,
      "check_vma": bool(rng.random() < 0.25),
    }
  else:
    c, growth = draw_jit(rng, n, names, sizes, max_elems, large)
  dtype = pick(rng, ["float32", "int32", "bfloat16"], [9, 7, 4])
  moves = growth == 1 and not (c["kind"] == "jit" and c["op"] == "matmul")
  # Small integers keep every partial sum exact: bfloat16 up to 256 (8 bits).
  if dtype == "bfloat16" and not moves and growth * (1 if c.get("op") == "matmul" else 2) > 256:
    dtype = "float32"
  data = "normal" if dtype == "float32" and rng.random() < 0.25 else "int"
  c.update(
    idx=idx,
    order=order,
    mesh=list(mshape),
    names=names,
    dtype=dtype,
    data=data,
    moves=moves,
    growth=growth,
  )
  return c


def make_inputs(seed: int, P: int, L: int, c: dict) -> list[np.ndarray]:
  rng = np.random.default_rng([seed, P, L, c["idx"], 1])
  out = []
  for shape in c["inputs"]:
    size = int(np.prod(shape))
    if c["data"] == "normal":
      a = rng.standard_normal(size)
    elif c["moves"]:  # distinct values show any misplaced element
      span = {"bfloat16": 512, "float32": 1 << 24, "int32": 1 << 31}[c["dtype"]]
      a = (rng.permutation(size) + int(rng.integers(span))) % span - span // 2
    else:
      vmax = {"bfloat16": max(1, 128 // c["growth"]), "float32": 8, "int32": 50}[c["dtype"]]
      if c.get("op") == "matmul" and c["dtype"] == "bfloat16":
        vmax = 1
      a = rng.integers(-vmax, vmax + 1, size)
    out.append(a.reshape(shape).astype(DTYPES[c["dtype"]]))
  return out


def describe(c: dict, orders: dict, L: int) -> str:
  devs = np.array(orders[c["order"]]).reshape(c["mesh"]).tolist()
  axes = "Explicit" if c.get("explicit") else "Auto"
  head = (
    f"case {c['idx']}: {c['kind']} on mesh {dict(zip(c['names'], c['mesh']))} {axes} "
    f"({c['order']}, devices {devs}; rank = device // {L}), {c['dtype']} {c['data']} data, "
    f"inputs {c['inputs']} specs {c['in_specs']}"
  )
  if c["kind"] == "smap":
    steps = "; ".join(
      st["op"] + "(" + ", ".join(f"{k}={v}" for k, v in st.items() if k != "op") + ")"
      for st in c["steps"]
    )
    return f"{head}, check_vma={c['check_vma']}: {steps}"
  extra = {k: c[k] for k in ("reduce", "dims", "axis", "shift", "perm", "mid") if k in c}
  return f"{head}: {c['op']} {extra} -> out spec {c['out_spec']}"


def group_kind(c: dict, orders: dict, L: int) -> list[str]:
  """For each shard_map step: its device groups lie within one rank, span ranks, or both."""
  devs = np.array(orders[c["order"]]).reshape(c["mesh"])
  kinds = []
  for st in c.get("steps", []):
    axes = [c["names"].index(a) for a in st["axes"]]
    rest = [i for i in range(devs.ndim) if i not in axes]
    groups = np.transpose(devs, rest + axes).reshape(
      -1, int(np.prod([devs.shape[i] for i in axes]))
    )
    ranks = [len({int(d) // L for d in g}) for g in groups]
    if groups.shape[1] == 1:
      kinds.append("single")
    elif all(r == 1 for r in ranks):
      kinds.append("within-rank")
    elif all(r == groups.shape[1] for r in ranks):
      kinds.append("across-ranks")
    else:
      kinds.append("ranks+local")
  return kinds


# The HLO collective each shard_map step lowers to.
STEP_HLO = {
  "psum": "all-reduce",
  "pmean": "all-reduce",
  "pmax": "all-reduce",
  "pmin": "all-reduce",
  "all_gather": "all-gather",
  "psum_scatter": "reduce-scatter",
  "all_to_all": "all-to-all",
  "ppermute": "collective-permute",
}


def expected_collectives(cases: list[dict], orders: dict, L: int) -> dict[str, list[str]]:
  """The collectives the cases' shard_map steps must put into the programs: every step
  over more than one device ("hlo"), and those whose groups span ranks ("across"), which
  must reach MPI through the bridge. A ppermute counts only if some device sends to
  another."""
  hlo, across = set(), set()
  for c in cases:
    for st, kind in zip(c.get("steps", []), group_kind(c, orders, L)):
      if kind == "single" or (st["op"] == "ppermute" and all(a == b for a, b in st["perm"])):
        continue
      hlo.add(STEP_HLO[st["op"]])
      if kind != "within-rank":
        across.add(STEP_HLO[st["op"]])
  return {"hlo": sorted(hlo), "across": sorted(across)}


# ---------------------------------------------------------------------------
# Building and running the programs


def to_spec(spec) -> PartitionSpec:
  return PartitionSpec(*[tuple(s) if isinstance(s, list) else s for s in spec])


def apply_step(st: dict, v, check_vma: bool):
  axes = st["axes"][0] if st["form"] == "name" else tuple(st["axes"])
  op = st["op"]
  if check_vma:  # a collective over axes the value is invariant in must say so
    missing = tuple(a for a in st["axes"] if a not in jax.typeof(v).manual_axis_type.varying)
    if missing:
      v = jax.lax.pcast(v, missing, to="varying")
  if op in ("psum", "pmax", "pmin", "pmean"):
    return getattr(jax.lax, op)(v, axes)
  if op == "all_gather":
    return jax.lax.all_gather(v, axes, axis=st["axis"], tiled=st["tiled"])
  if op == "psum_scatter":
    return jax.lax.psum_scatter(v, axes, scatter_dimension=st["dim"], tiled=st["tiled"])
  if op == "all_to_all":
    return jax.lax.all_to_all(v, axes, st["split"], st["concat"], tiled=st["tiled"])
  if op == "ppermute":
    return jax.lax.ppermute(v, axes, [tuple(p) for p in st["perm"]])
  raise ValueError(op)


def build(c: dict, mesh: Mesh):
  """(function of the case's inputs, their shardings, the output's sharding)."""
  ins = [NamedSharding(mesh, to_spec(s)) for s in c["in_specs"]]
  if c["kind"] == "smap":
    steps, check_vma = c["steps"], c["check_vma"]

    def body(v):
      for st in steps:
        v = apply_step(st, v, check_vma)
      return v[None]  # every device's own result, stacked: all of them are compared

    every = PartitionSpec(tuple(c["names"]))
    fn = jax.shard_map(
      body, mesh=mesh, in_specs=to_spec(c["in_specs"][0]), out_specs=every, check_vma=c["check_vma"]
    )
    return fn, ins, NamedSharding(mesh, every)
  op = c["op"]
  ax = c.get("axis")
  out = NamedSharding(mesh, to_spec(c["out_spec"]))
  if op == "reshard":
    fn = lambda x: x
  elif op == "reduce":
    red = getattr(jnp, c["reduce"])
    fn = lambda x: red(x, axis=tuple(c["dims"])).astype(x.dtype)
  elif op == "matmul" and c["explicit"]:
    fn = lambda x, w: jnp.matmul(x, w, preferred_element_type=x.dtype, out_sharding=out)
  elif op == "matmul":
    fn = lambda x, w: jnp.matmul(x, w, preferred_element_type=x.dtype)
  elif op == "roll":
    fn = lambda x: jnp.roll(x, c["shift"], axis=ax)
  elif op == "flip":
    fn = lambda x: jnp.flip(x, axis=ax)
  elif op == "transpose":
    fn = lambda x: jnp.transpose(x, c["perm"])
  elif op == "cumsum":
    fn = lambda x: jnp.cumsum(x, axis=ax, dtype=x.dtype)
  elif op == "concat":
    fn = lambda x: jnp.concatenate([x, jnp.flip(x, ax)], axis=ax)
  elif op == "constraints":
    mid = NamedSharding(mesh, to_spec(c["mid"]))

    def fn(x):
      y = jax.lax.with_sharding_constraint(x + x, mid)
      return jax.lax.with_sharding_constraint(jnp.flip(y, ax) + y, ins[0])
  else:
    raise ValueError(op)
  if c["explicit"]:
    return (lambda *xs: jax.sharding.reshard(fn(*xs), out)), ins, out
  return fn, ins, out


def batches(cases: list[dict], size: int, alone: bool) -> list[list[dict]]:
  """Cases grouped by device order (one program has one device assignment), in chunks."""
  if alone:
    return [[c] for c in cases]
  by_order: dict[str, list[dict]] = {}
  for c in cases:
    by_order.setdefault(c["order"], []).append(c)
  return [
    group[i : i + size] for _, group in sorted(by_order.items()) for i in range(0, len(group), size)
  ]


# The collectives in the partitioned program (async ones as their -start half).
HLO_COLLECTIVE = re.compile(
  r"\s(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute|collective-broadcast)"
  r"(?:-start)?\("
)


def compile_batch(batch: list[dict], devices: list, orders: dict, seed: int, P: int, L: int):
  """One jitted program holding every case of ``batch``: (compiled, inputs, HLO collectives)."""
  meshes: dict[tuple, Mesh] = {}
  fns, args, in_sh, out_sh, arity = [], [], [], [], []
  for c in batch:
    explicit = c.get("explicit", False)
    key = (c["order"], tuple(c["mesh"]), tuple(c["names"]), explicit)
    if key not in meshes:
      devs = np.array([devices[i] for i in orders[c["order"]]], dtype=object).reshape(c["mesh"])
      kind = AxisType.Explicit if explicit else AxisType.Auto
      meshes[key] = Mesh(devs, tuple(c["names"]), axis_types=(kind,) * len(c["names"]))
    fn, ins, out = build(c, meshes[key])
    for a, sh in zip(make_inputs(seed, P, L, c), ins):
      args.append(jax.make_array_from_callback(a.shape, sh, lambda i, a=a: a[i]))
      in_sh.append(sh)
    fns.append(fn)
    out_sh.append(out)
    arity.append(len(ins))

  def program(*xs):
    outs, i = [], 0
    for fn, k in zip(fns, arity):
      outs.append(fn(*xs[i : i + k]))
      i += k
    return tuple(outs)

  compiled = (
    jax.jit(program, in_shardings=tuple(in_sh), out_shardings=tuple(out_sh)).lower(*args).compile()
  )
  return compiled, args, Counter(HLO_COLLECTIVE.findall(compiled.as_text()))


def signature(cases: list[dict]) -> str:
  return hashlib.sha256(json.dumps(cases, sort_keys=True).encode()).hexdigest()[:16]


def as_stored(a: np.ndarray) -> np.ndarray:
  return a.astype(np.float32) if a.dtype == jnp.bfloat16 else a


def compare(c: dict, got: np.ndarray, want: np.ndarray) -> str | None:
  """None if equal (within the tolerance of normal data that is summed), else what differs."""
  got = as_stored(got)
  if got.shape != want.shape or got.dtype != want.dtype:
    return f"shape/dtype {got.shape} {got.dtype}, expected {want.shape} {want.dtype}"
  if c["data"] == "normal" and not c["moves"]:
    tol = FLOAT_TOL * max(1.0, float(np.max(np.abs(want), initial=0.0)))
    bad = ~(np.abs(got.astype(np.float64) - want) <= tol)
    rule = f"|got - ref| <= {tol:.3g}"
  else:
    bad = got != want
    rule = "exact"
  if not bad.any():
    return None
  where = np.argwhere(bad)
  lines = [f"{int(bad.sum())} of {bad.size} elements differ ({rule})"]
  if got.size <= 64:
    lines += [f"got:\n{got}", f"expected:\n{want}"]
  else:
    lines += [
      f"  at {tuple(int(i) for i in w)}: got {got[tuple(w)]}, expected {want[tuple(w)]}"
      for w in where[:10]
    ]
  return "\n".join(lines)


def show_index(index: tuple) -> str:
  return "[" + ", ".join(f"{s.start or 0}:{'' if s.stop is None else s.stop}" for s in index) + "]"


def main() -> int:
  args = ARGS
  if args.mode == "reference":
    P, L = args.ranks, args.local
    rank = 0
    devices = sorted(jax.devices(), key=lambda d: d.id)
  else:
    P, L, rank = jax.process_count(), jax.local_device_count(), jax.process_index()
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    assert [d.process_index for d in devices] == [i // L for i in range(P * L)], devices
  n = P * L
  assert len(devices) == n, (len(devices), n)
  orders = device_orders(args.seed, P, L)
  if args.only:
    indices = [int(i) for i in args.only.split(",")]
  else:
    indices = list(range(args.cases))
  cases = [draw_case(args.seed, P, L, i, args, orders) for i in indices]
  sig = signature(cases)
  progs = batches(cases, args.batch, alone=bool(args.only) and not args.together)
  drawn = (
    f"--seed {args.seed} --max-elems {args.max_elems} --large-elems {args.large_elems} "
    f"--p-large {args.p_large}"
  )
  start = time.monotonic()

  if args.mode == "reference":
    results = {"sig": np.array(sig), "layout": np.array([P, L, args.seed])}
    for batch in progs:
      try:
        compiled, inputs, _ = compile_batch(batch, devices, orders, args.seed, P, L)
        outs = compiled(*inputs)
      except Exception:
        for c in batch:
          print(describe(c, orders, L), flush=True)
        raise
      for c, o in zip(batch, outs):
        results[f"c{c['idx']}"] = as_stored(np.asarray(o))
    np.savez(args.out, **results)
    print(
      f"DIFF REFERENCE {P}x{L}: {len(cases)} cases in {len(progs)} programs, "
      f"{time.monotonic() - start:.1f} s -> {args.out}",
      flush=True,
    )
    return 0

  from mpi4py import MPI  # the tally travels over plain MPI, not the collectives under test

  ref = np.load(args.ref)
  if [int(v) for v in ref["layout"]] != [P, L, args.seed] or str(ref["sig"]) != sig:
    raise SystemExit(
      f"{args.ref} holds other cases (layout/seed {ref['layout'].tolist()}, "
      f"signature {ref['sig']}); rerun the reference with --ranks {P} --local {L} "
      f"{drawn} and the same --cases or --only (this run's signature {sig})"
    )
  mismatches = []
  emitted = Counter()
  calls = 0
  bridge_before = jax_runtime.bridge_stats()
  for batch in progs:
    try:
      compiled, inputs, hlo = compile_batch(batch, devices, orders, args.seed, P, L)
      emitted += hlo
      for _ in range(args.repeat):
        outs = compiled(*inputs)
        for c, o in zip(batch, outs):
          calls += 1
          want = ref[f"c{c['idx']}"]
          for shard in o.addressable_shards:
            diff = compare(c, np.asarray(shard.data), want[shard.index])
            if diff is not None:
              mismatches.append((c, shard, diff))
              break
    except Exception:
      print(
        f"DIFF rank {rank}: the program of cases {[c['idx'] for c in batch]} failed:", flush=True
      )
      for c in batch:
        print("  " + describe(c, orders, L), flush=True)
      raise
  seconds = time.monotonic() - start
  bridge = Counter(jax_runtime.bridge_stats())
  bridge.subtract(bridge_before)
  # What this rank's programs hold and what XLA called the bridge for while they ran
  # (tests/test_jax_differential.py compares them with EXPECT below).
  print(f"DIFF HLO rank {rank}: {json.dumps(dict(sorted(emitted.items())))}", flush=True)
  print(f"DIFF BRIDGE rank {rank}: {json.dumps(dict(sorted(bridge.items())))}", flush=True)
  bad = sorted({c["idx"] for c, _, _ in mismatches})
  for c, shard, diff in mismatches[:SHOW]:
    print(
      f"DIFF MISMATCH rank {rank} {describe(c, orders, L)}\n"
      f"  shard {show_index(shard.index)} on device {shard.device.id} "
      f"(rank {shard.device.process_index}): {diff}\n"
      f"  rerun alone: python {sys.argv[0]} reference --ranks {P} --local {L} {drawn} "
      f"--only {c['idx']} --out /tmp/ref.npz && mpijax-run -n {P} --devices-per-process {L} "
      f"-- python {sys.argv[0]} check --ref /tmp/ref.npz {drawn} --only {c['idx']}",
      flush=True,
    )
  again = f" ({len(mismatches)} of {calls} calls)" if args.repeat > 1 else ""
  print(
    f"DIFF rank {rank}: {len(cases)} cases, {len(bad)} mismatches {bad[:20]}{again}", flush=True
  )
  comm = MPI.COMM_WORLD
  all_bad = sorted(set().union(*comm.allgather(set(bad))))
  if rank == 0:
    tally = Counter()
    for c in cases:
      if c["kind"] == "smap":
        for st, kind in zip(c["steps"], group_kind(c, orders, L)):
          tally[f"shard_map {st['op']} {kind}"] += 1
      else:
        tally[f"jit {c['op']}" + (" explicit" if c["explicit"] else "")] += 1
    print(
      f"DIFF TOTAL {P}x{L} ({RT.xla_collectives}) seed {args.seed}: {len(cases)} cases in "
      f"{len(progs)} programs, {len(all_bad)} mismatches {all_bad[:20]}, {seconds:.1f} s",
      flush=True,
    )
    print("DIFF COVERAGE " + ", ".join(f"{k}: {v}" for k, v in sorted(tally.items())), flush=True)
    print("DIFF HLO " + ", ".join(f"{k}: {v}" for k, v in sorted(emitted.items())), flush=True)
    print(f"DIFF EXPECT {json.dumps(expected_collectives(cases, orders, L))}", flush=True)
  comm.Barrier()  # rank 0 has printed the totals before any rank exits (and may abort the job)
  return 1 if all_bad else 0


if __name__ == "__main__":
  sys.exit(main())
