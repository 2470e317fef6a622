#!/bin/bash
# One rank per GPU, each rank bound to its GPU by local rank.
#
# Use this on GPU machines launched with mpirun (not Slurm; for Slurm see
# slurm/gpu-per-task.sbatch): start as many ranks per node as it has GPUs, and
# this wrapper makes rank i of a node see only GPU i, so every JAX process
# owns exactly one device.
#
#   mpijax-run -n 8 --hosts node1:4,node2:4 --rank-wrapper recipes/gpu-per-rank.sh -- python train.py
#   mpijax-run -n 4 --rank-wrapper recipes/gpu-per-rank.sh -- python train.py   # one node, 4 GPUs
#
# (--rank-wrapper keeps mpijax-run's `python -m mpijax` abort-on-exception
# wrapper on the program; with plain mpirun write it yourself:
#  mpirun -n 4 recipes/gpu-per-rank.sh python -m mpijax train.py)
#
# Variables: GPUS_PER_NODE (default: count from nvidia-smi, else 1),
# GPU_VISIBLE_VAR (CUDA_VISIBLE_DEVICES, or ROCR_VISIBLE_DEVICES for AMD).
set -euo pipefail
# Local rank from whichever launcher started us (Open MPI, MPICH/Hydra, Slurm).
local_rank=${OMPI_COMM_WORLD_LOCAL_RANK:-${MPI_LOCALRANKID:-${SLURM_LOCALID:-${PMI_LOCAL_RANK:-0}}}}
if [ -z "${GPUS_PER_NODE:-}" ]; then
  GPUS_PER_NODE=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [ "${GPUS_PER_NODE:-0}" -ge 1 ] || GPUS_PER_NODE=1
fi
GPU_VISIBLE_VAR=${GPU_VISIBLE_VAR:-CUDA_VISIBLE_DEVICES}
export "$GPU_VISIBLE_VAR"=$(( local_rank % GPUS_PER_NODE ))
# JAX should not grab every GPU's memory up front when ranks share a node's host memory budget.
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
exec "$@"
