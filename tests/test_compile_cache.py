"""The compile cache in real jobs: one rank compiles each program and the others load
it; a warm job loads everything and keeps what mpijax adds at compile time; ranks
with programs of their own do not wait; a rank waiting for a compile is not a stall;
bad entries, unwritable directories and killed jobs cost a compile, never a result."""

from __future__ import annotations

import collections
import contextlib
import glob
import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest

from mpijax._src.xla import compile_cache
from tests._launch import REPO
from tests._launch import mpirun_command
from tests._launch import run_mpi

JOB = str(REPO / "tests" / "scripts" / "compile_cache_job.py")


def _job(n, args, cache, *, devices=1, env=None, timeout=240):
  env = {"JAX_COMPILATION_CACHE_DIR": str(cache), **(env or {})}
  result, _ = run_mpi(
    n, ["python", JOB, *args], devices_per_process=devices, env=env, timeout=timeout
  )
  return result


def _results(result, n):
  rows = [
    json.loads(line.split("RESULT ", 1)[1])
    for line in result.stdout.splitlines()
    if "RESULT " in line
  ]
  assert result.returncode == 0 and len(rows) == n, result.stdout[-4000:]
  return {r["rank"]: r for r in sorted(rows, key=lambda r: r["rank"])}


def _by_program(rows):
  """program -> {rank: (how, whose compile it waited for)}."""
  out = collections.defaultdict(dict)
  for rank, row in rows.items():
    for name, how, owner in row["outcomes"]:
      out[name][rank] = (how, owner)
  return out


def _entries_are_whole(cache):
  names = os.listdir(os.path.join(cache, "mpijax"))
  assert names and all(n.endswith(compile_cache.ENTRY) for n in names), names  # no claim, no temp
  for name in names:
    with open(os.path.join(cache, "mpijax", name), "rb") as f:
      data = f.read()
    key = name[: -len(compile_cache.ENTRY)]
    compile_cache.unpack(data, key, __import__("jaxlib").__version__)  # raises if not whole


@pytest.mark.parametrize("devices", [1, 2], ids=["1-device", "2-devices"])
def test_one_rank_compiles_each_program_and_a_warm_job_loads_them(tmp_path, devices):
  cache = tmp_path / "cache"
  cold = _results(_job(2, ["share"], cache, devices=devices), 2)
  programs = _by_program(cold)
  for name in ("jit_rank_program", "jit_global_program"):
    hows = programs[name]
    compilers = [r for r, (how, _) in hows.items() if how == "compiled"]
    assert len(compilers) == 1, (name, hows)  # once per job, not per rank
    others = [hows[r] for r in hows if r not in compilers]
    assert all(how in ("waited", "loaded") for how, _ in others), (name, hows)
    assert all(owner in (None, compilers[0]) for _, owner in others), (name, hows)
  assert sum(h == "compiled" for p in programs.values() for h, _ in p.values()) == len(programs)
  _entries_are_whole(cache)

  warm = _results(_job(2, ["share"], cache, devices=devices), 2)
  assert {h for p in _by_program(warm).values() for h, _ in p.values()} == {"loaded"}
  for rank in (0, 1):  # loaded programs compute what compiled ones did
    assert warm[rank]["local"] == cold[rank]["local"] and warm[rank]["glob"] == cold[rank]["glob"]
  # every rank's per-rank program saw every rank's data: the all-reduce ran
  x = [np.full((4, 32), float(r)) for r in range(2)]
  assert np.allclose(cold[0]["local"], sum(_layers(v, 12) for v in x), rtol=1e-4)


def _layers(x, n):
  for i in range(n):
    x = np.tanh(x @ np.full((x.shape[-1], x.shape[-1]), 0.01)) + i
  return x


def test_a_program_of_one_rank_or_of_other_shapes_waits_for_nobody(tmp_path):
  rows = _results(_job(2, ["differ"], tmp_path / "cache"), 2)
  assert rows[0]["total"] == rows[1]["total"] == 4 + 5
  for row in rows.values():
    hows = {name: how for name, how, _ in row["outcomes"]}
    assert hows["jit_own_shape"] == "compiled", row["outcomes"]  # its own shape: no one else's
  assert {n: h for n, h, _ in rows[0]["outcomes"]}["jit_only_rank_0"] == "compiled"
  assert "jit_only_rank_0" not in {n for n, _, _ in rows[1]["outcomes"]}


def test_a_rank_waiting_for_a_compile_is_named_and_not_taken_for_a_stall(tmp_path):
  timeline = tmp_path / "trace.json"
  result = _job(
    3,
    ["wait", "--layers", "400"],
    tmp_path / "cache",
    # warn: on a loaded machine a rank may lag a second after its compile, a real
    # (short) stall; what must never happen is a compiling rank in a stall report.
    env={"MPIJAX_TIMEOUT": "1", "MPIJAX_STALL_ACTION": "warn", "MPIJAX_TIMELINE": str(timeline)},
  )
  rows = _results(result, 3)
  assert all(r["total"] == [3.0, 3.0, 3.0] for r in rows.values())
  programs = _by_program(rows)["jit_slow_program"]
  assert programs[0] == ("compiled", None) and programs[1] == ("waited", 0), programs
  err = result.stdout  # mpijax-run merges the ranks' stderr into its output
  stalls = [line for line in err.splitlines() if "mpijax: stall" in line]
  assert not [line for line in stalls if "compiling " in line or "'s compile" in line], stalls
  reports = [line for line in err.splitlines() if "mpijax: waiting for a compile:" in line]
  assert reports, err[-3000:]
  text = " ".join(reports)
  assert "rank 0 (" in text and "compiling jit_slow_program for " in text, text
  assert "rank 1 (" in text and "waiting for rank 0's compile of jit_slow_program" in text, text
  with open(timeline) as f:
    names = {e.get("name", "") for e in json.load(f)["traceEvents"]}
  assert "waiting for rank 0's compile: jit_slow_program" in names, sorted(names)[:50]
  assert "compile: jit_slow_program" in names


