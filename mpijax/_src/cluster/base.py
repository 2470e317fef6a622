"""The launcher registry: who am I, according to whoever started this process.

Every launcher (Open MPI's mpirun, Slurm's srun, MPICH's mpiexec, ...) tells
the processes it starts their rank, the job size and their place on the node
through environment variables of its own. One small `ClusterEnv` subclass per
launcher reads them; subclasses register themselves when they are defined, and
`detect()` asks them in registration order, so a more specific launcher (Open
MPI started inside a Slurm allocation) is asked before a more general one.

Nothing here initializes MPI, except the `mpi` fallback detector when it is the
one chosen (it asks ``MPI.COMM_WORLD``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import ClassVar

_REGISTRY: list[type[ClusterEnv]] = []

# The keyword arguments of detect() that may override the environment.
_INT_FIELDS = ("rank", "size", "local_rank", "local_size", "node_index", "node_count")
_EXPLICIT_FIELDS = (*_INT_FIELDS, "hostnames")


class ClusterEnv:
  """Reads one launcher's environment. Subclasses register on definition.

  A subclass sets `name` and `env_hint`, names in `env_vars` the variables
  that hold its integer fields, and overrides the classmethods it answers some
  other way; a field it says nothing about is None ("this launcher does not
  say").
  """

  name: ClassVar[str]
  # What is_env_present() looks for, for error messages.
  env_hint: ClassVar[str] = ""
  # Integer field (rank, size, local_rank, local_size, node_index, node_count)
  # -> the variable holding it, or a tuple of variables of which the first one
  # set is read. The default getters read these with `env_int`.
  env_vars: ClassVar[Mapping[str, str | tuple[str, ...]]] = {}

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    if not isinstance(cls.__dict__.get("name"), str):
      raise TypeError(f"{cls.__qualname__} must set a class attribute `name` (a str)")
    unknown = sorted(set(cls.env_vars) - set(_INT_FIELDS))
    if unknown:
      raise TypeError(f"{cls.__qualname__}.env_vars names unknown field(s) {unknown}; "
                      f"the integer fields are {list(_INT_FIELDS)}")
    taken = [c for c in _REGISTRY if c.name == cls.name]
    if taken:
      raise ValueError(f"launcher name {cls.name!r} of {cls.__qualname__} is already "
                       f"registered by {taken[0].__qualname__}")
    _REGISTRY.append(cls)

  @classmethod
  def is_env_present(cls) -> bool:
    """True when this process was started by this launcher."""
    raise NotImplementedError

  @classmethod
  def env_field(cls, field: str) -> int | None:
    """The integer `field` read from the variable(s) `env_vars` names for it.

    None when `env_vars` names none, or none of them is set.

    Raises:
      ValueError: from `env_int`, when the variable read is malformed.
    """
    names = cls.env_vars.get(field)
    var = env_first(*names) if isinstance(names, tuple) else names
    return None if var is None else env_int(var)

  @classmethod
  def get_process_id(cls) -> int | None:
    return cls.env_field("rank")

  @classmethod
  def get_process_count(cls) -> int | None:
    return cls.env_field("size")

  @classmethod
  def get_local_process_id(cls) -> int | None:
    return cls.env_field("local_rank")

  @classmethod
  def get_local_process_count(cls) -> int | None:
    return cls.env_field("local_size")

  @classmethod
  def get_node_index(cls) -> int | None:
    return cls.env_field("node_index")

  @classmethod
  def get_node_count(cls) -> int | None:
    return cls.env_field("node_count")

  @classmethod
  def get_hostnames(cls) -> tuple[str, ...] | None:
    return None


@dataclasses.dataclass(frozen=True)
class LaunchInfo:
  """What the launcher (and explicit arguments) say about this process.

  Attributes:
    launcher: name of the detector that was used, e.g. ``"slurm"``.
    rank: this process's index in the job (``COMM_WORLD`` rank).
    size: number of processes in the job.
    local_rank: index among the job's processes on this node.
    local_size: number of the job's processes on this node.
    node_index: index of this node among the job's nodes.
    node_count: number of nodes of the job.
    hostnames: the job's node names in node order, when the launcher says.

  Every field but `launcher` is None when the launcher does not say.
  """
  launcher: str
  rank: int | None
  size: int | None
  local_rank: int | None
  local_size: int | None
  node_index: int | None
  node_count: int | None
  hostnames: tuple[str, ...] | None


def registered() -> list[type[ClusterEnv]]:
  """The detectors in detection (registration) order."""
  return list(_REGISTRY)


def _lookup(launcher: str) -> type[ClusterEnv]:
  for cls in _REGISTRY:
    if cls.name == launcher:
      return cls
  names = ", ".join(repr(c.name) for c in _REGISTRY)
  raise ValueError(f"unknown launcher {launcher!r}; known launchers are {names}. "
                   "Pass one of them (or None to detect it from the environment).")


def detect(launcher: str | None = None, **explicit) -> LaunchInfo:
  """Finds out this process's place in the job from its launcher.

  Args:
    launcher: name of a registered detector to use (see `registered()`), or
      None to use the first one, in registration order, whose environment is
      present.
    **explicit: any of ``rank``, ``size``, ``local_rank``, ``local_size``,
      ``node_index``, ``node_count``, ``hostnames``. A value that is not None
      replaces what the environment says.

  Returns:
    A `LaunchInfo`.

  Raises:
    ValueError: unknown launcher name; a requested launcher whose environment
      is absent; a launcher variable that is set but malformed; values that
      contradict each other (e.g. rank >= size).
    TypeError: an unknown keyword argument.

  Examples:
    >>> info = detect()  # doctest: +SKIP
    >>> info.launcher, info.rank, info.size  # doctest: +SKIP
    ('slurm', 3, 4)
    >>> detect("single", rank=0).size
    1
  """
  unknown = sorted(set(explicit) - set(_EXPLICIT_FIELDS))
  if unknown:
    raise TypeError(f"detect() got unknown keyword argument(s) {unknown}; "
                    f"the ones that override the environment are {list(_EXPLICIT_FIELDS)}")
  if launcher is None:
    cls = next((c for c in _REGISTRY if c.is_env_present()), None)
    if cls is None:  # Only without the always-present "single" detector.
      raise RuntimeError("no launcher detector found this process's environment; "
                         f"registered: {[c.name for c in _REGISTRY]}")
  else:
    cls = _lookup(launcher)
    if not cls.is_env_present():
      raise ValueError(f"launcher {launcher!r} was requested, but this process was not "
                       f"started by it ({cls.env_hint}). Start the job with that launcher, "
                       "or pass launcher=None to detect it.")

  # Only ask the environment for what the caller did not give: a malformed
  # variable the caller overrides is not an error.
  getters = {
      "rank": cls.get_process_id,
      "size": cls.get_process_count,
      "local_rank": cls.get_local_process_id,
      "local_size": cls.get_local_process_count,
      "node_index": cls.get_node_index,
      "node_count": cls.get_node_count,
      "hostnames": cls.get_hostnames,
  }
  values = {}
  for field, getter in getters.items():
    given = explicit.get(field)
    if given is not None:
      if field == "hostnames":
        given = tuple(given)
        if not all(isinstance(h, str) and h for h in given):
          raise ValueError(f"hostnames={given!r}: expected non-empty host name strings")
      elif isinstance(given, bool) or not isinstance(given, int):
        raise ValueError(f"{field}={given!r}: expected an int")
      values[field] = given
    else:
      values[field] = getter()
  info = LaunchInfo(launcher=cls.name, **values)
  _check_consistent(info, explicit)
  return info


def _check_consistent(info: LaunchInfo, explicit: dict) -> None:
  """Rejects values that contradict each other, naming where each came from."""

  def describe(field: str) -> str:
    src = "argument" if explicit.get(field) is not None else f"{info.launcher} environment"
    return f"{field}={getattr(info, field)} ({src})"

  for field, minimum in (("rank", 0), ("size", 1), ("local_rank", 0),
                         ("local_size", 1), ("node_index", 0), ("node_count", 1)):
    value = getattr(info, field)
    if value is not None and value < minimum:
      raise ValueError(f"{describe(field)} must be >= {minimum}")
  for index, count in (("rank", "size"), ("local_rank", "local_size"),
                       ("node_index", "node_count")):
    i, n = getattr(info, index), getattr(info, count)
    if i is not None and n is not None and i >= n:
      raise ValueError(f"{describe(index)} must be smaller than {describe(count)}; "
                       "pass consistent values or unset the overriding ones")
  if info.local_size is not None and info.size is not None and info.local_size > info.size:
    raise ValueError(f"{describe('local_size')} cannot exceed {describe('size')}")
  if info.hostnames is not None and info.node_count is not None:
    if len(info.hostnames) != info.node_count:
      raise ValueError(f"{len(info.hostnames)} hostnames {info.hostnames} but "
                       f"{describe('node_count')}")


# --- helpers for the detector modules ----------------------------------------


def env_int(var: str) -> int | None:
  """The integer value of environment variable `var`; None when it is unset.

  Raises:
    ValueError: naming the variable and its value, when it is set but not a
      non-negative integer.
  """
  text = os.environ.get(var)
  if text is None:
    return None
  stripped = text.strip()
  if not stripped.isdecimal():
    raise ValueError(f"environment variable {var}={text!r} is not a non-negative integer. "
                     f"It is normally set by the launcher: unset it ({var}) or set it to "
                     "this process's value, or pass the value explicitly to mpijax.init().")
  return int(stripped)


def env_present(*variables: str) -> bool:
  """True when every one of `variables` is set (to anything)."""
  return all(v in os.environ for v in variables)


def env_first(*variables: str) -> str | None:
  """The first of `variables` that is set, or None."""
  return next((v for v in variables if v in os.environ), None)
