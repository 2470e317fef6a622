"""benchmarks/multinode.py builds its two hosts, measures, and leaves nothing behind.

A ``--quick`` run (4 KiB, a few calls per row) must measure every row across
the two namespaces (each row's result checked inside the script) and exit 0;
a run stopped by Ctrl-C (SIGINT) while its job runs must exit 130. After
either, none of the script's namespaces, /etc/netns hosts files or temporary
files may remain (the veth pair and its qdiscs live inside the namespaces).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import netns
import pytest
from conftest import REPO

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(240)]

SCRIPT = str(REPO / "benchmarks" / "multinode.py")
ROWS = {"raw_oop", "raw_inplace", "mpijax_ops", "mpijax_psum", "xla"}


@pytest.fixture(autouse=True)
def _needs_namespaces():
  reason = netns.why_unavailable()
  if reason:
    pytest.skip(reason)


def _start(tmp_path, *extra: str) -> subprocess.Popen:
  argv = [sys.executable, SCRIPT, "--quick", "--calls", "5", "--out", str(tmp_path), *extra]
  return subprocess.Popen(
    argv,
    cwd=REPO,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    start_new_session=True,
  )


def _assert_nothing_left(tag: str, tmpdir: str | None) -> None:
  names = {f"mjbnA{tag}", f"mjbnB{tag}"}
  assert not names & set(netns.netns_list())
  assert not any(os.path.exists(os.path.join(netns.NETNS_ETC, n)) for n in names)
  links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=20)
  assert f"mjbna{tag}" not in links.stdout and f"mjbnb{tag}" not in links.stdout
  if tmpdir:
    assert not os.path.exists(tmpdir)


def _tmpdir(output: str) -> str | None:
  m = re.search(r"--hostfile (/\S+)/hostfile", output)
  return m.group(1) if m else None


def test_quick_run_measures_every_row_and_cleans_up(tmp_path):
  proc = _start(tmp_path)
  try:
    out, _ = proc.communicate(timeout=200)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
  assert proc.returncode == 0, out
  _assert_nothing_left(str(proc.pid % 100000), _tmpdir(out))
  record = json.loads((tmp_path / "multinode.json").read_text())
  assert record["meta"]["hostnames"] == [f"bna{proc.pid % 100000}", f"bnb{proc.pid % 100000}"]
  assert "tbf" in " ".join(record["meta"]["link"]["qdiscs"]), record["meta"]["link"]
  cells = {r["key"]: r["cells"][str(4 << 10)] for r in record["rows"]}
  assert set(cells) == ROWS, cells
  for key, cell in cells.items():
    assert "skipped" not in cell, (key, cell)
    assert 0 < cell["p10_us"] <= cell["median_us"] <= cell["p90_us"], (key, cell)
  assert "XLA's all-reduce <= 1.15x" in out, out


def test_ctrl_c_while_the_job_runs_removes_everything(tmp_path):
  proc = _start(tmp_path)
  tag = str(proc.pid % 100000)
  lines: list[str] = []
  try:
    end = time.monotonic() + 120
    for line in proc.stdout:
      lines.append(line)
      if line.startswith("# job:") or time.monotonic() > end:
        break
    assert lines and lines[-1].startswith("# job:"), "".join(lines)
    # The hosts and the shaped link exist now.
    assert {f"mjbnA{tag}", f"mjbnB{tag}"} <= set(netns.netns_list())
    qdisc = subprocess.run(
      ["tc", "-n", f"mjbnA{tag}", "qdisc", "show", "dev", f"mjbna{tag}"],
      capture_output=True,
      text=True,
      timeout=20,
    )
    assert "tbf" in qdisc.stdout and "rate 1Gbit" in qdisc.stdout, qdisc.stdout
    time.sleep(2)  # the ranks are starting inside the namespaces
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
  out = "".join(lines) + rest
  assert proc.returncode == 130, out
  assert "stopped by SIGINT" in out, out
  _assert_nothing_left(tag, _tmpdir(out))
