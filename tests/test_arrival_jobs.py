"""A job stuck before every rank reaches ``init()``: the ranks that have not are named.

Under mpijax-run (its arrival board) every waiting rank prints the same
report, naming the late rank and where its Python is, the lowest one its
stack, and the job ends; under a plain ``mpirun`` the waiting ranks say that
they wait, and with ``MPIJAX_STALL_ACTION=warn`` the job goes on once the
late rank arrives.
"""

from __future__ import annotations

import re
import subprocess
import sys

from tests._launch import REPO
from tests._launch import assert_failed_without_hanging
from tests._launch import run_mpi
from tests._launch import tail
from tests.test_jax_runtime import _plain_mpirun

SCRIPT = str(REPO / "tests" / "scripts" / "late_init.py")


def _leftovers() -> list[str]:
  out = subprocess.run(["pgrep", "-af", SCRIPT], capture_output=True, text=True).stdout
  return [line for line in out.splitlines() if "pgrep" not in line]


def test_mpijax_run_names_the_rank_that_never_calls_init_and_where_it_is():
  result, seconds = run_mpi(4, [sys.executable, SCRIPT, "600"], timeout=120,
                            env={"MPIJAX_TIMEOUT": "5"})
  out = result.stdout
  assert_failed_without_hanging(result.returncode, out)
  assert not _leftovers(), _leftovers()
  reports = re.findall(r"^\[rank(\d)\]: (mpijax: init: .*)$", out, re.M)
  assert reports, tail(out)
  # Every rank that waited printed the same report; the last (fatal) one names rank 3.
  last = reports[-1][1]
  # (On a loaded machine another rank may still be importing then: it is named too.)
  assert re.search(r"for ranks? [\d,-]*3, which ha(s|ve) not called it", last), last
  assert re.search(r"rank 3 \(\S+, pid \d+: started [\d.]+ s ago; Python: late_init.py:\d+ in "
                   r"load_data: time.sleep\(seconds\)\)", last), last
  assert last.endswith("(MPIJAX_TIMEOUT=5 s; MPIJAX_STALL_ACTION=abort). Ending the job."), last
  fatal = {rank for rank, text in reports if text == last}
  assert len(fatal) >= 2 and "3" not in fatal, reports
  # Its stack, once, from the lowest rank that waited.
  assert re.search(rf"^\[rank{min(fatal)}\]:   rank 3 \(\S+, pid \d+\), Python main thread:$", out,
                   re.M), tail(out)
  assert re.search(r'^\[rank\d\]:     File "\S*late_init.py", line \d+, in load_data$', out,
                   re.M), tail(out)
  # mpijax-run's summary of the attempt names it too.
  assert re.search(r"mpijax-run: attempt 0: .*init: ranks? [\d,-]+ waited [\d.]+ s in "
                   r"mpijax.init\(\) for rank", out), tail(out)
  assert seconds < 100, f"took {seconds:.0f} s"


def test_under_plain_mpirun_the_waiting_ranks_say_so_and_warn_waits_for_the_late_rank():
  result = _plain_mpirun(4, [sys.executable, "-m", "mpijax", SCRIPT, "12"], timeout=150,
                         env={"MPIJAX_TIMEOUT": "3", "MPIJAX_STALL_ACTION": "warn"})
  out = result.stdout + result.stderr
  assert result.returncode == 0, tail(out)
  for r in range(4):
    assert f"rank {r} arrived: 6" in out, tail(out)
  said = re.findall(r"mpijax: init: rank (\d) waited [\d.]+ s in mpijax.init\(\) for the other "
                    r"ranks of the job \(in MPI_Init, which waits for every rank of the job\): .*"
                    r"here they are not known \(MPIJAX_TIMEOUT=3 s; MPIJAX_STALL_ACTION=warn\)\. "
                    r"Still waiting\.", out)
  assert {"0", "1", "2"} <= set(said), tail(out)
  assert not _leftovers(), _leftovers()
