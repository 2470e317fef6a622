"""A single process: no launcher, no MPI needed. Always present, asked last."""

from __future__ import annotations

from mpijax._src.cluster import base


class SingleEnv(base.ClusterEnv):
  """``python script.py`` without any launcher."""

  name = "single"
  env_hint = "always"

  @classmethod
  def is_env_present(cls) -> bool:
    return True

  @classmethod
  def get_process_id(cls) -> int | None:
    return 0

  @classmethod
  def get_process_count(cls) -> int | None:
    return 1

  @classmethod
  def get_local_process_id(cls) -> int | None:
    return 0

  @classmethod
  def get_local_process_count(cls) -> int | None:
    return 1

  @classmethod
  def get_node_index(cls) -> int | None:
    return 0

  @classmethod
  def get_node_count(cls) -> int | None:
    return 1
