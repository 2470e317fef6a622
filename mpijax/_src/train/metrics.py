"""Cross-rank metric means, and logging / progress bars on rank 0 only."""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpijax._src import mpi_util
from mpijax._src.train import communicator


def _is_traced(leaves: list[Any]) -> bool:
  return any(isinstance(x, jax.core.Tracer) for x in leaves)


def mean_metrics(tree: Any, *, comm: Any | None = None) -> Any:
  """The mean of every leaf over all ranks.

  Eagerly (host values, e.g. after a step): one ``MPI_Allreduce`` of all
  leaves packed as float64; returns Python floats for scalars and float64
  NumPy arrays otherwise. Inside ``jax.jit``: the fused
  :func:`mpijax.train.allreduce_gradients` machinery (one ``mpijax.ops.allreduce``
  per dtype); float leaves keep their dtype, integer and bool leaves (counts,
  flags) give float32 means rather than a floored integer.

  Args:
    tree: a pytree of numbers or arrays (same structure on every rank).
    comm: an mpi4py communicator; default mpijax's.

  Returns:
    The tree of cross-rank means.

  Raises:
    ValueError: eagerly, on every rank, when the ranks' trees differ (keys
      or shapes).
    TypeError: eagerly, on every rank, when a leaf is not a number.

  Examples:
    >>> means = mpijax.train.mean_metrics({"loss": loss, "accuracy": acc})  # doctest: +SKIP
  """
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  if _is_traced(leaves):
    from mpijax._src.train import gradients

    # A metric's mean is a fraction: integer and bool leaves (counts, flags)
    # are averaged as float32, not floored in their own dtype.
    leaves = [
      x if jnp.issubdtype(jnp.result_type(x), jnp.inexact) else jnp.asarray(x, jnp.float32)
      for x in leaves
    ]
    return gradients.fused_allreduce(
      jax.tree_util.tree_unflatten(treedef, leaves), average=True, comm=comm, overlap=False
    )
  comm = communicator.get_comm(comm, "mpijax.train.mean_metrics")
  arrays, problem = [], ""
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    try:
      arrays.append(np.asarray(x, dtype=np.float64))
    except (TypeError, ValueError) as e:
      # Not raised here: the other ranks would wait in the check below.
      problem = (
        f"leaf {jax.tree_util.keystr(path)} = {x!r:.60} is not a number ({e}); "
        "pass numbers or numeric arrays"
      )
      break
  _check_same_tree(comm, treedef, arrays, problem)
  if problem:  # the same on every rank, so every rank raises it
    raise TypeError(f"mpijax.train.mean_metrics: {problem}")
  flat = np.concatenate([a.reshape(-1) for a in arrays]) if arrays else np.zeros(0)
  total = np.empty_like(flat)
  MPI = mpi_util.import_mpi()
  comm.Allreduce([flat, MPI.DOUBLE], [total, MPI.DOUBLE], op=MPI.SUM)
  total /= comm.Get_size()
  out, offset = [], 0
  for a in arrays:
    v = total[offset : offset + a.size].reshape(a.shape)
    offset += a.size
    out.append(float(v) if v.ndim == 0 else v)
  return jax.tree_util.tree_unflatten(treedef, out)


def _check_same_tree(comm: Any, treedef: Any, arrays: list[np.ndarray], problem: str = "") -> None:
  """Every rank raises if the ranks' trees differ (keys or shapes): the sum
  that follows would otherwise mix up different metrics silently. A rank
  whose tree could not be converted passes its ``problem`` instead."""
  diff = mpi_util.first_difference(comm, problem or f"{treedef} shapes={[a.shape for a in arrays]}")
  if diff is not None:
    first, rank, other = diff
    raise ValueError(
      f"mpijax.train.mean_metrics needs the same tree on every rank, but rank 0 passed "
      f"{first} and rank {rank} passed {other}. Give every rank the same metric "
      "names and shapes (e.g. 0.0 for a metric a rank does not have)."
    )


def is_main_process(comm: Any | None = None) -> bool:
  """True on rank 0 (and in a plain single process)."""
  return communicator.rank_and_size(comm)[0] == 0


def log(*args: Any, comm: Any | None = None, **kwargs: Any) -> None:
  """``print`` on rank 0 only (flushed, so it interleaves sensibly with MPI output).

  Not collective: the other ranks return at once. Works before
  ``mpijax.init()`` and in a plain process (which counts as rank 0).

  Args:
    *args: what ``print`` prints.
    comm: the mpi4py communicator whose rank 0 prints (default mpijax's).
    **kwargs: ``print``'s keyword arguments (``flush`` defaults to True).

  Examples:
    >>> mpijax.train.log(f"epoch {epoch}: loss {loss:.4f}")  # doctest: +SKIP
  """
  if is_main_process(comm):
    kwargs.setdefault("flush", True)
    print(*args, **kwargs)


