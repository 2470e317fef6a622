"""Slurm: processes started by ``srun`` (a job step).

Only a job step is a launch. A login shell inside ``salloc``, or an ``sbatch``
batch script, carries the allocation's ``SLURM_JOB_ID``, ``SLURM_NTASKS`` and
even ``SLURM_PROCID=0`` (batch step) without being one of the job's tasks, so
detection also requires the step variables that only ``srun`` sets. Step
variables win over job variables: a step may use part of the allocation.
"""

from __future__ import annotations

import os
import re

from mpijax._src.cluster import base
from mpijax._src.cluster.hostlist import expand_hostlist

_PROCID = "SLURM_PROCID"
_LOCALID = "SLURM_LOCALID"
_NODEID = "SLURM_NODEID"
# srun sets this for the tasks of a step, never for a batch script or shell
# (SLURM_STEP_ID is not used as the marker: some versions give the batch step
# one).
_STEP_MARKER = "SLURM_STEP_NUM_TASKS"
# MPICH's mpiexec inside an allocation starts one Hydra proxy per node with
# srun; the proxy's children inherit that step's SLURM_PROCID (the proxy's
# number) but get their real rank and size from Hydra's PMI_RANK/PMI_SIZE.
_PMI_SIZE = "PMI_SIZE"
_NTASKS = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
_TASKS_PER_NODE = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
_NUM_NODES = ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
_NODELIST = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")

_TASKS_ITEM = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def parse_tasks_per_node(text: str, var: str = "SLURM_STEP_TASKS_PER_NODE") -> tuple[int, ...]:
  """Expands Slurm's tasks-per-node format: ``"2(x3),1"`` -> ``(2, 2, 2, 1)``.

  Raises:
    ValueError: naming `var` and `text` when the format is not understood.
  """
  counts: list[int] = []
  for item in text.split(","):
    match = _TASKS_ITEM.fullmatch(item.strip())
    if match is None:
      raise ValueError(f"environment variable {var}={text!r} is not in Slurm's tasks-per-node "
                       "format (like '2(x3),1'): unset it or fix it, or pass local_size to "
                       "mpijax.init().")
    counts.extend([int(match[1])] * int(match[2] or 1))
  return tuple(counts)


class SlurmEnv(base.ClusterEnv):
  """Slurm ``srun`` job step."""

  name = "slurm"
  env_hint = f"{_PROCID} and {_STEP_MARKER} set, as srun sets them"
  env_vars = {"rank": _PROCID, "size": _NTASKS, "local_rank": _LOCALID,
              "node_index": _NODEID, "node_count": _NUM_NODES}

  @classmethod
  def is_env_present(cls) -> bool:
    if not base.env_present(_PROCID, _STEP_MARKER):
      return False
    # srun's own PMI (--mpi=pmi2) sets PMI_SIZE equal to the step's task
    # count; a different one means another launcher runs inside the step.
    pmi_size = os.environ.get(_PMI_SIZE)
    return pmi_size is None or pmi_size.strip() == os.environ[_STEP_MARKER].strip()

  @classmethod
  def get_local_process_count(cls) -> int | None:
    var = base.env_first(*_TASKS_PER_NODE)
    node = cls.get_node_index()
    if var is None or node is None:
      return None
    counts = parse_tasks_per_node(os.environ[var], var)
    if node >= len(counts):
      raise ValueError(f"{_NODEID}={node} but {var}={os.environ[var]!r} lists only "
                       f"{len(counts)} node(s); the Slurm variables contradict each other "
                       "(was the environment copied from another step?).")
    return counts[node]

  @classmethod
  def get_hostnames(cls) -> tuple[str, ...] | None:
    var = base.env_first(*_NODELIST)
    if var is None:
      return None
    try:
      return expand_hostlist(os.environ[var])
    except ValueError as e:
      raise ValueError(f"environment variable {var}: {e}") from None
