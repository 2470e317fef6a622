#!/bin/bash
# Multi-host run with a hostfile: ranks spread over several machines reached by ssh.
#
# Use this on machines without a scheduler (or an allocation you got some other
# way) where you can ssh between nodes without a password and the same Python
# environment (same path) exists on every node.
#
#   cat > hosts.txt <<HOSTS
#   node1 slots=4
#   node2 slots=4
#   HOSTS
#   HOSTFILE=hosts.txt NP=8 recipes/multi-host.sh python train.py
#
# Variables: HOSTFILE (Open MPI "host slots=N" or MPICH "host:N" lines),
# NP (ranks, default: sum of the slots), DEVICES_PER_PROCESS (default 1),
# IFACE (network interface or CIDR to use for MPI and wire-up, e.g. eth0 or
# 10.0.0.0/16; default: let MPI choose), TIMEOUT (seconds), LOG_DIR (one log per
# rank, written on this machine), MAX_RESTARTS (relaunch after a failure this
# many times), MIN_RANKS (with MAX_RESTARTS: before a restart, drop the hosts
# that cannot start a process and go on while at least this many ranks fit),
# PYTHON.
set -euo pipefail
: "${HOSTFILE:?set HOSTFILE to a hostfile, e.g. HOSTFILE=hosts.txt}"
PYTHON=${PYTHON:-python}
DEVICES_PER_PROCESS=${DEVICES_PER_PROCESS:-1}
if [ -z "${NP:-}" ]; then
  NP=$(awk '!/^[[:space:]]*(#|$)/ { n = 1; if (match($0, /slots=[0-9]+/)) n = substr($0, RSTART + 6, RLENGTH - 6);
           else if (match($1, /:[0-9]+$/)) n = substr($1, RSTART + 1); s += n } END { print s }' "$HOSTFILE")
fi
args=(-n "$NP" --hostfile "$HOSTFILE" --devices-per-process "$DEVICES_PER_PROCESS")
[ -n "${TIMEOUT:-}" ] && args+=(--timeout "$TIMEOUT")
[ -n "${LOG_DIR:-}" ] && args+=(--log-dir "$LOG_DIR")
[ -n "${MAX_RESTARTS:-}" ] && args+=(--max-restarts "$MAX_RESTARTS")
[ -n "${MIN_RANKS:-}" ] && args+=(--min-ranks "$MIN_RANKS")
if [ -n "${IFACE:-}" ]; then
  # Open MPI: keep runtime wire-up (oob) and MPI traffic (btl tcp) on one network.
  args+=(--launcher-args "--mca oob_tcp_if_include $IFACE --mca btl_tcp_if_include $IFACE")
fi
# Environment variables reach remote ranks only when exported by the launcher;
# mpijax-run forwards every MPIJAX_* variable set here.
exec "$PYTHON" -m mpijax.launch "${args[@]}" -- "$@"
