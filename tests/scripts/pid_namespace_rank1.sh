#!/bin/sh
# Runs the command; on rank 1 in a PID namespace of its own, as when each rank
# runs in its own container: its process id names another process (or none)
# for the other ranks. Needs root (unshare --pid).
rank="${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-${SLURM_PROCID:-0}}}"
if [ "$rank" = 1 ]; then
  exec unshare --pid --fork "$@"
fi
exec "$@"