def test_a_warm_job_keeps_the_mismatch_check_and_the_call_sites(tmp_path):
  cache = tmp_path / "cache"
  for run in ("cold", "warm"):
    rows = _results(_job(2, ["mismatch"], cache), 2)
    assert "float32[3]" in rows[0]["error"] and "float32[5]" in rows[0]["error"], (run, rows)
    if run == "warm":
      assert {h for _, h, _ in rows[0]["outcomes"]} == {"loaded"}, rows[0]["outcomes"]
  for run in ("cold", "warm"):
    result = _job(
      2,
      ["mismatch", "--stall"],
      cache,
      env={"MPIJAX_TIMEOUT": "1", "MPIJAX_STALL_ACTION": "warn", "STALL_S": "2.5"},
    )
    rows = _results(result, 2)
    stalls = [line for line in result.stdout.splitlines() if "mpijax: stall:" in line]
    assert stalls and "compile_cache_job.py:" in stalls[0], (run, result.stdout[-3000:])
    if run == "warm":
      assert "jit_stall_site" in [n for n, h, _ in rows[0]["outcomes"] if h == "loaded"]


def test_a_bad_entry_is_recompiled_with_a_warning(tmp_path):
  cache = tmp_path / "cache"
  cold = _results(_job(2, ["share"], cache), 2)
  entries = glob.glob(str(cache / "mpijax" / "jit_rank_program-*.xla"))
  assert len(entries) == 1, entries
  with open(entries[0], "r+b") as f:
    f.truncate(os.path.getsize(entries[0]) // 2)
  result = _job(2, ["share"], cache)
  warm = _results(result, 2)
  assert warm[0]["local"] == cold[0]["local"]
  warnings = [line for line in result.stdout.splitlines() if "is unusable" in line]
  assert 1 <= len(warnings) <= 2 and "truncated" in warnings[0], result.stdout[-3000:]
  _entries_are_whole(cache)


def test_an_unwritable_cache_directory_is_named_once(tmp_path):
  result = _job(2, ["share"], "/sys/mpijax-test-cache")
  rows = _results(result, 2)
  assert {h for p in _by_program(rows).values() for h, _ in p.values()} == {"uncached"}
  lines = [line for line in result.stdout.splitlines() if "cannot be written" in line]
  assert len(lines) == 2 and "/sys/mpijax-test-cache/mpijax" in lines[0], result.stdout[-3000:]


def _ranks_of(cache: str) -> set[int]:
  """The job's ranks: the processes running JOB with this cache directory, not its launcher."""
  pids = set()
  for entry in os.listdir("/proc"):
    if not entry.isdigit() or int(entry) == os.getpid():
      continue
    try:
      with open(f"/proc/{entry}/environ", "rb") as f:
        env = f.read().split(b"\0")
      with open(f"/proc/{entry}/cmdline", "rb") as f:
        cmdline = f.read()
    except OSError:
      continue
    launcher = any(w in cmdline for w in (b"mpijax.launch", b"prterun", b"mpirun", b"prted"))
    if f"JAX_COMPILATION_CACHE_DIR={cache}".encode() in env and JOB.encode() in cmdline:
      if not launcher:  # the launcher sees the ranks die, and cleans up
        pids.add(int(entry))
  return pids


def test_jobs_sharing_a_directory_and_a_killed_one_leave_only_whole_entries(tmp_path):
  cache = tmp_path / "cache"
  # A job whose compiling rank is killed leaves its claim behind ...
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache), MPIJAX_DEVICES_PER_PROCESS="1")
  cmd = mpirun_command(2, 1, True, 120) + ["python", JOB, "share", "--layers", "600"]
  killed = subprocess.Popen(
    cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
  )
  deadline = time.monotonic() + 120
  while True:
    claims = glob.glob(str(cache / "mpijax" / ("*" + compile_cache.CLAIM)))
    owner = compile_cache.read_claim(claims[0]) if claims else None
    if owner is not None and owner[0] is not None:
      break
    assert time.monotonic() < deadline and killed.poll() is None, "no claim appeared"
    time.sleep(0.05)
  for pid in _ranks_of(str(cache)) | {owner[0].pid}:  # every rank at once: no one breaks it
    with contextlib.suppress(ProcessLookupError):
      os.kill(pid, signal.SIGKILL)
  assert killed.wait(60) != 0
  assert glob.glob(str(cache / "mpijax" / ("*" + compile_cache.CLAIM)))
  # ... which the next jobs, two at once on one directory, pass over at once.
  start = time.monotonic()
  jobs = [
    subprocess.Popen(
      mpirun_command(2, 1, True, 200) + ["python", JOB, "share"],
      env=env,
      cwd=REPO,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for _ in range(2)
  ]
  outs = [j.communicate(timeout=260) for j in jobs]
  for job, (out, err) in zip(jobs, outs):
    _results(subprocess.CompletedProcess(job.args, job.returncode, out, err), 2)
  # Not a claim's stale time per program: its owner's process is provably gone.
  assert time.monotonic() - start < 200
  assert all("is unusable" not in out for out, _ in outs)
  _entries_are_whole(cache)
