"""Every code block of README.md and docs/ runs as written, twice, and prints what its comments say.

The blocks are read from the docs at test time (tests/docs.py; its markers say
which blocks are not run, and why). Python blocks and the twins of blocks with
placeholders run in two MPI jobs, 2 ranks x 1 device and 2 x 2, each block
twice in one directory shared by all of them (tests/scripts/docs_python.py);
shell blocks run command by command, the docs twice over, all in one directory,
as a reader who follows the docs would (a command runs once when its first run
added or removed no file there, or when a later command ran the same program
with what it left in place: a second run would meet nothing new).
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
TWIN_ARGVS = {
  "mpijax/examples/resumable.py": [["--preempt-at", "30"], []],
  "mpijax/examples/preemption.py": [["--preempt-at", "121"], []],
}
# What each run of a twin must end with: (exit status, a pattern its rank-0 output matches).
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
  """config -> (the job's result, {rank: its results}, the spec)."""
  runs = {}
  for config, (ranks, devices) in docs.CONFIGS.items():
    base = tmp_path_factory.mktemp(f"docs-{config}")
    spec = _python_spec(config, base / "work")
    (base / "spec.json").write_text(json.dumps(spec))
    result, _ = run_mpi(
      ranks,
      [
        sys.executable,
        str(REPO / "tests" / "scripts" / "docs_python.py"),
        str(base / "spec.json"),
        str(base / "results"),
      ],
      devices_per_process=devices,
      timeout=600,
      env={"MPIJAX_TIMEOUT": "120"},
    )
    per_rank = {}
    for r in range(ranks):
      path = base / "results" / f"rank_{r}.json"
      per_rank[r] = json.loads(path.read_text()) if path.exists() else None
    runs[config] = (result, per_rank, spec)
  return runs


@pytest.mark.parametrize("config", list(docs.CONFIGS))
def test_python_blocks_run_twice_in_one_directory(python_runs, config):
  result, per_rank, spec = python_runs[config]
  assert result.returncode == 0, f"the {config} job failed:\n{tail(result.stdout, 150)}"
  problems = []
  for r, entries in per_rank.items():
    assert entries is not None, f"rank {r} wrote no results:\n{tail(result.stdout)}"
    assert [(e["id"], e["attempt"]) for e in entries] == [
      (item["id"], k) for item in spec for k in (1, 2)
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
  result, per_rank, _ = python_runs[config]
  raw = [m[1] for m in re.finditer(r"^\[rank0\]: ?(.*)$", result.stdout, re.M)]
  printed = [e["output"] for e in per_rank[0] or []]
  return "\n".join(line.rstrip() for line in "\n".join(printed + raw).splitlines())


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "output"], ids=lambda b: b.id)
def test_output_blocks_are_what_rank_0_prints(python_runs, block):
  want = "\n".join(line.rstrip() for line in block.text.strip("\n").splitlines())
  got = _rank0_output(python_runs, block.configs[0])
  assert want in got, f"{block.id} shows\n{want}\nbut rank 0 printed\n{got[-6000:]}"


def test_twins_do_what_their_docs_say(python_runs):
  problems = []
  for config in docs.CONFIGS:
    _, per_rank, spec = python_runs[config]
    for e in per_rank[0] or []:
      if e["id"] not in TWIN_RESULTS or e["error"] is not None:
        continue
      code, pattern = TWIN_RESULTS[e["id"]][e["attempt"] - 1]
      if e["exit"] != code or not re.search(pattern, e["output"], re.S | re.M):
        problems.append(
          f"{e['id']} run {e['attempt']} at {config}: exit {e['exit']} (expected "
          f"{code}), printed:\n{e['output'][-3000:]}"
        )
  assert not problems, "\n".join(problems)
  ran = {item["id"] for _, (_, _, spec) in python_runs.items() for item in spec}
  assert set(TWIN_RESULTS) <= ran, set(TWIN_RESULTS) - ran


# --- shell blocks ---------------------------------------------------------------------------

# What a command's output must (not) show besides its exit status 0.
_DIGITS = re.compile(r"python -m mpijax\.examples\.digits")
_ACCURACY = re.compile(r"final test accuracy ([0-9.]+)")


def _paths(root: Path) -> set[Path]:
  return {p.relative_to(root) for p in root.rglob("*")}


def _program(command: str) -> str:
  """What a command runs, with its arguments but without the launcher and its options:
  `python train.py --epochs 3` for `mpijax-run -n 4 --log-dir logs -- python train.py --epochs 3`."""
  words = command.split()
  return " ".join(words[words.index("python") :]) if "python" in words else command


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
  # The docs run twice, in order, in this one directory. The second pass runs
  # a command again when its first run added or removed files or directories
  # here, so that the rerun meets what it left; unless a later command of the
  # first pass ran the same program, arguments and all, with those paths in
  # place (the checkpoint that `mpijax-run ... -- python train.py` with other
  # launcher options meets). One that changed no path (it rewrote files that
  # were here before) met that directory already.
  first_runs = []  # (command, program, paths before, paths added, paths removed)
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
  for block, command in shell:
    if command in done and command != MAIN_JOB or done.get(command, 0) >= 2:
      continue  # the same command in an earlier block
    before = _paths(work)
    run(block, 1, command)
    after = _paths(work)
    first_runs.append((command, _program(command), before, after - before, before - after))

  met_later, unchanged = set(), set()
  for i, (command, program, _, added, removed) in enumerate(first_runs):
    if not added and not removed:
      unchanged.add(command)
    elif any(
      p == program and added <= seen and not removed & seen
      for _, p, seen, _, _ in first_runs[i + 1 :]
    ):
      met_later.add(command)
  for block, command in shell:
    if done[command] < 2 and command not in unchanged | met_later:
      run(block, 2, command)
  assert not problems, "\n\n".join(problems)
  assert all(n == 2 or c in unchanged | met_later for c, n in done.items()), done
  print(
    f"{sum(done.values())} runs of {len(done)} commands; once: {len(unchanged)} that changed "
    f"no path, {len(met_later)} whose paths a later run of their program met"
  )
