"""Prints, after mpijax.init(), this rank's CPUs and XLA's pools (tests/test_xla_pools_jobs.py).

Usage: xla_pools_job.py [--mismatched-hash]. With --mismatched-hash, init()
sees an allow-list whose entries name a libjax_common.so digest no build
has; the pools are then read with the real list. Prints one line,
"XLA_POOLS {json}": rank, cpus (this rank's affinity), pools
((num_threads, allow_spinning, spin_count) each) and report (init()'s).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from mpijax._src.xla import pools as xla_pools

verified = dict(xla_pools.VERIFIED)
if "--mismatched-hash" in sys.argv:
  xla_pools.VERIFIED = {(version, "0" * 64): layout for (version, _), layout in verified.items()}

import mpijax  # noqa: E402

rt = mpijax.init()
report = xla_pools.last
xla_pools.VERIFIED = verified
line = {
  "rank": rt.rank,
  "cpus": sorted(os.sched_getaffinity(0)),
  "pools": xla_pools.pools(),
  "report": dataclasses.asdict(report) if report is not None else None,
}
print("XLA_POOLS " + json.dumps(line), flush=True)
