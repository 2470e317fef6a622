"""Shared harness of the mpijax benchmarks.

What every benchmark here does the same way:

* **Timing.** A row is a zero-argument ``step()`` that runs one operation and
  blocks on its result. Each trial runs ``step()`` ``iters`` times behind a
  barrier; ``iters`` is chosen so a trial lasts about ``trial_seconds`` and is
  agreed across ranks (the max), because every rank must issue the same
  number of collectives. A rank's figure is the median over trials of the
  time per step; the reported figure is the max over ranks of those medians.
  The rows of one job run their trials in round robin (:func:`time_interleaved`).
* **Phases.** Some rows cannot share a process with the others: JAX's gloo
  ``psum`` needs ``jax.distributed``, a setting such as ``MPIJAX_TIMEOUT=0``
  is read at start-up, and a hierarchical run needs a different device count.
  Each such phase is a separate ``mpirun`` of the same script with
  ``--phase NAME --phase-out FILE``; :func:`run_phase` starts it (from a plain
  process, or from rank 0 of an ``mpirun`` job with the launcher's variables
  removed, so Open MPI starts a fresh job) and reads back its JSON.
* **Output.** A Markdown table (rows = methods, columns = sizes, cells =
  median microseconds), JSON with every rank's median, and a log-log PNG.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

# Variables through which mpirun tells its children who they are. A nested
# mpirun that inherits them would try to join the outer job.
_LAUNCHER_ENV_PREFIXES = ("OMPI_", "PMIX_", "PRTE_", "OPAL_", "PMI_", "HYDRA_", "MPI_LOCALRANKID",
                          "MPI_LOCALNRANKS")

DEFAULT_SIZES = (4, 4 << 10, 256 << 10, 4 << 20, 64 << 20)
QUICK_SIZES = (4, 4 << 10, 256 << 10)


# --- sizes ---------------------------------------------------------------------

def parse_size(text: str) -> int:
  """'4', '4K', '4KiB', '256KiB', '4MiB', '1GiB' -> bytes."""
  t = text.strip().lower().replace("ib", "").rstrip("b")
  mult = 1
  for suffix, m in (("k", 1 << 10), ("m", 1 << 20), ("g", 1 << 30)):
    if t.endswith(suffix):
      t, mult = t[:-1], m
      break
  try:
    value = int(float(t) * mult)
  except ValueError:
    raise ValueError(f"cannot read size {text!r}; write e.g. 4, 4KiB, 256KiB, 4MiB") from None
  if value < 4 or value % 4:
    raise ValueError(f"size {text!r} = {value} B is not a positive multiple of 4 (float32)")
  return value


def parse_sizes(text: str) -> list[int]:
  return [parse_size(s) for s in text.split(",") if s.strip()]


def fmt_size(nbytes: int) -> str:
  for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if nbytes >= m and nbytes % m == 0:
      return f"{nbytes // m} {unit}"
  return f"{nbytes} B"


def default_trials(nbytes: int) -> int:
  # Small messages are cheap and noisy: more trials. Large ones are >= 10.
  return 30 if nbytes < (1 << 20) else 10


# --- communication used by the harness itself ------------------------------------

def under_mpi_launcher() -> bool:
  """True when this process was started by mpirun/mpiexec/srun as an MPI rank."""
  keys = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "MPI_LOCALNRANKS")
  return any(k in os.environ for k in keys)


def import_mpi(*, plain: bool = False):
  """mpi4py's MPI, initialized with MPI_THREAD_MULTIPLE as mpijax.init() would
  (and, in a one-process world, with its Open MPI segment file unlinked at exit).

  ``plain``: mpi4py alone (its default is MPI_THREAD_MULTIPLE too), for a job
  that must not load mpijax (:func:`without_mpijax`).
  """
  if plain:
    from mpi4py import MPI
    return MPI
  from mpijax._src import mpi_util
  return mpi_util.import_mpi()


def without_mpijax(rows: Sequence[Row]) -> list[Row]:
  """The rows of a job that times a peer (mpi4jax) as its users run it: in a process
  that never loaded mpijax, whose import replaces some of JAX's lowering rules. If
  this one did, every figure is replaced by that reason."""
  if "mpijax" in sys.modules:
    for r in rows:
      r.cells = {s: "not measured: mpijax was loaded in this process" for s in r.cells}
  return list(rows)


class HarnessComm:
  """Barrier and reductions for the harness, on its own duplicate of COMM_WORLD."""

  def __init__(self, *, plain: bool = False):
    MPI = import_mpi(plain=plain)
    self.MPI = MPI
    self.comm = MPI.COMM_WORLD.Dup()
    self.rank = self.comm.Get_rank()
    self.size = self.comm.Get_size()

  def barrier(self) -> None:
    self.comm.Barrier()

  def max(self, value: float) -> float:
    return self.comm.allreduce(value, op=self.MPI.MAX)

  def gather(self, value: Any) -> list[Any] | None:
    return self.comm.gather(value, root=0)

  def bcast(self, value: Any) -> Any:
    return self.comm.bcast(value, root=0)

  def idle_barrier(self) -> None:
    """A barrier that sleeps instead of spinning: the waiting ranks must not
    take CPU from a nested job that rank 0 is running on the same cores."""
    req = self.comm.Ibarrier()
    while not req.Test():
      time.sleep(0.02)


# --- timing ---------------------------------------------------------------------

@dataclasses.dataclass
class Timing:
  median_us: float           # max over ranks of each rank's median
  rank_medians_us: list[float]
  iters: int                 # steps per trial
  trials: int
  per_op_divisor: int = 1    # steps count this many operations each
  best_us: float | None = None  # max over ranks of each rank's fastest trial (noise floor)
  cpu_us: float | None = None   # max over ranks of the median process CPU time (every thread) per op
  p10_us: float | None = None   # per-call timing only: max over ranks of each rank's 10th percentile
  p90_us: float | None = None   # per-call timing only: max over ranks of each rank's 90th percentile
  job_medians_us: list[float] | None = None  # combined over jobs (combine_jobs): each job's median

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def time_interleaved(steps: dict[str, tuple[Callable[[], Any], int]], hc: HarnessComm, *,
                     trials: int, trial_seconds: float = 0.005, warmup: int = 3,
                     max_iters: int = 20000) -> dict[str, Timing]:
  """Times several methods in round robin: trial t of every method, then trial t + 1.

  ``steps`` maps a key to ``(step, per_op_divisor)``. The CI VM's speed drifts
  by up to 3x for seconds at a time (the raw MPI baseline included); timing
  one method's trials back to back puts each method in a different period,
  while interleaving gives every method a trial in each period, so the
  medians compare methods under the same conditions.
  """
  iters: dict[str, int] = {}
  for key, (step, _) in steps.items():
    for _ in range(warmup):
      step()
    # Calibrate: a few timed steps, the fastest decides (less noisy than the mean).
    hc.barrier()
    probe = []
    for _ in range(3):
      t0 = time.perf_counter()
      step()
      probe.append(time.perf_counter() - t0)
    est = max(min(probe), 1e-7)
    iters[key] = int(hc.max(int(min(max_iters, max(1, math.ceil(trial_seconds / est))))))
  per_step: dict[str, list[float]] = {key: [] for key in steps}
  cpu_step: dict[str, list[float]] = {key: [] for key in steps}
  for _ in range(trials):
    for key, (step, _) in steps.items():
      n = iters[key]
      hc.barrier()
      c0, t0 = time.process_time(), time.perf_counter()
      for _ in range(n):
        step()
      per_step[key].append((time.perf_counter() - t0) / n)
      cpu_step[key].append((time.process_time() - c0) / n)
  out: dict[str, Timing] = {}
  for key, (_, per) in steps.items():
    mine = statistics.median(per_step[key]) * 1e6 / per
    gathered = hc.comm.allgather(mine)
    best = hc.max(min(per_step[key]) * 1e6 / per)
    cpu = hc.max(statistics.median(cpu_step[key]) * 1e6 / per)
    out[key] = Timing(median_us=max(gathered), rank_medians_us=gathered, iters=iters[key],
                      trials=trials, per_op_divisor=per, best_us=best, cpu_us=cpu)
  return out


def time_calls(steps: dict[str, tuple[Callable[[], Any], int]], hc: HarnessComm, *, calls: int,
               warmup: int = 10, rounds: int = 10, aligned: bool = False) -> dict[str, Timing]:
  """Times every call on its own: p10 / median / p90 over ``calls`` blocking calls per method.

  For tails, which a trial's mean hides. After ``warmup`` calls of each
  method, ``rounds`` rounds run ``calls / rounds`` calls of every method in
  turn, each method's run behind a barrier (interleaved for the reason given
  in :func:`time_interleaved`). With ``aligned`` every call has its own
  barrier first (not timed): each call starts with the ranks together and
  nothing of the previous call in flight. Each percentile is the max over
  ranks of the ranks' own percentiles; ``best_us`` is the fastest call.
  """
  import numpy as np
  for step, _ in steps.values():
    for _ in range(warmup):
      step()
  chunk = max(1, math.ceil(calls / rounds))
  times: dict[str, list[float]] = {key: [] for key in steps}
  for _ in range(rounds):
    for key, (step, _) in steps.items():
      hc.barrier()
      for _ in range(chunk):
        if aligned:
          hc.barrier()
        t0 = time.perf_counter()
        step()
        times[key].append(time.perf_counter() - t0)
  out: dict[str, Timing] = {}
  for key, (_, per) in steps.items():
    p10, p50, p90 = (float(v) * 1e6 / per for v in np.percentile(times[key], [10, 50, 90]))
    medians = hc.comm.allgather(p50)
    out[key] = Timing(median_us=max(medians), rank_medians_us=medians, iters=chunk, trials=rounds,
                      per_op_divisor=per, best_us=hc.max(min(times[key]) * 1e6 / per),
                      p10_us=hc.max(p10), p90_us=hc.max(p90))
  return out


# --- checking results ---------------------------------------------------------------

# A cell that holds this prefix instead of a figure was checked and found wrong:
# the script exits non-zero (``wrong_results``).
WRONG = "WRONG RESULT: "


class WrongResult(Exception):
  """A row's result differs from its reference; it is never timed."""


