"""Which communicators XLA's collectives in a compiled program will ask for.

XLA's CPU runtime creates one communicator per (clique, rank) the first time
a device runs a collective over that clique: the devices of the collective's
replica group, in the group's order (XLA's ``GetParticipatingDevices``). Over
MPI it asks by ``MPI_Comm_split(MPI_COMM_WORLD, color=first device's id,
key=rank in the clique)``, from whichever of its threads runs the device at
that moment. With several devices per process those calls do not say which
device is asking, and one (color, key) stands for several cliques (device 0
is rank 0 of {0,1}, of {0,2048} and of {0,1,2048,2049}), so the bridge
cannot tell them apart from the calls alone.

This module reads, from a compiled program's HLO, the clique of every device
for every collective instruction: the replica groups (``{{0,1},{2,3}}``, the
iota form ``[2,2]<=[4]T(1,0)`` or the mesh-axes form
``mesh['a'=2,'b'=2] {'b'}``) mapped through the program's device assignment
according to the collective's group mode (channel id and
``use_global_device_ids``). A collective-permute's clique is every device of
the program in logical order (its source-target pairs name ranks in it).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from mpijax._src.xla import compile_hook
from mpijax._src.xla import hlo as xla_hlo


class UnknownReplicaGroups(ValueError):
  """A collective whose replica groups this module cannot read."""


def _ints(text: str) -> list[int]:
  return [int(v) for v in re.findall(r"-?\d+", text)]


def _iota_array(text: str) -> np.ndarray:
  """``[2,2]<=[4]``, ``[2,2]<=[2,2]T(1,0)`` or (a mesh's device ids)
  ``[2,2]T(1,0)``: the ids as an array."""
  m = re.fullmatch(r"\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?", text.strip())
  if not m:
    raise UnknownReplicaGroups(f"not an iota tile assignment: {text!r}")
  dims = _ints(m.group(1))
  reshape = _ints(m.group(2)) if m.group(2) else dims
  a = np.arange(int(np.prod(reshape))).reshape(reshape)
  if m.group(3):
    a = a.transpose(_ints(m.group(3)))
  return a.reshape(dims)


def _mesh_groups(text: str) -> list[list[int]]:
  """``mesh['a'=2,'b'=2] {'b'}`` (optionally ``, device_ids=(...)`` after the
  mesh, and sub-axes ``'a':(1)2``): XLA's MeshAxesReplicaGroupList."""
  m = re.fullmatch(
    r"mesh\[(?P<axes>[^\]]*)\](?:,\s*device_ids=\((?P<ids>.*)\))?\s*\{(?P<grp>.*)\}", text.strip()
  )
  if not m:
    raise UnknownReplicaGroups(f"not a mesh-axes replica group list: {text!r}")
  names, sizes = [], []
  for part in m.group("axes").split(","):
    name, _, size = part.strip().rpartition("=")
    names.append(name.strip().strip("'\""))
    sizes.append(int(size))
  total = int(np.prod(sizes))
  if m.group("ids"):
    ids = m.group("ids").strip()
    device_ids = (
      _iota_array(ids).reshape(-1) if ids.startswith("[") else np.array(_ints(ids))
    ).reshape(sizes)
  else:
    device_ids = np.arange(total).reshape(sizes)
  # The grouped axes, each a whole mesh axis or a sub-axis (pre_size, size).
  refs: list[tuple[int, tuple[int, int] | None]] = []
  for part in re.findall(
    r"'[^']*'(?::\(\d+\)\d+)?|\"[^\"]*\"(?::\(\d+\)\d+)?|[^,\s]+", m.group("grp")
  ):
    sub = re.fullmatch(r"(.+?):\((\d+)\)(\d+)", part)
    name = (sub.group(1) if sub else part).strip().strip("'\"")
    if name not in names:
      raise UnknownReplicaGroups(f"axis {name!r} is not in the mesh: {text!r}")
    refs.append((names.index(name), (int(sub.group(2)), int(sub.group(3))) if sub else None))
  # Per mesh dimension, how it is reshaped and which of its pieces are grouped
  # (XLA's ComputeReindexedAxes).
  reshape: list[int] = []
  grouped: list[int] = [0] * len(refs)
  for dim, size in enumerate(sizes):
    mine = [(i, r[1]) for i, r in enumerate(refs) if r[0] == dim]
    base = len(reshape)
    if not mine:
      reshape.append(size)
    elif len(mine) == 1 and mine[0][1] is None:
      reshape.append(size)
      grouped[mine[0][0]] = base
    elif len(mine) == 1:
      pre, sub_size = mine[0][1]
      reshape += [pre, sub_size, size // (pre * sub_size)]
      grouped[mine[0][0]] = base + 1
    else:
      order = sorted(mine, key=lambda t: t[1][0])
      prefix, index = 1, 0
      for i, (pre, sub_size) in order:
        if pre != prefix:
          reshape.append(pre // prefix)
          index += 1
          prefix *= pre // prefix
        reshape.append(sub_size)
        grouped[i] = base + index
        index += 1
        prefix *= sub_size
      if prefix != size:
        reshape.append(size // prefix)
  perm = [d for d in range(len(reshape)) if d not in grouped] + grouped
  group_size = int(np.prod([reshape[g] for g in grouped]))
  flat = device_ids.reshape(reshape).transpose(perm).reshape(-1)
  return [list(map(int, flat[i : i + group_size])) for i in range(0, total, group_size)]


def replica_groups(text: str | None) -> list[list[int]] | None:
  """The groups of a ``replica_groups=`` attribute (None: empty, all ids)."""
  if text is None:
    return None
  text = text.strip()
  if text in ("{}", ""):
    return None
  if text.startswith("{"):
    groups = re.findall(r"\{([\d,\s]*)\}", text[1:-1])
    return [_ints(g) for g in groups] or None
  if text.startswith("["):
    a = _iota_array(text)
    return [list(map(int, row)) for row in a.reshape(a.shape[0], -1)]
  if text.startswith("mesh"):
    return _mesh_groups(text)
  raise UnknownReplicaGroups(f"replica_groups={text}")


def _participants(
  groups: list[list[int]] | None, mode: str, assignment: np.ndarray, replica: int, partition: int
) -> tuple[int, ...]:
  """XLA's GetParticipatingDevices: the clique (global device ids, in rank
  order) of the device at (replica, partition)."""
  replicas, partitions = assignment.shape

  def find(ids: int, me: int) -> list[int]:
    if groups is None:
      return list(range(ids))
    for g in groups:
      if me in g:
        return g
    raise UnknownReplicaGroups(f"id {me} is in no replica group of {groups}")

  if mode == "cross_replica":
    return tuple(int(assignment[r, partition]) for r in find(replicas, replica))
  if mode == "cross_partition":
    return tuple(int(assignment[replica, p]) for p in find(partitions, partition))
  if mode == "cross_replica_and_partition":
    return tuple(int(assignment[r, p]) for r in find(replicas, replica) for p in range(partitions))
  flat = find(replicas * partitions, replica * partitions + partition)
  return tuple(int(assignment[i // partitions, i % partitions]) for i in flat)


def program_cliques(
  collectives: Sequence[xla_hlo.Collective],
  device_ids: Sequence[int],
  num_replicas: int,
  num_partitions: int,
) -> list[list[tuple[int, ...]]]:
  """For each collective instruction of an HLO module (in text order), the
  distinct cliques of its devices: a partition of the program's devices.

  ``device_ids``: the global ids of the program's device assignment,
  replica-major (the order of the logical ids).
  """
  assignment = np.asarray(list(device_ids), dtype=np.int64).reshape(num_replicas, num_partitions)
  out: list[list[tuple[int, ...]]] = []
  for c in collectives:
    has_channel = c.attribute("channel_id") is not None
    global_ids = c.attribute("use_global_device_ids")
    if c.kind == "collective-permute":
      groups = None
    else:
      groups = replica_groups(c.attribute("replica_groups"))
    if not has_channel:
      mode = "cross_replica"
    elif global_ids is None:
      mode = "cross_partition"
    elif global_ids == "true":
      mode = "flattened"
    else:
      mode = "cross_replica_and_partition"
    cliques: list[tuple[int, ...]] = []
    for r in range(num_replicas):
      for p in range(num_partitions):
        c = _participants(groups, mode, assignment, r, p)
        if c not in cliques:
          cliques.append(c)
    out.append(cliques)
  return out


# --- preparing them: several devices per process ------------------------------------

_lock = threading.RLock()
_state = threading.local()  # .warming: inside a warm-up (its own compile is skipped)
_prepared: set[tuple[int, ...]] = set()
_installed = False


def _device_table() -> dict[int, tuple[Any, int, int]]:
  """Global device id -> (device, process index, local device index there)."""
  import jax

  table, seen = {}, {}
  for d in sorted(jax.devices(), key=lambda d: d.id):
    local = seen.get(d.process_index, 0)
    seen[d.process_index] = local + 1
    table[d.id] = (d, d.process_index, local)
  return table


def _warm_up(
  ext: Any, cliques: list[tuple[int, ...]], ids: list[int], table: dict[int, tuple[Any, int, int]]
) -> None:
  """Has XLA create the communicators of `cliques` (disjoint, of one size) in
  a program with one all-reduce over each, where XLA's requests are
  unambiguous; checks its result."""
  import jax
  from jax.sharding import Mesh
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec

  devices = np.array([[table[d][0] for d in c] for c in cliques])
  if not any(d.process_index == jax.process_index() for d in devices.flat):
    return  # none of this process's devices: the others make theirs
  from mpijax._src import jax_compat

  mesh = Mesh(devices, ("clique", "member"))
  spec = PartitionSpec(("clique", "member"))
  size = devices.shape[1]

  def mpijax_prepare_communicators(v):
    return jax.lax.psum(v, "member")

  fn = jax.jit(
    jax.shard_map(mpijax_prepare_communicators, mesh=mesh, in_specs=spec, out_specs=spec)
  )
  sharding = NamedSharding(mesh, spec)
  ones = np.ones(devices.size, np.float32)
  ext.xla_expect([i for i in ids if i >= 0])
  _state.warming = True
  try:
    with jax_compat.no_context_mesh():
      x = jax.make_array_from_callback(ones.shape, sharding, lambda index: ones[index])
      out = fn(x)
    got = [float(np.asarray(s.data).reshape(-1)[0]) for s in out.addressable_shards]
  finally:
    _state.warming = False
    ext.xla_expect([])
  if any(g != size for g in got):
    raise RuntimeError(
      f"mpijax: XLA's communicators over the devices {cliques} failed their first "
      f"all-reduce (a sum of ones over {size} devices gave {got}). Run with "
      "MPIJAX_XLA_COLLECTIVES=gloo and report this."
    )


def prepare(program: compile_hook.Program) -> None:
  """Prepares, then has XLA create, every communicator a compiled program's
  collectives will ask for (collective over the ranks of each; every rank
  compiles the same programs in the same order). A compile hook reader."""
  from mpijax._src import ffi

  if getattr(_state, "warming", False):
    return
  flat = list(np.asarray(program.devices, dtype=object).flat)
  build = program.compile_options.executable_build_options
  replicas, partitions = build.num_replicas, build.num_partitions
  if replicas * partitions != len(flat):
    replicas, partitions = 1, len(flat)
  ids = [d.id for d in flat]
  programs = []
  for module in program.hlo:
    programs += program_cliques(module.collectives, ids, replicas, partitions)
  if not programs:
    return
  ext = ffi.load()
  with _lock:
    table = _device_table()
    for cliques in programs:
      new = [c for c in cliques if c not in _prepared]
      made = {}
      for c in new:
        world = [table[d][1] for d in c]
        local = [table[d][2] for d in c]
        made[c] = ext.xla_prepare_clique(list(c), world, local)
        _prepared.add(c)
      sizes = sorted({len(c) for c in new if len(c) > 1})
      for size in sizes:
        group = [c for c in new if len(c) == size]
        _warm_up(ext, group, [made[c] for c in group], table)


def install(local_devices: int) -> None:
  """From now on, every program JAX compiles has its XLA communicators
  prepared before it runs (several devices per process)."""
  global _installed
  from mpijax._src import ffi

  if _installed:
    return
  ffi.load().xla_enable_members(int(local_devices))
  compile_hook.add_reader(prepare)
  _installed = True
