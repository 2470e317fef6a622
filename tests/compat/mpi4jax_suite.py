"""Runs mpi4jax's own test suite against mpijax.compat.mpi4jax at 1, 2 and 4 ranks.

    python tests/compat/mpi4jax_suite.py                 # download, run 1, 2, 4 ranks
    python tests/compat/mpi4jax_suite.py --ranks 2 --sdist mpi4jax-0.9.1.post2.tar.gz

Takes the tests and examples of mpi4jax's source distribution (downloaded with
``pip download --no-binary :all: --no-deps``, or given; either way its sha256
must be the one pinned in mpi4jax_deviations.py, and a cached download with
another is downloaded again), and runs them under ``mpijax-run`` with mpijax's
shim first on PYTHONPATH (``mpijax.compat.shim``, installed with mpijax) in
which ``import mpi4jax`` is ``mpijax.compat.mpi4jax``. The tests listed in
mpi4jax_deviations.py are left out, each with its reason; every other test
must pass on every rank, except the ones the suite itself skips at that rank
and rank count (:func:`expected_skips`): a skip more or less is a failure.
Each job is bounded by a timeout. Exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

from mpi4jax_deviations import DEVIATIONS  # noqa: E402
from mpi4jax_deviations import MPI4JAX_SDIST_SHA256  # noqa: E402
from mpi4jax_deviations import MPI4JAX_VERSION  # noqa: E402


def sha256_of(path: Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def download(version: str, dest: Path, sha256: str) -> Path:
  """mpi4jax's sdist, from the package registry through pip, with the sha256 ``sha256``.

  A copy cached in ``dest`` is used when its hash is right, else downloaded
  again; a download with another hash is an error (nothing of it runs).
  """
  name = f"mpi4jax-{version}.tar.gz"
  cached = dest / name
  if cached.is_file():
    got = sha256_of(cached)
    if got == sha256:
      return cached
    print(
      f"mpi4jax_suite: the cached {cached} has sha256 {got}, not {sha256}: downloading it again",
      flush=True,
    )
    cached.unlink()
  fresh = Path(tempfile.mkdtemp(prefix="download-", dir=dest))
  try:
    # --no-build-isolation: pip reads the sdist's metadata with this environment's
    # setuptools and wheel instead of installing mpi4jax's build requirements.
    cmd = [
      sys.executable,
      "-m",
      "pip",
      "download",
      "--no-binary",
      ":all:",
      "--no-deps",
      "--no-build-isolation",
      "--no-cache-dir",
      "-q",
      "-d",
      str(fresh),
      f"mpi4jax=={version}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    got_file = fresh / name
    if proc.returncode != 0 or not got_file.is_file():
      sys.exit(
        f"mpi4jax_suite: could not download mpi4jax {version}: {' '.join(cmd)}\n"
        f"{proc.stdout[-2000:]}{proc.stderr[-3000:]}\nGive a local copy with --sdist."
      )
    got = sha256_of(got_file)
    if got != sha256:
      sys.exit(
        f"mpi4jax_suite: the registry gave {name} with sha256 {got}, not the pinned {sha256} "
        "(tests/compat/mpi4jax_deviations.py); not running it. Check the file's origin "
        "(pip's index settings), or pass --sha256 with the hash the release publishes."
      )
    os.replace(got_file, cached)
  finally:
    shutil.rmtree(fresh, ignore_errors=True)
  return cached


def checked_sdist(path: Path, sha256: str) -> Path:
  """A local sdist (--sdist), if its hash is ``sha256``; else exits naming both hashes."""
  if not path.is_file():
    sys.exit(f"mpi4jax_suite: --sdist {path}: no such file")
  got = sha256_of(path)
  if got != sha256:
    sys.exit(
      f"mpi4jax_suite: --sdist {path} has sha256 {got}, not {sha256}; give mpi4jax "
      f"{MPI4JAX_VERSION}'s sdist as PyPI publishes it, or pass --sha256 {got} (and --version) "
      "for another release"
    )
  return path


def unpack(sdist: Path, dest: Path) -> Path:
  """The sdist's tests/, examples/ and pyproject.toml, without the mpi4jax package."""
  suite = dest / "suite"
  shutil.rmtree(suite, ignore_errors=True)
  suite.mkdir(parents=True)
  with tarfile.open(sdist) as tar:
    for member in tar.getmembers():
      parts = Path(member.name).parts
      if len(parts) < 2 or parts[1] not in ("tests", "examples", "pyproject.toml"):
        continue
      if not (member.isfile() or member.isdir()):
        continue
      target = suite.joinpath(*parts[1:])
      if member.isdir():
        target.mkdir(parents=True, exist_ok=True)
        continue
      target.parent.mkdir(parents=True, exist_ok=True)
      with tar.extractfile(member) as src, open(target, "wb") as out:
        out.write(src.read())
  if not (suite / "tests").is_dir():
    sys.exit(f"mpi4jax_suite: {sdist} has no tests/ directory")
  return suite


