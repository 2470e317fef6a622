"""Where every rank and device of the job sits: the node layout, the
coordinator's address, and the global device table (``init()``'s collective
steps use these)."""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Sequence

from mpijax._src import config
from mpijax._src import mpi_util


@dataclasses.dataclass(frozen=True)
class Topology:
  """Where this rank sits in the job (``mpijax.init().topology``).

  Attributes:
    rank: this rank's index in the job (the runtime communicator's rank).
    size: the number of ranks.
    local_rank: this rank's index among the ranks on its node.
    local_size: the number of ranks on this node.
    node_index: this node's index, nodes numbered by their first rank.
    node_count: the number of nodes.
    hostnames: every rank's host name, in rank order (``hostname`` is this
      rank's).
    coordinator_address: ``"host:port"`` of JAX's distributed coordinator.
    launcher: the launcher detected (``"openmpi4"``, ``"prrte"``,
      ``"slurm"``, ``"mpich"``, ``"mpi"`` or ``"single"``).
  """

  rank: int
  size: int
  local_rank: int
  local_size: int
  node_index: int
  node_count: int
  hostnames: tuple[str, ...]  # one per rank, in rank order
  coordinator_address: str
  launcher: str

  @property
  def hostname(self) -> str:
    return self.hostnames[self.rank]

  def __str__(self) -> str:
    return (
      f"Topology(rank={self.rank}, size={self.size}, local_rank={self.local_rank}, "
      f"local_size={self.local_size}, node={self.node_index}/{self.node_count}, "
      f"host={self.hostname!r}, coordinator={self.coordinator_address!r}, "
      f"launcher={self.launcher!r})"
    )


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
  """One entry of the global device table (``mpijax.devices()``).

  Attributes:
    process_index: the rank that holds the device.
    local_index: its index among that rank's devices.
    global_index: ``process_index * local_device_count + local_index``, its
      position in every :class:`GlobalMesh`.
    platform: the JAX platform (``"cpu"``).
    host: the host name of the rank.
    device_kind: JAX's ``device_kind`` of the device.
  """

  process_index: int
  local_index: int
  global_index: int
  platform: str
  host: str
  device_kind: str


def free_port(host: str) -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def coordinator_host(hostnames: Sequence[str], rank0_host: str) -> str:
  explicit = config.get("coordinator_host")
  if explicit:
    return explicit
  others = [h for h in hostnames if h != rank0_host]
  if not others:
    return "127.0.0.1"  # a single-node job never needs to listen beyond loopback
  addr = mpi_util.route_address(others[0])
  if addr:
    return addr
  try:
    return socket.gethostbyname(rank0_host)
  except OSError:
    return rank0_host


def pick_coordinator(comm, hostnames: Sequence[str], explicit: str | None) -> str:
  if explicit:
    return explicit
  address = None
  if comm.rank == 0:
    host = coordinator_host(hostnames, hostnames[0])
    port = config.get("coordinator_port") or free_port(host if host != "0.0.0.0" else "")
    address = f"{host}:{port}"
  return mpi_util.bcast_str(comm, address, root=0)


def node_layout(hostnames: Sequence[str], rank: int) -> tuple[int, int]:
  nodes: list[str] = []
  for h in hostnames:
    if h not in nodes:
      nodes.append(h)
  return nodes.index(hostnames[rank]), len(nodes)


def check_device_counts(comm, count: int) -> list[int]:
  """Collective: every rank's local device count, or an error naming the odd ranks."""
  counts = mpi_util.allgather_int(comm, count)
  if len(set(counts)) != 1:
    majority = max(set(counts), key=counts.count)
    odd = [r for r, c in enumerate(counts) if c != majority]
    raise RuntimeError(
      "mpijax.init(): every rank must have the same number of local devices, but "
      + ", ".join(f"rank {r} has {counts[r]}" for r in odd)
      + f" while the others have {majority}. Set the same devices_per_process / "
      "MPIJAX_DEVICES_PER_PROCESS / XLA_FLAGS on every rank (mpijax-run does this)."
    )
  return counts


def device_table(comm, local_devices, host: str) -> tuple[DeviceInfo, ...]:
  counts = check_device_counts(comm, len(local_devices))
  platform = local_devices[0].platform
  kind = getattr(local_devices[0], "device_kind", platform)
  described = mpi_util.allgather_str(comm, f"{platform}\t{kind}\t{host}")
  L = counts[0]
  table = []
  for p, text in enumerate(described):
    plat, dkind, h = text.split("\t")
    for l in range(L):
      table.append(DeviceInfo(p, l, p * L + l, plat, h, dkind))
  return tuple(table)