def check_close(got, want, what: str, *, rtol: float, atol: float = 0.0) -> None:
  """Raises WrongResult unless ``got`` matches ``want`` everywhere (NumPy's allclose)."""
  import numpy as np
  got = np.asarray(got, dtype=np.float64)
  want = np.broadcast_to(np.asarray(want, dtype=np.float64), got.shape)
  bad = ~np.isclose(got, want, rtol=rtol, atol=atol)
  if got.shape != np.shape(want) or bad.any():
    i = int(np.argmax(bad.ravel())) if bad.any() else 0
    raise WrongResult(f"{what}: {int(bad.sum())} of {got.size} elements differ (rtol {rtol:g}, "
                      f"atol {atol:.3g}); first at flat index {i}: got {float(got.ravel()[i])!r}, "
                      f"expected {float(want.ravel()[i])!r}")


def wrong_results(rows: Sequence[Row]) -> list[str]:
  """One line per cell whose result was wrong."""
  return [f"{r.label} [{k}]: {v[len(WRONG):]}" for r in rows for k, v in r.cells.items()
          if isinstance(v, str) and v.startswith(WRONG)]


def exit_status(rows: Sequence[Row]) -> int:
  """1 (and the wrong cells on stderr) if any result was wrong, else 0."""
  bad = wrong_results(rows)
  for line in bad:
    print(f"wrong result: {line}", file=sys.stderr, flush=True)
  return 1 if bad else 0