def _shim_dir() -> str:
  """The installed shim's directory, as a user finds it (``python -m mpijax.compat.shim``)."""
  out = subprocess.run(
    [sys.executable, "-m", "mpijax.compat.shim"],
    capture_output=True,
    text=True,
    timeout=120,
    check=True,
  )
  return out.stdout.strip()


def run(ranks: int, suite: Path, timeout: float, results: Path) -> tuple[int, str, float]:
  """One mpijax-run job of the suite; (exit code, output, seconds)."""
  shutil.rmtree(results, ignore_errors=True)
  results.mkdir(parents=True)
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
    [_shim_dir(), str(HERE)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
  )
  env.update(
    MPIJAX_TEST_SUITE_RESULTS=str(results),
    JAX_PLATFORMS="cpu",
    MPIJAX_TIMEOUT=env.get("MPIJAX_TIMEOUT", "120"),
    MPIJAX_DEVICES_PER_PROCESS="1",
  )
  cmd = [
    sys.executable,
    "-m",
    "mpijax.launch",
    "-n",
    str(ranks),
    "--timeout",
    str(int(timeout)),
    "--no-wrap",
    "--",
    sys.executable,
    "-m",
    "pytest",
    "-q",
    "-p",
    "no:cacheprovider",
    "-p",
    "no:pytest_mpi",
    "-p",
    "mpi4jax_suite_plugin",
    "--color=no",
    "-rfE",
    "-W",
    "ignore::DeprecationWarning",
    "tests",
  ]
  start = time.monotonic()
  proc = subprocess.Popen(
    cmd,
    cwd=suite,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    start_new_session=True,
  )
  try:
    out, _ = proc.communicate(timeout=timeout + 60)
  except subprocess.TimeoutExpired:
    proc.terminate()  # mpijax-run stops every rank
    try:
      out, _ = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, 9)
      out, _ = proc.communicate()
    out += f"\n[mpi4jax_suite] killed after {timeout:.0f} s\n"
  return proc.returncode, out, time.monotonic() - start


# The tests mpi4jax's suite skips itself, by its own conditions (test ids as in
# mpi4jax_deviations.py: a file::test covers its parametrizations).
_SEND_RECV = "tests/collective_ops/test_send_and_recv.py::"
_SENDRECV = "tests/collective_ops/test_sendrecv.py::"
# "need at least 2 processes to test send/recv"
NEED_TWO_RANKS = {
  _SEND_RECV + t
  for t in (
    "test_send_recv",
    "test_send_recv_jit",
    "test_send_recv_scalar",
    "test_send_recv_scalar_jit",
    "test_send_recv_status",
    "test_send_recv_status_jit",
  )
}
# "Runs only on rank 0 and 1" (of two ranks or more)
ON_RANKS_0_AND_1 = {_SEND_RECV + "test_send_recv_deadlock"} | {
  _SENDRECV + t
  for t in (
    "test_sendrecv",
    "test_sendrecv_grad",
    "test_sendrecv_grad_2",
    "test_sendrecv_jacrev",
    "test_sendrecv_jit",
    "test_sendrecv_scalar",
    "test_sendrecv_scalar_jit",
    "test_sendrecv_status",
    "test_sendrecv_status_jit",
    "test_sendrecv_vmap",
  )
}
# "Runs only on rank 0", "Only runs on root process"
ON_RANK_0 = {
  "tests/collective_ops/test_common.py::test_deadlock_on_exit",
  "tests/collective_ops/test_scatter.py::test_scatter_wrong_size",
}


def expected_skips(rank: int, ranks: int) -> set[str]:
  """The tests mpi4jax's suite skips on ``rank`` of a ``ranks``-rank job."""
  skips = set()
  if ranks < 2:
    skips |= NEED_TWO_RANKS
  if ranks < 2 or rank > 1:
    skips |= ON_RANKS_0_AND_1
  if rank != 0:
    skips |= ON_RANK_0
  return skips


