"""Run on every rank of a test job: init mpijax, check one collective, report what the rank saw.

Usage: python rank_report.py OUTDIR   (writes OUTDIR/rank-<rank>.json)

Used by test_slurm.py and test_multihost.py. The report holds the Topology
mpijax built from the launcher's environment, a sum across ranks (mpijax's
allreduce when the FFI transport is built, else mpi4py's on mpijax's
communicator), and the SLURM_*/PMIX_* variables the rank saw.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import numpy as np

import mpijax


def allreduce_sum(rt, value: float) -> tuple[float, str]:
  """Sum of ``value`` over ranks, and which implementation computed it."""
  try:
    import jax.numpy as jnp
    from mpijax import ops  # the FFI transport; may be missing in a source checkout without a build
    out = ops.allreduce(jnp.asarray([value], jnp.float32), op="sum")
    out = out[0] if isinstance(out, tuple) else out
    return float(np.asarray(out)[0]), "mpijax.ops.allreduce"
  except ImportError:
    return float(rt.comm.allreduce(value)), "mpi4py comm.allreduce"


def main(outdir: str) -> None:
  rt = mpijax.init()
  t = rt.topology
  total, how = allreduce_sum(rt, float(t.rank + 1))
  report = {
      "rank": t.rank, "size": t.size, "local_rank": t.local_rank, "local_size": t.local_size,
      "node_index": t.node_index, "node_count": t.node_count, "hostnames": list(t.hostnames),
      "coordinator_address": t.coordinator_address, "launcher": t.launcher,
      "sum": total, "sum_by": how, "gethostname": socket.gethostname(), "pid": os.getpid(),
      "slurm_env": {k: v for k, v in os.environ.items() if k.startswith("SLURM_")},
      "pmix_env": {k: v for k, v in os.environ.items() if k in ("PMIX_RANK", "PMIX_NAMESPACE")},
  }
  with open(os.path.join(outdir, f"rank-{t.rank}.json"), "w") as f:
    json.dump(report, f, indent=1, sort_keys=True)
  print(f"rank {t.rank}/{t.size} local {t.local_rank}/{t.local_size} node {t.node_index}/{t.node_count} "
        f"coordinator {t.coordinator_address} launcher {t.launcher} sum {total} ({how})", flush=True)
  mpijax.shutdown()


if __name__ == "__main__":
  main(sys.argv[1])
