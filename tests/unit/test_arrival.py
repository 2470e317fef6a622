"""mpijax-run's arrival board and the ranks' side of it, over real sockets on loopback.

The ranks here are the rank-side client (mpijax/_src/guards/arrival.py's ``Board``)
in this process, one per rank; the board asks each where its main thread is,
and this process's main thread is the test function. A watch without a board
(a plain launcher) reports the wait with no names.
"""

from __future__ import annotations

import socket
import sys
import threading
import time

import pytest

from mpijax._src.guards import arrival
from mpijax._src.run import arrivals


@pytest.fixture
def board():
  b = arrivals.Board("127.0.0.1", ["127.0.0.1"])
  b.begin(0, 4)
  yield b
  b.close()


def _client(board: arrivals.Board, rank: int, size: int = 4) -> arrival.Board:
  c = arrival.Board(board.value, rank, size)
  reports: list[dict] = []
  c.on_report = reports.append
  c.reports = reports
  return c


def _until(cond, seconds: float = 10.0) -> None:
  end = time.monotonic() + seconds
  while not cond():
    assert time.monotonic() < end, "timed out"
    time.sleep(0.02)


def _enter_init(c: arrival.Board, timeout: float = 5.0, action: str = "abort") -> None:
  c.send({"init": 1, "timeout": timeout, "action": action})


def test_the_ranks_in_init_get_one_report_naming_the_rank_that_is_elsewhere(board):
  clients = [_client(board, r) for r in range(4)]
  try:
    for c in clients[:3]:
      _enter_init(c)
    _until(lambda: all(board._ranks.get(r) is not None for r in range(4)))
    _until(lambda: all(board._ranks[r].init is not None for r in range(3)))
    clients[1].send({"ask": 1})
    _until(lambda: all(c.reports for c in clients[:3]))
    lines = {c.reports[0]["line"] for c in clients[:3]}
    assert len(lines) == 1  # every waiting rank says the same
    line = lines.pop()
    assert line.startswith("mpijax: init: ranks 0-2 waited "), line
    assert "for rank 3, which has not called it. Not arrived: rank 3 (" in line, line
    # Rank 3 answered from this test's main thread: where it is, by file and function.
    assert "Python: test_arrival.py:" in line and " in _until: time.sleep(0.02)" in line, line
    assert "(MPIJAX_TIMEOUT=5 s; MPIJAX_STALL_ACTION=abort). Ending the job." in line, line
    assert all(c.reports[0]["stuck"] for c in clients[:3])
    # The stack, once: to the lowest waiting rank.
    stacks = clients[0].reports[0]["stacks"]
    assert stacks[0].startswith("rank 3 (") and "Python main thread:" in stacks[0], stacks
    assert any("in test_the_ranks_in_init" in s for s in stacks), stacks
    assert clients[1].reports[0]["stacks"] == [] and clients[2].reports[0]["stacks"] == []
    assert clients[3].reports == []  # not waiting: told nothing
  finally:
    for c in clients:
      c.close()


def test_a_rank_never_heard_of_is_named_and_a_rank_that_left_too(board):
  clients = [_client(board, r) for r in (0, 1)]
  try:
    for c in clients:
      _enter_init(c, action="warn")
    gone = _client(board, 2)
    _until(lambda: all(board._ranks.get(r) is not None for r in range(3)))
    gone.close()
    _until(lambda: board._ranks[2].gone)
    clients[0].send({"ask": 1})
    _until(lambda: all(c.reports for c in clients))
    line = clients[0].reports[0]["line"]
    assert "for ranks 2-3, which have not called it" in line, line
    assert "rank 2 (" in line and "left before calling mpijax.init()" in line, line
    assert "rank 3 (no word from it since the job started: it has not imported mpijax" in line
    assert line.endswith("MPIJAX_STALL_ACTION=warn). Still waiting."), line
  finally:
    for c in clients:
      c.close()


