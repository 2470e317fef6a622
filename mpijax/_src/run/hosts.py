"""Hosts and slots: ``--hosts``, ``--hostfile`` and the cores of this machine."""

from __future__ import annotations

import os
from collections.abc import Sequence

from mpijax._src.run.common import LaunchError
from mpijax._src.run.common import Options


def local_slots() -> int:
  """Cores this process may run on, counted the way Open MPI counts slots (cores, not hwthreads)."""
  try:
    cpus = sorted(os.sched_getaffinity(0))
  except AttributeError:
    return os.cpu_count() or 1
  cores = set()
  for cpu in cpus:
    base = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
    try:
      with open(base + "core_id") as f:
        core = f.read().strip()
      with open(base + "physical_package_id") as f:
        pkg = f.read().strip()
    except OSError:
      return len(cpus) or 1
    cores.add((pkg, core))
  return max(1, len(cores))


def parse_hosts(spec: str) -> list[tuple[str, int]]:
  """``h1:2,h2:2`` -> [("h1", 2), ("h2", 2)]; a host without ``:N`` has 1 slot."""
  hosts = []
  for item in spec.split(","):
    item = item.strip()
    if not item:
      continue
    name, _, slots = item.partition(":")
    try:
      hosts.append((name, int(slots) if slots else 1))
    except ValueError:
      raise LaunchError(
        f"--hosts entry {item!r} is not HOST or HOST:SLOTS (e.g. node1:4)"
      ) from None
  if not hosts:
    raise LaunchError(f"--hosts {spec!r} names no host; write it like h1:4,h2:4")
  return hosts


def parse_hostfile(path: str) -> list[tuple[str, int]]:
  """Reads an Open MPI (``host slots=N``) or Hydra (``host:N``) hostfile.

  A host without a slot count counts as 1 slot (Open MPI would use its core
  count, which mpijax-run cannot see from here; the cost is an unneeded
  ``--oversubscribe``).
  """
  try:
    with open(path) as f:
      lines = f.read().splitlines()
  except OSError as e:
    raise LaunchError(f"cannot read --hostfile {path!r}: {e}") from None
  hosts = []
  for line in lines:
    line = line.split("#", 1)[0].strip()
    if not line:
      continue
    words = line.split()
    name, _, slots = words[0].partition(":")
    count = int(slots) if slots.isdigit() else 1
    for w in words[1:]:
      key, _, value = w.partition("=")
      if key in ("slots", "cpu") and value.isdigit():
        count = int(value)
    hosts.append((name, count))
  if not hosts:
    raise LaunchError(f"--hostfile {path!r} lists no host")
  return hosts


def hosts_of(opts: Options) -> list[tuple[str, int]] | None:
  """The hosts with slots from --hosts/--hostfile, None without either."""
  if opts.hostfile:
    return parse_hostfile(opts.hostfile)
  if opts.hosts:
    return parse_hosts(opts.hosts)
  return None


def host_list(hosts: Sequence[tuple[str, int]]) -> str:
  return ",".join(f"{h}:{s}" for h, s in hosts)