# --- rows and results -------------------------------------------------------------

@dataclasses.dataclass
class Row:
  """One method measured over the sizes: ``cells[nbytes]`` is a Timing or a skip reason."""
  key: str
  label: str
  phase: str
  cells: dict[int, Timing | str] = dataclasses.field(default_factory=dict)
  note: str = ""

  def us(self, nbytes: int, stat: str = "median") -> float | None:
    """The cell's figure: "median" (the reported one), "best" (fastest trial),
    "cpu" (the median trial's process CPU time per op), or "p10" / "p90"
    (percentiles of single calls, where the row was timed call by call)."""
    c = self.cells.get(nbytes)
    if not isinstance(c, Timing):
      return None
    return {"best": c.best_us, "cpu": c.cpu_us, "p10": c.p10_us, "p90": c.p90_us}.get(stat, c.median_us)

  def to_json(self) -> dict[str, Any]:
    return {"key": self.key, "label": self.label, "phase": self.phase, "note": self.note,
            "cells": {str(k): (v.to_json() if isinstance(v, Timing) else {"skipped": v})
                      for k, v in self.cells.items()}}

  @classmethod
  def from_json(cls, d: dict[str, Any]) -> Row:
    cells: dict[int, Timing | str] = {}
    for k, v in d["cells"].items():
      cells[int(k)] = v["skipped"] if "skipped" in v else Timing(**v)
    return cls(d["key"], d["label"], d["phase"], cells, d.get("note", ""))


