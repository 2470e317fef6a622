"""``mpijax-run -n 4 --doctor`` on this machine: a healthy setup passes; injected faults fail.

The faults, in one job of 2 ranks: a compile cache directory that cannot be written
(its parent is a file, which root cannot write through either), a
``/dev/shm`` too small for what ``MPIJAX_DOCTOR_SHM_BYTES`` asks, and Open
MPI's traffic within the node forced onto TCP (``--mca btl tcp,self``). Each
is one FAIL line that names the fix; the doctor exits 3.
"""

from __future__ import annotations

import re
import subprocess
import sys

from tests._launch import REPO
from tests._launch import _bounded
from tests._launch import tail


def _doctor(*args: str, np: int = 4, env: dict[str, str] | None = None, timeout: float = 240):
  import os

  full_env = {k: v for k, v in os.environ.items() if not k.startswith("MPIJAX_")}
  full_env.update(env or {})
  cmd = [sys.executable, "-m", "mpijax.launch", "-n", str(np), *args, "--doctor"]
  return _bounded(cmd, full_env, REPO, timeout)


def _fails(out: str) -> list[str]:
  return re.findall(r"^\[rank0\]:   FAIL  (.*)$", out, re.M)


def test_the_doctor_passes_a_healthy_four_rank_job():
  result, seconds = _doctor()
  out = result.stdout
  assert result.returncode == 0, tail(out)
  assert "[rank0]: mpijax doctor: 4 ranks on 1 node" in out, tail(out)
  assert not _fails(out), tail(out)
  for topic in (
    "launcher",
    "MPI",
    "devices",
    "/dev/shm",
    "compile cache",
    "JAX",
    "XLA",
    "cross-memory attach",
  ):
    assert re.search(rf"^\[rank0\]:   ok    {re.escape(topic)}: ", out, re.M), (topic, tail(out))
  assert re.search(
    r"ok    all-reduce within \S+: latency [\d.]+ .s at 8 B \(raw MPI [\d.]+ .s\); "
    r"bandwidth [\d.]+ [GMk]B/s at 4 MiB, \d+% of raw MPI's",
    out,
  ), tail(out)
  # The sweep's table: each size, the path mpijax's all-reduce took.
  assert re.search(r"^\[rank0\]:\s+8 B\s+[\d.]+ .s\s+shm ", out, re.M), tail(out)
  assert re.search(r"^\[rank0\]:\s+4 MiB\s+[\d.]+ [mµ]?s\s+CMA ", out, re.M), tail(out)
  assert re.search(r"mpijax doctor: 0 failed, \d warnings?, \d+ ok", out), tail(out)
  assert "straggler" not in out, tail(out)  # the job's report, not the doctor's
  print(f"mpijax-run -n 4 --doctor: {seconds:.1f} s\n{out}")


def test_injected_faults_each_fail_with_one_line_naming_the_fix(tmp_path):
  blocker = tmp_path / "a-file"
  blocker.write_text("")
  cache = blocker / "cache"  # its parent is a file: no one can make it a directory
  # 2 ranks and a sweep of two sizes: the faults need no more, and the job is shorter.
  result, seconds = _doctor(
    "--launcher-args",
    "--mca btl tcp,self",
    np=2,
    env={
      "MPIJAX_COMPILE_CACHE": str(cache),
      "MPIJAX_DOCTOR_SHM_BYTES": str(1 << 50),
      "MPIJAX_DOCTOR_SIZES": "8,4MiB",
    },
  )
  out = result.stdout
  assert result.returncode == 3, tail(out)
  fails = _fails(out)
  assert len(fails) == 3, tail(out)
  cache_line = next(f for f in fails if f.startswith("compile cache: "))
  assert cache_line.startswith(
    f"compile cache: {cache}/mpijax cannot be written on ranks 0-1 (NotADirectoryError"
  ), cache_line
  assert cache_line.endswith(
    "fix: point MPIJAX_COMPILE_CACHE (or JAX_COMPILATION_CACHE_DIR) at a "
    "writable directory, or MPIJAX_COMPILE_CACHE=off"
  ), cache_line
  shm_line = next(f for f in fails if f.startswith("/dev/shm: "))
  assert re.match(
    r"/dev/shm: \S+ has [\d.]+ [GMK]iB for the job \([\d.]+ [GMK]iB free of "
    r"[\d.]+ [GMK]iB\), less than the 1048576 GiB needed "
    r"\(MPIJAX_DOCTOR_SHM_BYTES\); fix: a larger /dev/shm",
    shm_line,
  ), shm_line
  tcp_line = next(f for f in fails if f.startswith("MPI in a node: "))
  assert (
    "falls back to TCP where shared memory should serve (OMPI_MCA_btl=tcp,self; ranks 0-1 "
    "map no Open MPI shared-memory segment of their node)"
  ) in tcp_line, tcp_line
  assert tcp_line.endswith(
    "fix: let Open MPI use its sm btl (drop --mca btl tcp,self; --mca btl sm,tcp,self)"
  ), tcp_line
  assert "mpijax doctor: 3 failed" in out, tail(out)
  # The doctor's report is the verdict: mpijax-run adds no summary of a failed attempt.
  assert "mpijax-run: attempt 0" not in out, tail(out)
  left = subprocess.run(["pgrep", "-af", "mpijax doctor"], capture_output=True, text=True).stdout
  assert "python" not in left, left
  print(f"mpijax-run -n 2 --doctor with three faults: {seconds:.1f} s")