def _covers(test_id: str, nodeid: str) -> bool:
  return nodeid == test_id or nodeid.startswith(test_id + "[")


def skip_problems(rank: int, ranks: int, skipped: set[str]) -> list[str]:
  """Skips of ``rank`` that mpi4jax's suite would not make, and the expected ones missing."""
  expected = expected_skips(rank, ranks)
  extra = sorted(n for n in skipped if not any(_covers(t, n) for t in expected))
  missing = sorted(t for t in expected if not any(_covers(t, n) for n in skipped))
  return [
    f"rank {rank}: skipped, but mpi4jax's suite runs it at {ranks} ranks: {n}" for n in extra
  ] + [f"rank {rank}: ran, but mpi4jax's suite skips it at {ranks} ranks: {t}" for t in missing]


def check(ranks: int, code: int, results: Path) -> tuple[list[str], list[str]]:
  """Problems found in one job's per-rank results, and each rank's counts."""
  problems, counts = [], []
  files = sorted(results.glob("rank-*.json"), key=lambda f: int(f.stem.split("-")[1]))
  if len(files) != ranks:
    problems.append(f"{len(files)} of {ranks} ranks wrote results (exit {code})")
  for f in files:
    data = json.loads(f.read_text())
    rank = int(f.stem.split("-")[1])
    mine: dict[str, int] = {}
    for nodeid, entry in sorted(data["outcomes"].items()):
      mine[entry["outcome"]] = mine.get(entry["outcome"], 0) + 1
      if entry["outcome"] in ("failed", "error"):
        problems.append(f"{f.stem}: {entry['outcome']} {nodeid}\n{entry['detail']}")
    if not mine.get("passed"):
      problems.append(f"{f.stem}: no test passed")
    skipped = {n for n, e in data["outcomes"].items() if e["outcome"] == "skipped"}
    problems += skip_problems(rank, ranks, skipped)
    counts.append(
      f"{f.stem.replace('-', ' ')} " + ", ".join(f"{v} {k}" for k, v in sorted(mine.items()))
    )
  if code != 0 and not problems:
    problems.append(f"the job exited {code}")
  return problems, counts


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--ranks", default="1,2,4", help="rank counts, e.g. 1,2,4")
  ap.add_argument("--version", default=MPI4JAX_VERSION, help="mpi4jax release to download")
  ap.add_argument(
    "--sha256",
    help=f"the sdist's sha256 (default: the pinned one of {MPI4JAX_VERSION}; needed with "
    "another --version)",
  )
  ap.add_argument("--sdist", type=Path, help="a local mpi4jax sdist instead of downloading")
  ap.add_argument(
    "--workdir", type=Path, default=Path(tempfile.gettempdir()) / "mpijax-mpi4jax-suite"
  )
  ap.add_argument("--timeout", type=float, default=420, help="seconds per job")
  args = ap.parse_args(argv)

  sha256 = args.sha256 or (MPI4JAX_SDIST_SHA256 if args.version == MPI4JAX_VERSION else None)
  if sha256 is None:
    ap.error(
      f"--version {args.version}: no sha256 is pinned for it (only for {MPI4JAX_VERSION}); "
      "pass --sha256 with the hash PyPI publishes for its sdist"
    )
  args.workdir.mkdir(parents=True, exist_ok=True)
  if args.sdist:
    sdist = checked_sdist(args.sdist, sha256)
  else:
    sdist = download(args.version, args.workdir, sha256)
  suite = unpack(sdist, args.workdir)
  print(
    f"mpi4jax's suite from {sdist.name}: every test but the {len(DEVIATIONS)} "
    "deviations of tests/compat/mpi4jax_deviations.py, which are left out",
    flush=True,
  )
  failed = False
  for ranks in (int(r) for r in args.ranks.split(",")):
    results = args.workdir / f"results-{ranks}"
    code, out, seconds = run(ranks, suite, args.timeout, results)
    problems, counts = check(ranks, code, results)
    print(
      f"{ranks} rank{'s' if ranks > 1 else ''}: {'FAIL' if problems else 'ok'} in "
      f"{seconds:.0f} s ({'; '.join(counts)})",
      flush=True,
    )
    if problems:
      failed = True
      print("\n".join(problems) + "\n--- job output (tail) ---\n" + out[-6000:], flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
