"""tests/compat/mpi4jax_suite.py fails on a skip mpi4jax's suite would not make, and on
one of its own skips that did not happen, at each rank and rank count."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "compat"))
import mpi4jax_suite  # noqa: E402

ALLREDUCE = "tests/collective_ops/test_allreduce.py::test_allreduce"


@pytest.mark.parametrize("ranks,skips", [(1, [17]), (2, [0, 2]), (4, [0, 2, 13, 13])])
def test_the_pinned_skips_per_rank(ranks, skips):
  assert [len(mpi4jax_suite.expected_skips(r, ranks)) for r in range(ranks)] == skips


def _results(tmp_path, ranks, skipped_by_rank):
  for rank in range(ranks):
    outcomes = {ALLREDUCE: {"outcome": "passed", "detail": ""}}
    outcomes.update({n: {"outcome": "skipped", "detail": "x"} for n in skipped_by_rank[rank]})
    (tmp_path / f"rank-{rank}.json").write_text(json.dumps({"outcomes": outcomes}))
  return tmp_path


def test_check_accepts_exactly_the_suites_own_skips(tmp_path):
  skipped = [sorted(mpi4jax_suite.expected_skips(r, 4)) for r in range(4)]
  problems, _ = mpi4jax_suite.check(4, 0, _results(tmp_path, 4, skipped))
  assert problems == []


def test_check_fails_on_a_skip_more_or_one_fewer(tmp_path):
  skipped = [sorted(mpi4jax_suite.expected_skips(r, 4)) for r in range(4)]
  skipped[1].append(ALLREDUCE + "[float32]")  # a test the suite runs at 4 ranks
  dropped = skipped[3].pop()  # a test the suite skips on rank 3
  problems, _ = mpi4jax_suite.check(4, 0, _results(tmp_path, 4, skipped))
  assert problems == [
    f"rank 1: skipped, but mpi4jax's suite runs it at 4 ranks: {ALLREDUCE}[float32]",
    f"rank 3: ran, but mpi4jax's suite skips it at 4 ranks: {dropped}",
  ]


# --- the sdist's checksum -------------------------------------------------------------------

NAME = f"mpi4jax-{mpi4jax_suite.MPI4JAX_VERSION}.tar.gz"


def _pip_download_giving(content: bytes, calls: list):
  """In place of subprocess.run: a `pip download` that saves ``content`` as the sdist."""

  def run(cmd, **kw):
    calls.append(cmd)
    assert cmd[1:4] == ["-m", "pip", "download"], cmd
    dest = pathlib.Path(cmd[cmd.index("-d") + 1])
    (dest / NAME).write_bytes(content)
    return mpi4jax_suite.subprocess.CompletedProcess(cmd, 0, "", "")

  return run


def _sha(content: bytes) -> str:
  import hashlib

  return hashlib.sha256(content).hexdigest()


def test_a_cached_sdist_with_the_pinned_hash_is_used(tmp_path, monkeypatch):
  calls = []
  monkeypatch.setattr(mpi4jax_suite.subprocess, "run", _pip_download_giving(b"new", calls))
  (tmp_path / NAME).write_bytes(b"the release")
  got = mpi4jax_suite.download(mpi4jax_suite.MPI4JAX_VERSION, tmp_path, _sha(b"the release"))
  assert got == tmp_path / NAME and got.read_bytes() == b"the release" and calls == []


def test_a_cached_sdist_with_another_hash_is_downloaded_again(tmp_path, monkeypatch, capsys):
  calls = []
  monkeypatch.setattr(mpi4jax_suite.subprocess, "run", _pip_download_giving(b"the release", calls))
  (tmp_path / NAME).write_bytes(b"changed in the cache")
  got = mpi4jax_suite.download(mpi4jax_suite.MPI4JAX_VERSION, tmp_path, _sha(b"the release"))
  assert got.read_bytes() == b"the release" and len(calls) == 1
  assert f"has sha256 {_sha(b'changed in the cache')}, not {_sha(b'the release')}" in (
    capsys.readouterr().out
  )
  assert sorted(p.name for p in tmp_path.iterdir()) == [NAME]  # no download directory left


def test_a_download_with_another_hash_is_refused(tmp_path, monkeypatch):
  calls = []
  monkeypatch.setattr(mpi4jax_suite.subprocess, "run", _pip_download_giving(b"tampered", calls))
  with pytest.raises(SystemExit) as e:
    mpi4jax_suite.download(mpi4jax_suite.MPI4JAX_VERSION, tmp_path, _sha(b"the release"))
  assert f"the registry gave {NAME} with sha256 {_sha(b'tampered')}, not the pinned" in str(e.value)
  assert list(tmp_path.iterdir()) == []  # nothing of it kept for a later run


def test_a_local_sdist_with_another_hash_is_refused(tmp_path):
  sdist = tmp_path / NAME
  sdist.write_bytes(b"tampered")
  with pytest.raises(SystemExit) as e:
    mpi4jax_suite.checked_sdist(sdist, mpi4jax_suite.MPI4JAX_SDIST_SHA256)
  assert f"has sha256 {_sha(b'tampered')}, not {mpi4jax_suite.MPI4JAX_SDIST_SHA256}" in str(e.value)
  assert mpi4jax_suite.checked_sdist(sdist, _sha(b"tampered")) == sdist