def environment_info() -> dict[str, Any]:
  info: dict[str, Any] = {
      "date": datetime.datetime.now().isoformat(timespec="seconds"),
      "host": socket.gethostname(),
      "python": platform.python_version(),
      "machine": platform.machine(),
      "cpus": os.cpu_count(),
      # Other jobs on the machine inflate every figure; keep the evidence.
      "loadavg_1_5_15": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
      # Read without importing mpijax: a peer's job must not load it.
      "glibc_env": {k: v for k, v in os.environ.items()
                    if k == "GLIBC_TUNABLES" or k.startswith("MALLOC_")},
      "mpijax_loaded": "mpijax" in sys.modules,
  }
  for mod in ("jax", "jaxlib", "numpy", "mpi4py", "mpi4jax", "mpijax"):
    try:
      from importlib import metadata
      info[mod] = metadata.version(mod)
    except Exception:  # not installed
      info[mod] = None
  try:
    MPI = import_mpi() if "mpi4py.MPI" in sys.modules else None
    if MPI is not None:
      info["mpi_library"] = MPI.Get_library_version().splitlines()[0].strip()
      info["mpi_thread_level"] = MPI.Query_thread()
  except Exception:
    pass
  return info


# --- phases in separate mpirun jobs -------------------------------------------------

def glibc_env() -> dict[str, str]:
  """The glibc variables ``mpijax-run`` would export to its ranks (heap reuse,
  huge pages; the user's own settings win). Every phase gets them, every row
  alike, so the figures are what an ``mpijax-run`` user gets."""
  from mpijax._src import heap
  return dict(heap.launcher_env(dict(os.environ)))


def launcher_free_env(overrides: dict[str, str] | None = None) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_ENV_PREFIXES)}
  env.update(glibc_env())
  env.update(overrides or {})
  return env


def mpirun_command(nprocs: int, argv: Sequence[str], *, timeout: float) -> list[str]:
  return (["timeout", "--kill-after=10", str(int(timeout)), "mpirun", "--allow-run-as-root",
           "--oversubscribe", "-n", str(nprocs)] + list(argv))


