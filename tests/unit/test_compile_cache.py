"""The compile cache's entries and claims (mpijax/_src/xla/compile_cache.py), with real
files and real processes: one compiles, the others wait and load; a dead or stopped
owner is passed over; a bad entry is recompiled; an unwritable directory is said."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import subprocess
import sys
import time

import pytest

from mpijax._src.xla import compile_cache as cc

JAXLIB = "0.10.2"
KEY = "jit_step-0123abcd"


def _owner(rank: int = 0, job: str = "job-a") -> cc.Owner:
  return cc.me(rank, job)


def _fetch(
  directory, *, compile, load=bytes.decode, waiting=cc.nothing, stale_s=cc.STALE_S, owner=None
):
  return cc.fetch(
    directory,
    KEY,
    jaxlib=JAXLIB,
    owner=owner or _owner(),
    compile=compile,
    serialize=str.encode,
    load=load,
    waiting=waiting,
    stale_s=stale_s,
  )


# --- entries ------------------------------------------------------------------------


def test_an_entry_round_trips():
  data = b"".join(cc.pack(KEY, JAXLIB, b"executable bytes", rank=3))
  payload, header = cc.unpack(data, KEY, JAXLIB)
  assert payload == b"executable bytes" and header["rank"] == 3


@pytest.mark.parametrize(
  "damage, why",
  [
    (lambda d: d[:5], "truncated to its first bytes"),
    (lambda d: d[:-3], "truncated"),
    (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "checksum"),
    (lambda d: d[:12] + b"#" + d[13:], "header is corrupt"),
  ],
)
def test_a_damaged_entry_is_refused(damage, why):
  data = b"".join(cc.pack(KEY, JAXLIB, b"x" * 4096))
  with pytest.raises(cc.EntryError, match=why):
    cc.unpack(damage(data), KEY, JAXLIB)


def test_an_entry_of_another_jaxlib_or_program_is_refused():
  data = b"".join(cc.pack(KEY, "0.9.2", b"x"))
  with pytest.raises(cc.EntryError, match=r"written by jaxlib 0\.9\.2, this is jaxlib 0\.10\.2"):
    cc.unpack(data, KEY, JAXLIB)
  data = b"".join(cc.pack("jit_other-99", JAXLIB, b"x"))
  with pytest.raises(cc.EntryError, match="another program"):
    cc.unpack(data, KEY, JAXLIB)


# --- one process --------------------------------------------------------------------


def test_a_miss_compiles_and_writes_and_the_next_one_loads(tmp_path):
  calls = []
  exe, out = _fetch(str(tmp_path), compile=lambda: calls.append(1) or "compiled")
  assert (exe, out.how, calls) == ("compiled", "compiled", [1])
  assert sorted(os.listdir(tmp_path)) == [KEY + cc.ENTRY]  # no claim, no temporary left
  exe, out = _fetch(str(tmp_path), compile=lambda: calls.append(2) or "again")
  assert (exe, out.how, calls) == ("compiled", "loaded", [1])


def test_a_corrupt_entry_is_recompiled_with_a_warning(tmp_path):
  _fetch(str(tmp_path), compile=lambda: "first")
  path = cc.entry_path(str(tmp_path), KEY)
  with open(path, "r+b") as f:
    f.seek(-2, os.SEEK_END)
    f.write(b"!!")
  exe, out = _fetch(str(tmp_path), compile=lambda: "second")
  assert (exe, out.how) == ("second", "compiled")
  assert path in out.warning and "checksum" in out.warning, out.warning
  assert _fetch(str(tmp_path), compile=lambda: "third")[0] == "second"  # replaced


def test_an_entry_that_does_not_load_is_recompiled(tmp_path):
  _fetch(str(tmp_path), compile=lambda: "first")

  def load(data):
    raise RuntimeError("INVALID_ARGUMENT: executable of another build")

  exe, out = _fetch(str(tmp_path), compile=lambda: "second", load=load)
  assert exe == "second" and "does not load (RuntimeError: INVALID_ARGUMENT" in out.warning


def test_an_unwritable_directory_compiles_and_says_so():
  # /sys refuses new directories even to root.
  exe, out = _fetch("/sys/mpijax-compile-cache/mpijax", compile=lambda: "here")
  assert (exe, out.how) == ("here", "compiled")
  assert out.unwritable == "Operation not permitted", out.unwritable


def test_a_compile_error_passes_through_and_releases_the_claim(tmp_path):
  def broken():
    raise ValueError("XLA says no")

  with pytest.raises(ValueError, match="XLA says no"):
    _fetch(str(tmp_path), compile=broken)
  assert os.listdir(tmp_path) == []


# --- claims held by others ----------------------------------------------------------


def _write_claim(directory, owner: cc.Owner) -> str:
  path = os.path.join(directory, KEY + cc.CLAIM)
  with open(path, "w") as f:
    json.dump(owner.__dict__, f)
  return path


def test_a_claim_whose_process_is_gone_is_broken_at_once(tmp_path):
  child = subprocess.Popen([sys.executable, "-c", "pass"])
  child.wait()
  mine = _owner()
  dead = cc.Owner(1, mine.host, child.pid, "job-a", mine.pidns, mine.started)
  _write_claim(str(tmp_path), dead)
  start = time.monotonic()
  exe, out = _fetch(str(tmp_path), compile=lambda: "mine", stale_s=60)
  assert (exe, out.how) == ("mine", "compiled")
  assert time.monotonic() - start < 5


def test_a_claim_in_another_pid_namespace_is_not_judged_by_its_pid(tmp_path):
  mine = _owner()
  # Its pid is not running here, but it lives in another namespace: only its
  # time can tell, so it is waited for until that stands still for stale_s.
  other = cc.Owner(1, mine.host, 2**22 + 7, "job-b", "pid:[4026531999]", 1)
  _write_claim(str(tmp_path), other)
  start = time.monotonic()
  exe, out = _fetch(str(tmp_path), compile=lambda: "mine", stale_s=1.0)
  waited = time.monotonic() - start
  assert (exe, out.how) == ("mine", "compiled")
  assert 1.0 <= waited < 10, waited


def test_a_live_claim_is_waited_for_and_its_entry_loaded(tmp_path):
  """The owner (another job's rank here) writes the entry; the waiter loads it,
  and its `waiting` context names the owner for as long as it waits."""
  other = cc.Owner(2, "elsewhere", 1234, "job-b")
  claim = _write_claim(str(tmp_path), other)
  seen = []

  @contextlib.contextmanager
  def waiting(owner):
    seen.append(("start", owner))
    yield
    seen.append(("end", owner))

  def owner_finishes():
    time.sleep(0.5)
    cc.write_entry(cc.entry_path(str(tmp_path), KEY), cc.pack(KEY, JAXLIB, b"theirs"))
    os.unlink(claim)

  import threading

  t = threading.Thread(target=owner_finishes)
  t.start()
  exe, out = _fetch(str(tmp_path), compile=lambda: "mine", waiting=waiting, stale_s=30)
  t.join()
  assert (exe, out.how, out.owner) == ("theirs", "waited", other)
  assert out.waited_s >= 0.4
  assert seen == [("start", other), ("end", other)]
  assert other.describe("job-a") == "rank 2 of another job (host elsewhere, pid 1234)"
  assert other.describe("job-b") == "rank 2"


# --- many processes -----------------------------------------------------------------


def _racer(directory: str, rank: int, log: str, queue) -> None:
  def compile():
    with open(log, "a") as f:
      f.write(f"{rank}\n")
    time.sleep(0.8)  # long enough that every racer finds the claim
    return f"compiled by {rank}"

  exe, out = cc.fetch(
    directory,
    KEY,
    jaxlib=JAXLIB,
    owner=cc.me(rank, "job-a"),
    compile=compile,
    serialize=str.encode,
    load=bytes.decode,
    waiting=cc.nothing,
  )
  queue.put((rank, exe, out.how, out.owner.rank if out.owner else None))


def test_of_racing_processes_one_compiles_and_the_others_load_its_entry(tmp_path):
  directory, log = str(tmp_path / "cache"), str(tmp_path / "compiles")
  ctx = multiprocessing.get_context("fork")
  queue = ctx.Queue()
  procs = [ctx.Process(target=_racer, args=(directory, r, log, queue)) for r in range(4)]
  for p in procs:
    p.start()
  results = sorted(queue.get(timeout=60) for _ in procs)
  for p in procs:
    p.join(10)
  with open(log) as f:
    compilers = f.read().split()
  assert len(compilers) == 1, compilers  # compiled once
  winner = int(compilers[0])
  assert all(exe == f"compiled by {winner}" for _, exe, _, _ in results), results
  hows = {rank: (how, owner) for rank, _, how, owner in results}
  assert hows.pop(winner) == ("compiled", None)
  assert set(hows.values()) == {("waited", winner)}, hows
  assert sorted(os.listdir(directory)) == [KEY + cc.ENTRY]


def _dies_while_compiling(directory: str) -> None:
  def compile():
    time.sleep(0.3)
    os._exit(9)  # killed in the middle of its compile: the claim stays behind

  cc.fetch(
    directory,
    KEY,
    jaxlib=JAXLIB,
    owner=cc.me(0, "job-a"),
    compile=compile,
    serialize=str.encode,
    load=bytes.decode,
    waiting=cc.nothing,
  )


def test_a_waiter_compiles_itself_when_the_compiling_process_dies(tmp_path):
  directory = str(tmp_path)
  ctx = multiprocessing.get_context("fork")
  doomed = ctx.Process(target=_dies_while_compiling, args=(directory,))
  doomed.start()
  deadline = time.monotonic() + 10
  while not os.path.exists(os.path.join(directory, KEY + cc.CLAIM)):
    assert time.monotonic() < deadline, "the doomed process never claimed"
    time.sleep(0.01)
  start = time.monotonic()
  exe, out = _fetch(directory, compile=lambda: "mine", stale_s=60)
  doomed.join(10)
  assert doomed.exitcode == 9
  assert (exe, out.how) == ("mine", "compiled")
  assert time.monotonic() - start < 10  # not stale_s: its process is provably gone


def test_a_claim_that_cannot_be_read_is_not_taken_for_an_abandoned_one(tmp_path, monkeypatch):
  """A claim this process cannot read (its time unknown) is waited for like any other."""
  claim = _write_claim(str(tmp_path), cc.Owner(1, "elsewhere", 1, "job-b"))
  monkeypatch.setattr(cc, "read_claim", lambda path: (None, 0) if os.path.exists(path) else None)

  def owner_finishes():
    time.sleep(0.6)
    cc.write_entry(cc.entry_path(str(tmp_path), KEY), cc.pack(KEY, JAXLIB, b"theirs"))
    os.unlink(claim)

  import threading

  t = threading.Thread(target=owner_finishes)
  t.start()
  exe, out = _fetch(str(tmp_path), compile=lambda: "mine", stale_s=30)
  t.join()
  assert (exe, out.how) == ("theirs", "waited")
