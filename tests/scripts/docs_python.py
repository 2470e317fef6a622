"""Runs the docs' Python blocks and their twins, each once, on every rank of one MPI job.

usage: docs_python.py SPEC.json RESULTS_DIR ATTEMPT

SPEC lists the runs: {"id", "dir", and "source" (a block) or "module" and
"argvs" (a twin: its arguments in the first and in the second run)}. Each
runs once in its own directory; tests/test_docs.py starts this job twice,
ATTEMPT 1 and 2, so that the second run of each is a new process in the
directory the first left, as a reader runs a program twice. A block runs
statement by statement in a fresh ``__main__`` namespace, a twin as
``python -m module argv``. What each statement prints is kept (for the
comments beside it); every rank writes RESULTS_DIR/rank_<r>.json.
tests/test_docs.py checks them.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import runpy
import sys
import time
import traceback

from mpijax._src import mpi_util


def run_block(source: str, name: str) -> tuple[list[tuple[int, str]], str]:
  """Executes ``source`` statement by statement; (printed text per statement, all output)."""
  namespace = {"__name__": "__main__", "__file__": name}
  printed = []
  whole = io.StringIO()
  for k, node in enumerate(ast.parse(source).body):
    code = compile(ast.Module([node], []), name, "exec")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      exec(code, namespace)
    printed.append((k, out.getvalue()))
    whole.write(out.getvalue())
  return printed, whole.getvalue()


def run_twin(module: str, argv: list[str]) -> tuple[int, str]:
  """``python -m module argv`` in this process; (exit status, what it printed)."""
  out = io.StringIO()
  old_argv = sys.argv
  sys.argv = [module] + list(argv)
  code = 0
  try:
    with contextlib.redirect_stdout(out):
      runpy.run_module(module, run_name="__main__", alter_sys=True)
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  finally:
    sys.argv = old_argv
    # What a new process would not inherit: a recorded preemption signal.
    from mpijax import train

    train.uninstall_preemption_handler()
  return code, out.getvalue()


def main() -> None:
  spec_path, results_dir, attempt = sys.argv[1], sys.argv[2], int(sys.argv[3])
  MPI = mpi_util.import_mpi()
  comm = MPI.COMM_WORLD
  rank = comm.Get_rank()
  with open(spec_path) as f:
    spec = json.load(f)
  results = []
  for item in spec:
    if rank == 0:
      os.makedirs(item["dir"], exist_ok=True)
    comm.Barrier()
    os.chdir(item["dir"])
    t0 = time.monotonic()
    entry = {
      "id": item["id"],
      "attempt": attempt,
      "error": None,
      "printed": [],
      "output": "",
      "exit": 0,
    }
    try:
      if "source" in item:
        entry["printed"], entry["output"] = run_block(item["source"], item["id"])
      else:
        entry["exit"], entry["output"] = run_twin(item["module"], item["argvs"][attempt - 1])
    except BaseException:  # noqa: BLE001 - recorded, and the next run goes on
      entry["error"] = traceback.format_exc()
    results.append(entry)
    status = "ok" if entry["error"] is None else "FAILED"
    print(f"docs: {item['id']} run {attempt}: {status} ({time.monotonic() - t0:.1f} s)", flush=True)
    comm.Barrier()
  os.makedirs(results_dir, exist_ok=True)
  with open(os.path.join(results_dir, f"rank_{rank}.json"), "w") as f:
    json.dump(results, f)
  comm.Barrier()


if __name__ == "__main__":
  main()