def run_phase(script: str, nprocs: int, phase: str, args: Sequence[str], *,
              env: dict[str, str] | None = None, timeout: float = 600,
              verbose: bool = True) -> tuple[list[Row], dict[str, Any]] | str:
  """Runs ``script --phase phase`` under a fresh ``mpirun -n nprocs``.

  Returns the rows and the phase's metadata, or a one-line reason on failure
  (non-zero exit, timeout), so the caller can print it in the table.
  """
  with tempfile.TemporaryDirectory(prefix="mpijax-bench-") as tmp:
    out = os.path.join(tmp, f"{phase}.json")
    argv = [sys.executable, script, "--phase", phase, "--phase-out", out] + list(args)
    cmd = mpirun_command(nprocs, argv, timeout=timeout)
    if verbose:
      envtxt = " ".join(f"{k}={v}" for k, v in (env or {}).items())
      print(f"# phase {phase}: {envtxt + ' ' if envtxt else ''}{shlex.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=launcher_free_env(env), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    took = time.perf_counter() - t0
    if verbose and proc.stdout.strip():
      for line in proc.stdout.rstrip().splitlines():
        print(f"#   [{phase}] {line}", flush=True)
    if proc.returncode != 0 or not os.path.exists(out):
      reason = ("timed out after %ds" % timeout if proc.returncode in (124, 137)  # noqa: UP031
                else f"exit code {proc.returncode}")
      tail = [l for l in proc.stdout.strip().splitlines() if l.strip()][-1:] or [""]
      return f"phase {phase!r} failed ({reason}): {tail[0][:200]}"
    with open(out) as f:
      data = json.load(f)
  if verbose:
    print(f"# phase {phase}: done in {took:.0f} s", flush=True)
  return [Row.from_json(r) for r in data["rows"]], data.get("meta", {})


def _median_or_none(values) -> float | None:
  known = [v for v in values if v is not None]
  return statistics.median(known) if known else None


def combine_jobs(jobs: Sequence[Sequence[Row]]) -> list[Row]:
  """One row per key from the same rows measured in several jobs.

  A cell's figures are the medians over the jobs of each job's figures (the
  fastest trial: the fastest of all), and ``job_medians_us`` keeps each job's
  median in job order, so a target can show its spread. A cell that any job
  could not time keeps that job's reason (a wrong result first): a failure
  is never averaged away.
  """
  if len(jobs) == 1:
    return list(jobs[0])
  out: list[Row] = []
  for first in jobs[0]:
    same = [next((r for r in rows if r.key == first.key), None) for rows in jobs]
    row = Row(first.key, first.label, first.phase, {}, first.note)
    for size in first.cells:
      cells = [r.cells.get(size, "not measured in every job") if r else "not measured in every job"
               for r in same]
      failed = sorted((c for c in cells if not isinstance(c, Timing)),
                      key=lambda c: not c.startswith(WRONG))  # a wrong result first
      if failed:
        row.cells[size] = failed[0]
        continue
      row.cells[size] = Timing(
        median_us=statistics.median(c.median_us for c in cells),
        rank_medians_us=[statistics.median(v) for v in zip(*(c.rank_medians_us for c in cells))],
        iters=cells[0].iters,
        trials=sum(c.trials for c in cells),
        per_op_divisor=cells[0].per_op_divisor,
        best_us=min((c.best_us for c in cells if c.best_us is not None), default=None),
        cpu_us=_median_or_none(c.cpu_us for c in cells),
        p10_us=_median_or_none(c.p10_us for c in cells),
        p90_us=_median_or_none(c.p90_us for c in cells),
        job_medians_us=[c.median_us for c in cells],
      )
    out.append(row)
  return out


class Targets:
  """A script's targets over its rows, as PASS / FAIL / N/A lines."""

  def __init__(self, rows: Sequence[Row]):
    self.by = {r.key: r for r in rows}
    self.lines: list[str] = []

  def get(self, key: str, size: int) -> float | None:
    r = self.by.get(key)
    return r.us(size) if r else None

  def jobs(self, key: str, size: int) -> list[float] | None:
    """Each job's median, where the rows were combined over jobs."""
    r = self.by.get(key)
    c = r.cells.get(size) if r else None
    return c.job_medians_us if isinstance(c, Timing) else None

  def line(self, ok: bool | None, text: str) -> None:
    self.lines.append(("N/A " if ok is None else "PASS" if ok else "FAIL") + f"  {text}")

  def ratio(self, what: str, num: float | None, den: float | None, limit: float, *,
            at_least: bool = False, extra: str = "") -> float | None:
    """The line of a target on ``num / den`` (µs each): both figures and the ratio, judged
    as printed (:func:`judged`). Returns the ratio, or None if a figure is missing."""
    if num is None or den is None or not den:
      self.line(None, f"{what}: missing")
      return None
    ok, shown = judged(num / den, limit, at_least=at_least)
    self.line(ok, f"{what}: {num:.1f} / {den:.1f} us = {shown}x{extra}")
    return num / den

  def at_most(self, what: str, value: float | None, limit: float, unit: str = "us") -> None:
    """The line of a target on one figure, judged as printed."""
    if value is None:
      self.line(None, f"{what}: missing")
      return
    ok, shown = judged(value, limit, decimals=2)
    self.line(ok, f"{what}: {shown} {unit}")


def judged(value: float, limit: float, *, at_least: bool = False,
           decimals: int = 3) -> tuple[bool, str]:
  """(whether ``value`` meets ``limit``, ``value`` as printed with ``decimals`` decimals).

  The verdict is taken on the printed figure, so the two cannot disagree (a
  ratio of 1.1019 against a 1.1 limit prints as 1.102, FAIL; never "1.10 FAIL").
  """
  shown = f"{value:.{decimals}f}"
  printed = float(shown)
  return (printed >= limit if at_least else printed <= limit), shown


def write_phase_output(path: str, rows: Sequence[Row], meta: dict[str, Any]) -> None:
  with open(path, "w") as f:
    json.dump({"rows": [r.to_json() for r in rows], "meta": meta}, f, indent=1)


def finish_phase(path: str | None, rows: Sequence[Row], meta: dict[str, Any] | None = None) -> int:
  """Ends a sub-job (``--phase``): rank 0 writes its rows for the orchestrating run."""
  from mpi4py import MPI
  if MPI.COMM_WORLD.Get_rank() == 0 and path:
    write_phase_output(path, rows, environment_info() if meta is None else meta)
  return 0


# --- reporting ---------------------------------------------------------------------

def _fmt_us(v: float | None) -> str:
  if v is None:
    return "–"
  if v >= 1000:
    return f"{v:,.0f}"
  if v >= 100:
    return f"{v:.0f}"
  if v >= 10:
    return f"{v:.1f}"
  return f"{v:.2f}"


def _fmt_ratio(v: float | None) -> str:
  if v is None:
    return "–"
  return f"{v:.3f}×" if v < 0.1 else f"{v:.2f}×"


def markdown_table(rows: Sequence[Row], sizes: Sequence[int], *,
                   ratio_to: Row | None = None, title: str = "method",
                   stat: str = "median") -> str:
  """Times (or, with ``ratio_to``, time / that row's time) as a Markdown table."""
  head = f"| {title} | " + " | ".join(fmt_size(s) for s in sizes) + " |"
  sep = "|---|" + "---:|" * len(sizes)
  lines = [head, sep]
  for r in rows:
    cells = []
    for s in sizes:
      v = r.us(s, stat)
      if ratio_to is not None:
        base = ratio_to.us(s, stat)
        cells.append(_fmt_ratio(v / base if v is not None and base else None))
      else:
        cells.append(_fmt_us(v))
    lines.append(f"| {r.label} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def skip_notes(rows: Sequence[Row]) -> list[str]:
  """One line per distinct reason a row has no figure."""
  notes = []
  for r in rows:
    reasons = sorted({v for v in r.cells.values() if isinstance(v, str)})
    for reason in reasons:
      notes.append(f"- {r.label}: {reason}")
  return notes


def write_report(out_dir: str, name: str, text: str, record: dict[str, Any], rows: Sequence[Row],
                 sizes: Sequence[int], title: str, **plot_kw: Any) -> None:
  """Writes ``name``.md (``text``), .json (``record``) and .png (``plot``) to ``out_dir``."""
  os.makedirs(out_dir, exist_ok=True)
  base = os.path.join(out_dir, name)
  with open(base + ".md", "w") as f:
    f.write(text + "\n")
  with open(base + ".json", "w") as f:
    json.dump(record, f, indent=1)
  why = plot(rows, sizes, base + ".png", title, **plot_kw)
  print(f"\nwrote {base}.md, {base}.json" + (f"; {why}" if why else f", {base}.png"), flush=True)


def plot(rows: Sequence[Row], sizes: Sequence[int], path: str, title: str, *,
         xlabel: str = "message size per rank (float32)") -> str | None:
  """Log-log time-vs-size PNG; returns a reason instead if matplotlib is missing."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except Exception as e:  # optional dependency
    return f"no plot: matplotlib not importable ({e})"
  fig, ax = plt.subplots(figsize=(8, 5.5))
  markers = "os^vD<>phx*+"
  for i, r in enumerate(rows):
    pts = [(s, r.us(s)) for s in sizes if r.us(s) is not None]
    if not pts:
      continue
    xs, ys = zip(*pts)
    ax.plot(xs, ys, marker=markers[i % len(markers)], label=r.label)
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xticks(list(sizes))
  ax.set_xticklabels([fmt_size(s) for s in sizes])
  ax.set_xlabel(xlabel)
  ax.set_ylabel("median time per operation (µs, max over ranks)")
  ax.set_title(title)
  return save_plot(fig, ax, path)


def save_plot(fig, ax, path: str) -> None:
  """The common finish of every benchmark plot: grid, legend, PNG at ``path``."""
  import matplotlib.pyplot as plt
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return None


def default_out_dir() -> str:
  return os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def load_note() -> str:
  """One line on machine load now; a busy machine makes every row slower and noisier."""
  if not hasattr(os, "getloadavg"):
    return ""
  one, five, _ = os.getloadavg()
  cpus = os.cpu_count() or 1
  warn = " (busy machine: figures are inflated and noisy)" if one > cpus else ""
  from mpijax._src import heap
  # What the phases ran with: the caller's own glibc variables, else mpijax-run's.
  env = launcher_free_env()
  names = sorted(k for k in ("GLIBC_TUNABLES",) + heap.MALLOC_ENV_NAMES if k in env)
  glibc = " ".join(f"{k}={env[k]}" for k in names)
  return (f"Load average {one:.1f} / {five:.1f} (1 / 5 min) on {cpus} CPUs at the end of the run{warn}."
          + (f" Every phase ran with these glibc settings: `{glibc}`." if glibc else ""))
