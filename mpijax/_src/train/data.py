"""``shard_batches``: every rank its own part of each global batch, same step count everywhere.

The classic multi-process hang: one rank runs out of data a step earlier than
the others and stops calling the all-reduce, so they wait forever. Here the
number of steps is fixed before the first batch, identically on every rank,
and a batch that runs short is padded with masked samples instead of being
shorter.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

from mpijax._src import mpi_util
from mpijax._src.runtime import state as runtime
from mpijax._src.train import communicator


class Batch(NamedTuple):
  """One rank's part of one global batch.

  Attributes:
    data: the same pytree as the input arrays, each leaf with leading
      dimension ``global_batch_size // process_count``.
    mask: float32, 1 for real samples, 0 for padding.
    weight: float32, ``mask * global_batch_size / real samples in the global
      batch``. ``jnp.mean(weight * per_example_loss)`` on every rank, averaged
      over ranks (``allreduce_gradients(average=True)``), is exactly the mean
      loss over the real samples of the global batch, also for the padded
      last batch. For a full batch ``weight == mask == 1``.
  """
  data: Any
  mask: np.ndarray
  weight: np.ndarray


def _leading_size(arrays: Any, what: str = "shard_batches") -> int:
  """The common leading (sample) dimension of every leaf; ``what`` names the caller in errors."""
  with_paths = jax.tree_util.tree_flatten_with_path(arrays)[0]
  if not with_paths:
    raise ValueError(f"{what} got an empty tree of arrays")
  sizes = {}
  for path, leaf in with_paths:
    shape = np.shape(leaf)
    if len(shape) == 0:
      raise ValueError(f"{what}: leaf {jax.tree_util.keystr(path)} is a scalar; "
                       "every leaf needs a leading sample dimension")
    sizes[jax.tree_util.keystr(path)] = shape[0]
  if len(set(sizes.values())) != 1:
    raise ValueError(f"{what}: leaves have different numbers of samples: {sizes}; "
                     "every leaf must have the same leading dimension")
  return next(iter(sizes.values()))


def _raise_everywhere(comm: Any, error: Exception | None, what: str) -> None:
  """Collective, once some rank sent -1: raises ``error`` on the rank that has
  one, and on every other rank a ValueError naming the failed ranks."""
  bad = mpi_util.rank_problems(comm, "" if error is None else f"{type(error).__name__}: {error}")
  if error is not None:
    raise error
  raise ValueError(f"{what} failed on other ranks, so every rank stops here:\n"
                   f"{mpi_util.rank_lines(bad)}")


class ShardedBatches:
  """The iterator returned by :func:`shard_batches` (``len()`` = steps left).

  Build it with :func:`shard_batches`, which takes the same arguments and
  says what they mean; ``step`` is the index of the next batch.

  Args:
    arrays: a pytree of arrays with a common leading sample dimension.
    global_batch_size: samples per step over all ranks.
    seed: shuffling seed, or None for the data order.
    epoch: epoch number, mixed into the shuffle.
    drop_remainder: skip the last partial batch instead of padding it.
    replicated: whether every rank holds the same full dataset.
    start_step: the first step to yield (resume mid-epoch).
    process_index: this rank (default: the communicator's).
    process_count: number of ranks (default: the communicator's size).
    comm: mpi4py communicator (default mpijax's).
  """

  def __init__(self, arrays: Any, global_batch_size: int, *, seed: int | None, epoch: int,
               drop_remainder: bool = False, replicated: bool = True, start_step: int = 0,
               process_index: int | None = None, process_count: int | None = None,
               comm: Any | None = None):
    if process_index is None or process_count is None:
      if comm is None and not replicated and runtime.is_initialized():
        comm = communicator.get_comm(None, "mpijax.train.shard_batches(replicated=False)")
      rank, size = communicator.rank_and_size(comm)
      process_index = rank if process_index is None else process_index
      process_count = size if process_count is None else process_count
    # With replicated=False the ranks meet in an allgather below; a rank whose
    # arguments or data are bad must still take part, or the others would wait
    # there forever. Its error is raised after the exchange, on every rank.
    # With replicated=True they meet at the first batch (the size check), so
    # a rank whose own data is unusable keeps its error for that meeting.
    error: Exception | None = None
    self._error: Exception | None = None
    reading_data = False
    try:
      if not isinstance(global_batch_size, (int, np.integer)) or global_batch_size < 1:
        raise ValueError(f"global_batch_size={global_batch_size!r} must be a positive integer")
      if global_batch_size % process_count:
        lower = global_batch_size // process_count * process_count
        upper = lower + process_count
        hint = f"{upper}" if lower == 0 else f"{lower} or {upper}"
        raise ValueError(
            f"global_batch_size={global_batch_size} is not divisible by process_count={process_count}; "
            f"every rank must get the same number of samples per step: use a multiple of "
            f"{process_count} (e.g. {hint})")
      for name, value in (("seed", seed), ("epoch", epoch)):
        # NumPy's own message ("expected non-negative integer") names neither.
        if not (value is None and name == "seed") and (
            not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0):
          raise ValueError(f"shard_batches: {name}={value!r} must be a non-negative integer"
                           + (" (or None to keep the data order)" if name == "seed" else ""))
      if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} is outside 0..{process_count - 1}")
      self.global_batch_size = int(global_batch_size)
      self.local_batch_size = self.global_batch_size // process_count
      self.process_index, self.process_count = process_index, process_count
      self.replicated = replicated
      # Host copies once: indexing NumPy is cheap and keeps device memory free.
      reading_data = True
      self._arrays = jax.tree_util.tree_map(np.asarray, arrays)
      n_local = _leading_size(self._arrays)
    except (ValueError, TypeError) as e:
      if process_count == 1 or (replicated and not (
          reading_data and self._will_check_size(comm, process_count))):
        raise
      error, n_local = e, -1

    if replicated:
      # A rank whose data is unusable has no steps; its first batch raises
      # the error, and every other rank's first batch names this rank.
      self._error = error
      n = max(n_local, 0)
      order = (np.arange(n) if seed is None
               else np.random.default_rng([int(seed), int(epoch)]).permutation(n))
      G = self.global_batch_size
      steps = n // G if drop_remainder else -(-n // G)
      self._order = order
      self.num_samples = n
    else:
      # Every rank holds its own samples. One small allgather of the counts
      # lets every rank compute the same step count and the global count of
      # real samples in each step, without moving any data.
      if comm is None and process_count > 1:
        comm = communicator.get_comm(None, "mpijax.train.shard_batches(replicated=False)")
      counts = mpi_util.allgather_int(comm, n_local) if process_count > 1 else [n_local]
      if error is not None or min(counts) < 0:
        _raise_everywhere(comm, error, "shard_batches(replicated=False)")
      if len(counts) != process_count:
        raise ValueError(f"process_count={process_count} but the communicator has {len(counts)} ranks")
      self.counts = counts
      self.num_samples = sum(counts)
      B = self.local_batch_size
      steps = (min(c // B for c in counts) if drop_remainder
               else max(-(-c // B) for c in counts))
      self._order = (np.arange(n_local) if seed is None else np.random.default_rng(
          [int(seed), int(epoch), process_index]).permutation(n_local))
    self.num_steps = int(steps)
    # Replicated data must really be the same size everywhere, or the ranks
    # would run different step counts: checked (one allgather) when the
    # iteration starts, where every rank takes part, not in len().
    self._comm = comm
    self._size_checked = not (replicated and process_count > 1)
    if not 0 <= start_step <= self.num_steps:
      raise ValueError(f"start_step={start_step} is outside 0..{self.num_steps} (steps in this epoch)")
    self._step = int(start_step)

  def __len__(self) -> int:
    return self.num_steps - self._step

  def __iter__(self) -> Iterator[Batch]:
    return self

  @property
  def step(self) -> int:
    """Index (within the epoch) of the next batch; save it to resume mid-epoch."""
    return self._step

  def _indices(self, step: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(local indices, mask, real samples in the global batch) for one step."""
    B, G, r = self.local_batch_size, self.global_batch_size, self.process_index
    if self.replicated:
      # Pad the *global* batch (with its first sample), then slice: the padded
      # global batch is then the same for any rank count.
      take = self._order[step * G:(step + 1) * G]
      real_global = take.size
      idx = np.full(G, take[0], np.int64)
      idx[:take.size] = take
      mask = np.zeros(G, np.float32)
      mask[:take.size] = 1.0
      idx, mask = idx[r * B:(r + 1) * B], mask[r * B:(r + 1) * B]
    else:
      real_global = sum(max(0, min(B, c - step * B)) for c in self.counts)
      take = self._order[step * B:(step + 1) * B]
      mask = np.zeros(B, np.float32)
      mask[:take.size] = 1.0
      idx = np.zeros(B, np.int64)
      idx[:take.size] = take
      if 0 < take.size < B:
        idx[take.size:] = take[0]  # padding repeats a real sample; the mask hides it
    return idx, mask, real_global

  @staticmethod
  def _size_check_comm(comm: Any | None, process_count: int) -> Any | None:
    """The communicator of the replicated size check, None where none runs."""
    if comm is None:
      if not runtime.is_initialized():
        return None  # process_index/process_count given by hand, no MPI job
      comm = communicator.get_comm(None, "mpijax.train.shard_batches")
    return comm if comm.Get_size() == process_count else None

  @classmethod
  def _will_check_size(cls, comm: Any | None, process_count: int) -> bool:
    return process_count > 1 and cls._size_check_comm(comm, process_count) is not None

  def _check_replicated_size(self) -> None:
    self._size_checked = True
    comm = self._size_check_comm(self._comm, self.process_count)
    if comm is None:
      return
    error = self._error
    counts = mpi_util.allgather_int(comm, -1 if error is not None else self.num_samples)
    if min(counts) < 0:
      _raise_everywhere(comm, error, "shard_batches")
    if len(set(counts)) > 1:
      raise ValueError(
          f"shard_batches(replicated=True) expects the same full dataset on every rank, but "
          f"the ranks hold {counts} samples (rank i: counts[i]), so they would run different "
          f"step counts and hang. Pass replicated=False when each rank holds its own samples.")

  def __next__(self) -> Batch:
    if not self._size_checked:
      self._check_replicated_size()
    if self._step >= self.num_steps:
      raise StopIteration
    idx, mask, real_global = self._indices(self._step)
    self._step += 1
    # A rank without any local sample (uneven data) sends zeros, all masked.
    data = jax.tree_util.tree_map(
        lambda a: a[idx] if a.shape[0] else np.zeros((idx.size,) + a.shape[1:], a.dtype),
        self._arrays)
    weight = mask * np.float32(self.global_batch_size / real_global) if real_global else mask.copy()
    return Batch(data, mask, weight.astype(np.float32))


def shard_batches(arrays: Any, global_batch_size: int, *, seed: int | None, epoch: int,
                  drop_remainder: bool = False, replicated: bool = True, start_step: int = 0,
                  process_index: int | None = None, process_count: int | None = None,
                  comm: Any | None = None) -> ShardedBatches:
  """Yields this rank's part of each global batch; every rank yields the same number.

  With ``replicated=True`` (the common case: every rank holds the same full
  dataset) the epoch order is a permutation of all samples drawn from
  ``(seed, epoch)`` alone, so it is the same for any rank count. Global batch
  ``s`` is samples ``order[s*G:(s+1)*G]``; rank ``r`` gets the ``r``-th slice
  of ``G / process_count`` of them. Across ranks an epoch covers every sample
  exactly once. The last, partial global batch is padded to full size and the
  padding is masked out (``drop_remainder=True`` skips it instead).

  With ``replicated=False`` each rank holds its own samples, possibly a
  different number per rank. The ranks exchange their counts once (one small
  allgather) and all run ``max(ceil(count / local_batch))`` steps; a rank
  that runs out pads with masked samples, so every sample is used once per
  epoch and nobody leaves the all-reduce early. (``drop_remainder=True``:
  ``min(count // local_batch)`` full steps.) The local order is shuffled from
  ``(seed, epoch, rank)``.

  Every rank raises together when one rank's data is unusable (e.g. leaves
  with different sample counts): with ``replicated=False`` at construction,
  with ``replicated=True`` at the first batch, where the ranks meet anyway
  (the bad rank's ``len()`` is 0 until then).

  Args:
    arrays: a pytree of arrays with a common leading sample dimension.
    global_batch_size: samples per step over all ranks; must be divisible by
      the number of ranks.
    seed: shuffling seed; ``None`` keeps the data order (evaluation).
    epoch: epoch number, mixed into the shuffle.
    drop_remainder: skip the last partial batch instead of padding it.
    replicated: whether every rank holds the same full dataset (see above).
    start_step: skip this many steps of the epoch (resume mid-epoch).
    process_index: this rank (default: the communicator's / runtime's rank).
    process_count: number of ranks (default: the communicator's size).
    comm: mpi4py communicator; needed only for ``replicated=False``.

  Returns:
    An iterator of :class:`Batch` ``(data, mask, weight)``; ``len()`` is the
    number of steps left.

  Raises:
    ValueError: ``global_batch_size`` is not a positive multiple of the rank
      count, ``seed`` or ``epoch`` is not a non-negative integer, or
      ``start_step`` is beyond the epoch. Also when a rank's data is
      unusable (leaves with different sample counts; with
      ``replicated=True``, ranks holding different sample counts), then on
      every rank, as said above.

  Examples:
    >>> for x, mask, w in mpijax.train.shard_batches((images, labels), 128, seed=0, epoch=e):  # doctest: +SKIP
    ...   state, metrics = step(state, x, w)
  """
  return ShardedBatches(arrays, global_batch_size, seed=seed, epoch=epoch,
                        drop_remainder=drop_remainder, replicated=replicated,
                        start_step=start_step, process_index=process_index,
                        process_count=process_count, comm=comm)
