"""Run on every rank of a test job: init mpijax, check collectives, report what the rank saw.

Usage: python rank_report.py OUTDIR   (writes OUTDIR/rank-<rank>.json)

Used by test_slurm.py and test_multihost.py. The report holds the Topology
mpijax built from the launcher's environment, sums across ranks computed by
mpijax's own transport (``mpijax.ops.allreduce`` eagerly and inside
``jax.jit``, and ``mpijax.lax.psum`` under ``mpijax.pmap``; there is no
fallback: if the extension does not load, the rank fails), and the
SLURM_*/PMIX_* variables the rank saw, and its JAX_* and XLA_FLAGS. Rank 0 then draws a progress bar
(``mpijax.train.progress``) under the launcher.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import jax
import jax.numpy as jnp
import numpy as np

import mpijax
import mpijax.lax
import mpijax.ops
import mpijax.train


def sums(rank: int) -> dict[str, float]:
  """The sum of ``rank + 1`` over all ranks, by each of mpijax's paths."""
  x = jnp.full((1,), rank + 1, jnp.float32)
  L = mpijax.local_device_count()
  psum = mpijax.pmap(lambda v: mpijax.lax.psum(v, "i"), axis_name="i")
  return {
      "mpijax.ops.allreduce": float(np.asarray(mpijax.ops.allreduce(x, op="sum"))[0]),
      "jit(mpijax.ops.allreduce)": float(np.asarray(jax.jit(mpijax.ops.allreduce)(x))[0]),
      # Every local device holds rank + 1: the psum counts each rank L times.
      "mpijax.lax.psum": float(np.asarray(psum(jnp.broadcast_to(x, (L, 1))))[0, 0]) / L,
  }


def main(outdir: str) -> None:
  # JAX's and XLA's settings as the rank started (init() adds to XLA_FLAGS).
  settings = {k: v for k, v in os.environ.items() if k.startswith("JAX_") or k == "XLA_FLAGS"}
  rt = mpijax.init()
  t = rt.topology
  by = sums(t.rank)
  report = {
      "rank": t.rank, "size": t.size, "local_rank": t.local_rank, "local_size": t.local_size,
      "node_index": t.node_index, "node_count": t.node_count, "hostnames": list(t.hostnames),
      "coordinator_address": t.coordinator_address, "launcher": t.launcher,
      # Which implementation computed each sum: mpijax's transport, always.
      "sums": by, "sum": by["mpijax.ops.allreduce"],
      "gethostname": socket.gethostname(), "pid": os.getpid(),
      "slurm_env": {k: v for k, v in os.environ.items() if k.startswith("SLURM_")},
      "pmix_env": {k: v for k, v in os.environ.items() if k in ("PMIX_RANK", "PMIX_NAMESPACE")},
      "jax_env": settings,
  }
  with open(os.path.join(outdir, f"rank-{t.rank}.json"), "w") as f:
    json.dump(report, f, indent=1, sort_keys=True)
  print(f"rank {t.rank}/{t.size} local {t.local_rank}/{t.local_size} node {t.node_index}/{t.node_count} "
        f"coordinator {t.coordinator_address} launcher {t.launcher} sums {by}", flush=True)
  for _ in mpijax.train.progress(range(5), desc="rank report", unit="step"):  # rank 0's bar
    pass
  mpijax.shutdown()


if __name__ == "__main__":
  main(sys.argv[1])
