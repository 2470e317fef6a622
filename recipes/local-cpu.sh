#!/bin/bash
# Local CPU run: N ranks on this machine, each with K JAX CPU devices.
#
# Use this on a laptop or a single node without a scheduler: development,
# tests, small jobs. N x K = the global device count of the job.
#
#   recipes/local-cpu.sh python train.py --epochs 3
#   NP=2 DEVICES_PER_PROCESS=2 recipes/local-cpu.sh python -m pytest --with-mpi tests/mpi
#
# Variables: NP (ranks, default 4), DEVICES_PER_PROCESS (default 1),
# TIMEOUT (seconds, kill the job after it; default none), LOG_DIR (one log per
# rank there, LOG_DIR/rank_<r>.log, and on the console too), MAX_RESTARTS
# (relaunch after a failure this many times; default 0), PYTHON.
set -euo pipefail
NP=${NP:-4}
DEVICES_PER_PROCESS=${DEVICES_PER_PROCESS:-1}
PYTHON=${PYTHON:-python}
args=(-n "$NP" --devices-per-process "$DEVICES_PER_PROCESS")
[ -n "${TIMEOUT:-}" ] && args+=(--timeout "$TIMEOUT")
[ -n "${LOG_DIR:-}" ] && args+=(--log-dir "$LOG_DIR" --tee)
[ -n "${MAX_RESTARTS:-}" ] && args+=(--max-restarts "$MAX_RESTARTS")
# mpijax-run adds --allow-run-as-root / --oversubscribe only when needed and never binds cores.
exec "$PYTHON" -m mpijax.launch "${args[@]}" -- "$@"