def test_a_rank_inside_an_import_is_on_its_way_not_stuck(board, monkeypatch):
  monkeypatch.setattr(arrival, "importing", lambda: True)
  board.begin(0, 2)
  clients = [_client(board, r, size=2) for r in (0, 1)]
  try:
    _until(lambda: all(board._ranks.get(r) is not None for r in range(2)))
    _enter_init(clients[0])
    _until(lambda: board._ranks[0].init is not None)
    clients[0].send({"ask": 1})
    _until(lambda: clients[0].reports)
    report = clients[0].reports[0]
    assert not report["stuck"], report
    assert "rank 1 (" in report["line"] and "still importing modules" in report["line"]
    assert "Still waiting: a rank that imports modules, or is busy" in report["line"]
  finally:
    for c in clients:
      c.close()


def test_when_every_rank_is_in_init_the_report_says_so_and_nothing_ends(board):
  board.begin(0, 2)
  clients = [_client(board, r, size=2) for r in (0, 1)]
  try:
    for c in clients:
      _enter_init(c)
    _until(lambda: all(board._ranks.get(r) and board._ranks[r].init for r in range(2)))
    clients[1].send({"ask": 1})
    _until(lambda: all(c.reports for c in clients))
    report = clients[0].reports[0]
    assert report["missing"] == [] and not report["stuck"]
    assert "every rank has called mpijax.init()" in report["line"]
  finally:
    for c in clients:
      c.close()


def test_the_board_refuses_a_wrong_key_and_another_attempt(board):
  token, _, port = arrival.parse_address(board.value)
  bad = arrival.Board(f"{'0' * len(token)}@127.0.0.1:{port}", 0, 4)
  stale = arrival.Board(board.value, 1, 4)
  board.begin(1, 4)  # a restart: the old attempt's ranks are forgotten
  late = arrival.Board(board.value, 2, 4)
  try:
    _until(lambda: not bad.up())
    assert 0 not in board._ranks
    # Its hello said attempt 0 (MPIJAX_RESTART_ATTEMPT unset here): refused.
    _until(lambda: not late.up())
    assert 2 not in board._ranks
  finally:
    for c in (bad, stale, late):
      c.close()


def test_a_line_without_a_key_is_dropped(board):
  _, _, port = arrival.parse_address(board.value)
  with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
    s.sendall(b'{"rank": 0}\n')
    s.settimeout(5)
    assert s.recv(100) == b""  # closed


def test_parse_address_rejects_what_is_not_one():
  assert arrival.parse_address("k@a,b:123") == ("k", ["a", "b"], 123)
  for bad in ("a:1", "k@a", "k@a:0", "@a:1", "k@:1"):
    with pytest.raises(ValueError):
      arrival.parse_address(bad)


def _blocked(release: threading.Event, box: list) -> None:
  box.append(arrival.Watch(1, 4, 0.3, "warn", sys._getframe().f_code, None))
  release.wait(10)


def test_a_watch_without_a_board_reports_the_wait_without_names_until_init_returns(capsys):
  release, box = threading.Event(), []
  t = threading.Thread(target=_blocked, args=(release, box))
  t.start()
  try:
    _until(lambda: "mpijax: init:" in capsys.readouterr().err or False, 10)
  finally:
    release.set()
    t.join(10)
  time.sleep(0.8)  # past the watched call: nothing more is said
  assert "mpijax: init:" not in capsys.readouterr().err


def test_a_watch_report_without_a_board_names_no_rank():
  w = arrival.Watch.__new__(arrival.Watch)
  w.rank, w.size, w.timeout, w.action = 2, 4, 5.0, "abort"
  w.started = time.monotonic() - 5.0
  w.thread_id = threading.get_ident()
  lines, fatal = w.report(None)
  assert fatal and len(lines) == 1
  assert lines[0].startswith(
    "mpijax: init: rank 2 waited 5.0 s in mpijax.init() for the other ranks"
  )
  assert (
    "here they are not known (MPIJAX_TIMEOUT=5 s; MPIJAX_STALL_ACTION=abort). Ending the job."
    in lines[0]
  )
