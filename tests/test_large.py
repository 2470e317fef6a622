"""Messages over 2**31 bytes, for real. Slow and memory-hungry (~7 GB
per rank, 2 ranks): runs only with MPIJAX_TEST_SLOW=1. The chunking logic
itself is tested at every run with tiny chunks (tests/mpi/test_ops.py)."""

from __future__ import annotations

import os
import sys

import pytest

from tests._launch import REPO
from tests._launch import run_mpi
from tests._launch import tail

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("MPIJAX_TEST_SLOW") != "1",
                       reason="> 2 GiB messages: set MPIJAX_TEST_SLOW=1"),
]


def test_messages_over_2_gib():
  result, seconds = run_mpi(2, [sys.executable, str(REPO / "tests" / "scripts" / "large_messages.py")],
                            timeout=900)
  assert result.returncode == 0, tail(result.stdout)
  assert result.stdout.count("LARGE ok") == 2, tail(result.stdout)
  print(f"\n> 2 GiB allreduce/bcast/allgather on 2 ranks: {seconds:.0f}s")
