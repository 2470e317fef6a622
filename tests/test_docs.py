"""Every code block of README.md and docs/ runs as written, twice, and prints what its comments say.

The blocks are read from the docs at test time (tests/docs.py; its markers say
which blocks are not run, and why). Python blocks and the twins of blocks with
placeholders run at 2 ranks x 1 device and at 2 x 2, in one directory per
configuration: every block and twin once in one MPI job, then each a second
time in a new job (tests/scripts/docs_python.py), so that a second run is a
new process that meets only the files the first left. Every rank's runs must
succeed, and every twin must exit with the status its docs give, on every
rank. Shell blocks run command by command, the docs twice over, all in one
directory, as a reader who follows the docs would: every command runs twice
(the README's main job once more, after the run of it that
tests/conftest.py's fixture made).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from tests import docs
from tests._launch import REPO
from tests._launch import run_mpi
from tests._launch import run_shell
from tests._launch import tail
from tests.conftest import MAIN_JOB

BLOCKS = docs.blocks()

# Twins that show a resume: the first run is stopped by a signal, the second resumes.
# Others run with no arguments both times.
TWIN_ARGVS = {
  "mpijax/examples/resumable.py": [["--preempt-at", "30"], []],
  "mpijax/examples/preemption.py": [["--preempt-at", "121"], []],
}
# What each run of a twin must end with: (exit status on every rank, a pattern its rank-0
# output matches). Every twin the docs name must be here.
TWIN_RESULTS = {
  "mpijax/examples/data_parallel.py": [(0, r"\n9 \{'accuracy': 0\.(8[5-9]|9)\d*.*\noverlapped: ")]
  * 2,
  "mpijax/examples/batchnorm.py": [(0, r"linen, SyncBatchNorm: \{'loss': .*\nNNX, SyncBatchNorm: ")]
  * 2,
  "mpijax/examples/resumable.py": [
    (75, r"^starting at step 0\n$"),
    (0, r"^starting at step 30\nfinished at step 80: "),
  ],
  "mpijax/examples/preemption.py": [
    (75, r"^$"),
    (0, r"^x = \[200\. 200\. 200\.\] after step 200\n$"),
  ],
  "mpijax/examples/timeline_part.py": [(0, r"trace\.json: 10 allreduce calls of 2 ranks")] * 2,
}


def _python_spec(config: str, work: Path) -> list[dict]:
  items, twins = [], set()
  for b in BLOCKS:
    if b.lang != "python" or config not in b.configs:
      continue
    if b.kind == "run":
      items.append({"id": b.id, "dir": str(work), "source": b.text})
    elif b.kind == "twin" and b.twin.endswith(".py") and b.twin not in twins:
      twins.add(b.twin)
      items.append(
        {
          "id": b.twin,
          "dir": str(work),
          "module": b.twin[:-3].replace("/", "."),
          "argvs": TWIN_ARGVS.get(b.twin, [[], []]),
        }
      )
  return items


@pytest.fixture(scope="module")
def python_runs(tmp_path_factory) -> dict[str, tuple]:
  """config -> (the two jobs' results, {rank: its results of both}, the spec)."""
  runs = {}
  for config, (ranks, devices) in docs.CONFIGS.items():
    base = tmp_path_factory.mktemp(f"docs-{config}")
    spec = _python_spec(config, base / "work")
    (base / "spec.json").write_text(json.dumps(spec))
    results, per_rank = [], {r: [] for r in range(ranks)}
    for attempt in (1, 2):  # the second run of each in a new job, in the same directory
      out = base / f"results-{attempt}"
      result, _ = run_mpi(
        ranks,
        [
          sys.executable,
          str(REPO / "tests" / "scripts" / "docs_python.py"),
          str(base / "spec.json"),
          str(out),
          str(attempt),
        ],
        devices_per_process=devices,
        timeout=600,
        env={"MPIJAX_TIMEOUT": "120"},
      )
      results.append(result)
      for r in range(ranks):
        path = out / f"rank_{r}.json"
        if path.exists() and per_rank[r] is not None:
          per_rank[r] += json.loads(path.read_text())
        else:
          per_rank[r] = None
    runs[config] = (results, per_rank, spec)
  return runs


@pytest.mark.parametrize("config", list(docs.CONFIGS))
def test_python_blocks_run_twice_in_one_directory(python_runs, config):
  results, per_rank, spec = python_runs[config]
  for k, result in enumerate(results, start=1):
    assert result.returncode == 0, (
      f"the {config} job of run {k} failed:\n{tail(result.stdout, 150)}"
    )
  problems = []
  for r, entries in per_rank.items():
    assert entries is not None, f"rank {r} wrote no results:\n{tail(results[-1].stdout)}"
    assert [(e["id"], e["attempt"]) for e in entries] == [
      (item["id"], k) for k in (1, 2) for item in spec
    ]
    problems += [
      f"{e['id']} (run {e['attempt']}, rank {r}):\n{e['error']}"
      for e in entries
      if e["error"] is not None
    ]
  assert not problems, "\n".join(problems)


def test_printed_values_match_the_comments_beside_them(python_runs):
  checked, problems = set(), []
  for config, (ranks, devices) in docs.CONFIGS.items():
    _, per_rank, _ = python_runs[config]
    for r, entries in per_rank.items():
      for e in entries or []:
        block = next((b for b in BLOCKS if b.id == e["id"]), None)
        if block is None or e["error"] is not None:
          continue
        printed = dict(e["printed"])
        for k, comment in docs.print_comments(block.text).items():
          alts = [a for a in docs.alternatives(comment) if docs.applies(a, ranks, devices, r)]
          if not alts:
            continue
          checked.add((block.id, k))
          if not any(docs.comment_matches(printed[k], a) for a in alts):
            problems.append(
              f"{block.id}, statement {k + 1}, {config} rank {r}, run "
              f"{e['attempt']}: printed {printed[k]!r}, the comment says {comment!r}"
            )
  assert not problems, "\n".join(problems)
  unchecked = [
    (b.id, k, c)
    for b in BLOCKS
    if b.lang == "python" and b.kind == "run"
    for k, c in docs.print_comments(b.text).items()
    if (b.id, k) not in checked
  ]
  assert not unchecked, f"comments no configuration of the test speaks of: {unchecked}"


def _rank0_output(python_runs, config: str) -> str:
  results, per_rank, _ = python_runs[config]
  stdout = "\n".join(result.stdout for result in results)
  raw = [m[1] for m in re.finditer(r"^\[rank0\]: ?(.*)$", stdout, re.M)]
  printed = [e["output"] for e in per_rank[0] or []]
  return "\n".join(line.rstrip() for line in "\n".join(printed + raw).splitlines())


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "output"], ids=lambda b: b.id)
def test_output_blocks_are_what_rank_0_prints(python_runs, block):
  want = "\n".join(line.rstrip() for line in block.text.strip("\n").splitlines())
  got = _rank0_output(python_runs, block.configs[0])
  assert want in got, f"{block.id} shows\n{want}\nbut rank 0 printed\n{got[-6000:]}"