def progress(
  iterable: Iterable[Any], *, comm: Any | None = None, **tqdm_kwargs: Any
) -> Iterable[Any]:
  """A ``tqdm`` progress bar on rank 0; the plain iterable on every other rank.

  ``total`` defaults to ``len(iterable)`` (``shard_batches`` has one). Needs
  ``tqdm`` only on rank 0, and only if it is installed; otherwise the
  iterable is returned unchanged.

  Under a launcher (``mpirun``, ``mpijax-run``, ``srun``) and whenever the
  output is no terminal, the bar is written as whole lines: the launchers
  pass a rank's output on line by line, so a bar redrawn in place with
  carriage returns would show nothing until the loop ends (and Open MPI
  gives the rank a terminal 0 columns wide, in which tqdm draws nothing at
  all). A line is written at most every ``mininterval`` seconds (default 5
  there) and once at the end, as wide as ``COLUMNS`` (else 80). Its rate
  and time left count from the end of the first item, which holds the
  compilation of a jitted step; until a second item ends, it shows none.

  Args:
    iterable: what to iterate over.
    comm: the mpi4py communicator whose rank 0 shows the bar (default
      mpijax's; a plain process counts as rank 0).
    **tqdm_kwargs: ``tqdm``'s keyword arguments (``desc``, ``total``,
      ``mininterval``, ...).

  Returns:
    On rank 0 a ``tqdm`` bar (or a generator writing it as lines) over
    ``iterable``; elsewhere ``iterable`` itself.

  Examples:
    >>> for batch in mpijax.train.progress(batches, desc=f"epoch {e}"):  # doctest: +SKIP
    ...   state, metrics = dp.step(state, batch)
  """
  if not is_main_process(comm):
    return iterable
  try:
    from tqdm.auto import tqdm
  except ImportError:
    return iterable
  tqdm_kwargs.setdefault("file", sys.stdout)
  if _line_mode(tqdm_kwargs["file"]):
    return _lines(iterable, tqdm, **tqdm_kwargs)
  tqdm_kwargs.setdefault("dynamic_ncols", True)
  return tqdm(iterable, **tqdm_kwargs)


def _line_mode(file: Any) -> bool:
  """True where a bar redrawn in place would not show: no terminal, or under a launcher."""
  try:
    if not file.isatty() or os.get_terminal_size(file.fileno()).columns <= 0:
      return True
  except (AttributeError, OSError, ValueError):
    return True
  return communicator.launcher() is not None


def _lines(
  iterable: Iterable[Any],
  tqdm: Any,
  *,
  file: Any,
  desc: str | None = None,
  total: int | None = None,
  unit: str = "it",
  disable: bool = False,
  mininterval: float = 5.0,
  ncols: int | None = None,
  **_: Any,
) -> Iterator[Any]:
  """``iterable``, writing tqdm's bar as one line every ``mininterval`` seconds and at the end."""
  if disable:
    yield from iterable
    return
  if total is None:
    try:
      total = len(iterable)  # type: ignore[arg-type]
    except TypeError:
      total = None
  width = ncols or shutil.get_terminal_size((80, 24)).columns

  first_done: float | None = None  # when the first item (the compilation) ended

  def line(n: int, now: float) -> None:
    # The first item's time is mostly compilation: the rate (and so the time
    # left) is that of the items after it, none until there is one.
    steady = now - first_done if first_done is not None and n > 1 else 0.0
    elapsed = now - start
    if steady > 0 or n == 0:
      rate = (n - 1) / steady if steady > 0 else None
      bar = tqdm.format_meter(
        n, total, elapsed, ncols=width, prefix=desc or "", unit=unit, rate=rate
      )
    else:  # tqdm would take the compilation for the rate: "?" until a second item
      bar = tqdm.format_meter(n, total, 0, ncols=width, prefix=desc or "", unit=unit)
      bar = bar.replace("[00:00", "[" + tqdm.format_interval(elapsed), 1)
    print(bar, file=file, flush=True)

  start = last = time.monotonic()
  n = shown = 0
  for item in iterable:
    yield item
    n += 1
    now = time.monotonic()
    if n == 1:
      first_done = now
    if now - last >= mininterval:
      line(n, now)
      last, shown = now, n
  if shown != n or n == 0:
    line(n, time.monotonic())