def test_twins_do_what_their_docs_say(python_runs):
  twins = {
    item["id"] for _, (_, _, spec) in python_runs.items() for item in spec if "module" in item
  }
  assert twins == set(TWIN_RESULTS), (twins - set(TWIN_RESULTS), set(TWIN_RESULTS) - twins)
  problems, checked = [], 0
  for config in docs.CONFIGS:
    _, per_rank, spec = python_runs[config]
    for r, entries in per_rank.items():
      for e in entries or []:
        if e["id"] not in twins:
          continue
        checked += 1
        code, pattern = TWIN_RESULTS[e["id"]][e["attempt"] - 1]
        if e["error"] is not None or e["exit"] != code:
          problems.append(
            f"{e['id']} run {e['attempt']} at {config}, rank {r}: exit {e['exit']} (expected "
            f"{code}), printed:\n{e['output'][-3000:]}\n{e['error'] or ''}"
          )
        elif r == 0 and not re.search(pattern, e["output"], re.S | re.M):
          problems.append(
            f"{e['id']} run {e['attempt']} at {config}, rank 0: printed what the docs do not "
            f"say ({pattern!r}):\n{e['output'][-3000:]}"
          )
  assert not problems, "\n".join(problems)
  # Both runs of every twin, on every rank of both configurations.
  assert checked == sum(
    2 * ranks * sum(1 for item in python_runs[c][2] if "module" in item)
    for c, (ranks, _) in docs.CONFIGS.items()
  ), checked


# --- shell blocks ---------------------------------------------------------------------------

# What a command's output must (not) show besides its exit status 0.
_DIGITS = re.compile(r"python -m mpijax\.examples\.digits")
_ACCURACY = re.compile(r"final test accuracy ([0-9.]+)")


def test_shell_blocks_run_twice_in_one_directory(tmp_path, digits_4_ranks):
  work = tmp_path / "project"
  work.mkdir()
  # `train.py` in the docs: the README's training loop, complete.
  shutil.copy(REPO / "mpijax" / "examples" / "data_parallel.py", work / "train.py")
  # The README's main job ran once already, as written, in a directory of its own
  # (tests/conftest.py): go on from its files, as if it had run here.
  out, first = digits_4_ranks
  assert first.returncode == 0, tail(first.stdout)
  shutil.copytree(out.parent, work / "runs")
  done = {MAIN_JOB: 1}
  problems = []

  def run(block, attempt, command):
    result, seconds = run_shell(command, work, timeout=600)
    done[command] = done.get(command, 0) + 1
    print(f"{block.id} run {attempt}: {command} -> {result.returncode} ({seconds:.0f} s)")
    text = result.stdout
    if result.returncode != 0:
      problems.append(
        f"{block.id} run {attempt}: `{command}` exited {result.returncode}:\n{tail(text, 40)}"
      )
    elif _DIGITS.search(command) and (
      float((_ACCURACY.findall(text) or ["0"])[-1]) < 0.97 or " nan " in text
    ):
      # The README: "about 98 % test accuracy".
      problems.append(
        f"{block.id} run {attempt}: `{command}` printed no final accuracy of at least "
        f"0.97, or a nan:\n{tail(text, 20)}"
      )

  shell = [
    (block, command)
    for block in BLOCKS
    if block.lang == "bash" and block.kind in ("run", "partial")
    for command, runs in docs.commands(block)
    if runs  # else the block's marker says why not
  ]
  # The docs twice over, in order, in this one directory. A command that an
  # earlier block (or the fixture) ran already counts that run.
  for attempt in (1, 2):
    for block, command in shell:
      if done.get(command, 0) < attempt:
        run(block, attempt, command)
  assert not problems, "\n\n".join(problems)
  assert all(n == 2 for n in done.values()), done
  print(f"{sum(done.values())} runs of {len(done)} commands")
