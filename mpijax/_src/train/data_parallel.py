"""``DataParallel``: the common data-parallel loop in a few lines."""

from __future__ import annotations

import collections.abc
import contextlib
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpijax._src import mpi_util
from mpijax._src.ops import communicators
from mpijax._src.train import _host
from mpijax._src.train import broadcast as _bcast
from mpijax._src.train import data as _data
from mpijax._src.train import gradients as _grads
from mpijax._src.train import metrics as _metrics


@contextlib.contextmanager
def _all_ranks_or_none(comm: Any, what: str):
  """Runs the block on every rank, then waits (sleeping) for all of them; if
  the block raised on any rank, every rank raises, naming the ranks and errors.

  The block is local work (tracing, compiling); without this, a rank whose
  input does not fit would raise alone and leave the others waiting in MPI.
  """
  error: BaseException | None = None
  try:
    yield
  except Exception as e:  # reported to every rank below
    error = e
  _host.idle_barrier(comm)
  problem = "" if error is None else f"{type(error).__name__}: {error}".split("\n")[0][:500]
  bad = mpi_util.rank_problems(comm, problem) if comm.Get_size() > 1 else []
  if error is not None:
    raise error
  if bad:
    lines = mpi_util.rank_lines(bad)
    raise RuntimeError(f"{what} failed on other ranks, so every rank stops here:\n{lines}\n"
                       "Every rank must pass data of the same structure, shapes and dtypes "
                       "(shard_batches gives every rank the same).")


class TrainState(NamedTuple):
  """Replicated training state (a pytree: checkpoint it with ``save_checkpoint``)."""
  step: jax.Array  # int32 scalar, optimizer steps taken
  params: Any
  opt_state: Any
  rng: jax.Array  # base PRNG key; step s uses fold_in(rng, s)


class DataParallel:
  """One jitted data-parallel training step with the fused gradient all-reduce inside.

  ``loss_fn(params, data)`` (or ``loss_fn(params, data, rng)`` with
  ``with_rng=True``) returns the **per-example** losses of this rank's local
  batch, shape ``[local_batch]``, or ``(losses, aux)`` with ``has_aux=True``
  where ``aux`` is a dict of per-example metrics (e.g. correctness). The step
  minimizes the mean loss over the real samples of the global batch: per
  rank ``mean(weight * losses)`` with the weights from :func:`shard_batches`,
  then the gradients (and, in the same buckets, the metrics) are averaged
  over ranks in one fused all-reduce (:func:`fused_allreduce`), and
  ``optimizer`` updates the replicated parameters identically on every rank.

  Args:
    loss_fn: see above.
    optimizer: an optax transformation (do not put ``allreduce_gradients``
      in it: the step already all-reduces).
    has_aux: ``loss_fn`` returns ``(losses, aux)``.
    with_rng: pass a per-step PRNG key (``fold_in(state.rng, state.step)``,
      the same on every rank) as third argument.
    bucket_bytes, compression: see :func:`allreduce_gradients`.
    root: the rank whose initial parameters everyone starts from.
    comm: an mpi4py communicator; default mpijax's.

  Examples:
    >>> dp = mpijax.train.DataParallel(loss_fn, optax.adam(1e-3), has_aux=True)  # doctest: +SKIP
    >>> state = dp.init(params, rng=jax.random.key(0))
    >>> for batch in mpijax.train.shard_batches((x, y), 256, seed=0, epoch=0):
    ...   state, metrics = dp.step(state, batch)
    >>> dp.evaluate(state, (x_test, y_test), batch_size=512)
  """

  def __init__(self, loss_fn: Callable[..., Any], optimizer: optax.GradientTransformation, *,
               has_aux: bool = False, with_rng: bool = False, bucket_bytes: int | None = None,
               compression: str | None = None, root: int = 0, comm: Any | None = None):
    if compression is not None and compression not in _grads._COMPRESSION:
      # Here, not at the first step after the data is loaded and the model traced.
      raise ValueError(f"DataParallel(compression={compression!r}) is not supported; "
                       "use None, 'bf16' or 'fp16'")
    self.loss_fn = loss_fn
    self.optimizer = optimizer
    self.has_aux = has_aux
    self.with_rng = with_rng
    self.bucket_bytes = bucket_bytes
    self.compression = compression
    self.root = root
    self.comm = comm
    self._step = jax.jit(self._step_impl)
    self._eval = jax.jit(self._eval_impl)
    self._compiled: dict[Any, Any] = {}  # input signature -> compiled step

  # -- state ------------------------------------------------------------------

  def init(self, params: Any, rng: jax.Array | None = None) -> TrainState:
    """Broadcasts ``root``'s parameters (and key) and builds the optimizer state."""
    if rng is None:
      rng = jax.random.key(0)
    params, rng = _bcast.broadcast((params, rng), self.root, comm=self.comm)
    # One compiled call instead of many small eager ops (each would compile).
    opt_state = jax.jit(self.optimizer.init)(params)
    return TrainState(jnp.zeros((), jnp.int32), params, opt_state, rng)

  # -- one step ---------------------------------------------------------------

  def _per_example(self, params, data, rng):
    out = self.loss_fn(params, data, rng) if self.with_rng else self.loss_fn(params, data)
    if self.has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2
                             and isinstance(out[1], collections.abc.Mapping)):
      raise TypeError("DataParallel(has_aux=True): loss_fn must return (losses, aux) with aux "
                      f"a dict of per-example metrics; got {jax.tree.map(jnp.shape, out)!r} "
                      "(shapes). Return a pair, or use has_aux=False.")
    if not self.has_aux and isinstance(out, (tuple, list)):
      raise TypeError(f"DataParallel(has_aux=False): loss_fn returned a {type(out).__name__} of "
                      f"{len(out)} ({jax.tree.map(jnp.shape, out)!r} shapes); return the per-example "
                      "losses alone, or (losses, aux) with has_aux=True")
    losses, aux = out if self.has_aux else (out, {})
    if jnp.ndim(losses) != 1:
      raise ValueError(f"DataParallel: loss_fn must return per-example losses of shape [batch], "
                       f"got shape {jnp.shape(losses)}; return the unreduced loss vector")
    for k, v in aux.items():
      if jnp.shape(v) != jnp.shape(losses):
        raise ValueError(f"DataParallel(has_aux=True): aux[{k!r}] has shape {jnp.shape(v)}, but aux "
                         f"values must be per-example metrics shaped like the losses "
                         f"{jnp.shape(losses)} (they are averaged with the batch weights)")
    return losses, dict(aux)

  def _step_impl(self, state: TrainState, data: Any, weight: jax.Array):
    rng = jax.random.fold_in(state.rng, state.step)

    def objective(params):
      losses, aux = self._per_example(params, data, rng)
      loss = jnp.mean(weight * losses)
      metrics = {"loss": loss}
      metrics.update({k: jnp.mean(weight * v.astype(jnp.float32)) for k, v in aux.items()})
      return loss, metrics

    (_, metrics), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
    kw = dict(average=True, bucket_bytes=self.bucket_bytes, comm=self.comm)
    if self.compression is None:
      # Metrics ride in the gradient buckets: no extra collective.
      grads, metrics = _grads.fused_allreduce((grads, metrics), **kw)
    else:
      grads = _grads.fused_allreduce(grads, compression=self.compression, **kw)
      metrics = _grads.fused_allreduce(metrics, **kw)
    updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return TrainState(state.step + 1, params, opt_state, state.rng), metrics

  def step(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step on this rank's part of a global batch.

    Args:
      state: the replicated :class:`TrainState`.
      batch: a :class:`Batch` from :func:`shard_batches` (its ``weight`` makes
        the loss the exact global mean, padding included), or plain data
        (every sample weighted 1).

    Returns:
      ``(new_state, metrics)``: metrics are global means over the real samples
      of the global batch (``"loss"`` and the ``aux`` keys), as jax scalars.
    """
    error: Exception | None = None
    if isinstance(batch, _data.Batch):
      data, weight = batch.data, batch.weight
    else:
      data, weight = batch, None
      try:
        weight = np.ones(_data._leading_size(data, "DataParallel.step"), np.float32)
      except ValueError as e:
        # Raised below, with the other ranks: alone, this rank would leave
        # them waiting in the first step's collectives.
        error = e
    args = (state, data, weight)
    leaves, treedef = jax.tree_util.tree_flatten(args)
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
      # Same answer on every rank (every rank traces the same program), so no
      # rank is left waiting. JAX's own error does not say what to do.
      raise TypeError("DataParallel.step was called under a JAX transformation (jax.jit, vmap, "
                      "grad, scan, ...) with traced arguments: it compiles and runs the whole "
                      "step itself, so call it from Python, outside jax.jit. For a step inside "
                      "your own jitted code, use optax.chain(mpijax.train.allreduce_gradients(), "
                      "optimizer).")
    compiled = signature = None
    if error is None:
      signature = (treedef, tuple((np.shape(x), str(getattr(x, "dtype", type(x))),
                                   getattr(x, "sharding", None)) for x in leaves))
      compiled = self._compiled.get(signature)
    if compiled is None:
      # Compile ahead of time, then wait for every rank without spinning, so
      # ranks that compile faster do not busy-wait in the first all-reduce on
      # cores the slower ranks need (oversubscribed CPU runs). A rank whose
      # batch does not fit the model fails here, and every rank hears of it.
      comm = _host.get_comm(self.comm, "mpijax.train.DataParallel.step")
      # The first trace of an mpijax op on a communicator registers it, a
      # collective: do it here, on every rank, so that a rank whose trace
      # fails early cannot leave the others in that collective.
      communicators.resolve_comm(self.comm, "mpijax.train.DataParallel.step")
      with _all_ranks_or_none(comm, "DataParallel.step: building the step"):
        if error is not None:
          raise error
        compiled = self._step.lower(*args).compile()
      self._compiled[signature] = compiled
    return compiled(*args)

  # -- evaluation -------------------------------------------------------------

  def _eval_impl(self, params: Any, data: Any, mask: jax.Array):
    losses, aux = self._per_example(params, data, jax.random.key(0))
    sums = {"loss": jnp.sum(mask * losses)}
    sums.update({k: jnp.sum(mask * v.astype(jnp.float32)) for k, v in aux.items()})
    return sums, jnp.sum(mask)

  def evaluate(self, state: TrainState, arrays: Any, batch_size: int) -> dict[str, float]:
    """Mean loss and aux metrics over ``arrays`` (the same full dataset on every rank).

    Each rank evaluates its share (in data order, padded last batch masked);
    the sums meet in one host all-reduce at the end.

    Args:
      state: the training state.
      arrays: pytree of arrays with a leading sample dimension.
      batch_size: global evaluation batch size (divisible by the rank count).

    Returns:
      ``{"loss": ..., **aux}`` as Python floats, identical on every rank.
    """
    comm = _host.get_comm(self.comm, "mpijax.train.DataParallel.evaluate")
    # A rank whose arrays are unusable (e.g. leaves with different sample
    # counts) must not raise alone: the others would wait for it in the
    # collectives below.
    with _all_ranks_or_none(comm, "DataParallel.evaluate"):
      batches = _data.shard_batches(arrays, batch_size, seed=None, epoch=0, comm=self.comm)
    # The check of the first batch (every rank holds as many samples), made
    # here where every rank has its batches, not inside the block below.
    batches._check_replicated_size()
    totals, count = None, 0.0
    # Ranks finish at different times (the first call compiles): they wait
    # idly, not in a spinning all-reduce, and a rank whose evaluation failed
    # makes every rank raise instead of leaving them waiting.
    with _all_ranks_or_none(comm, "DataParallel.evaluate"):
      for batch in batches:
        sums, n = self._eval(state.params, batch.data, batch.mask)
        totals = sums if totals is None else jax.tree_util.tree_map(jnp.add, totals, sums)
        count = count + n
    if totals is None:
      raise ValueError(f"DataParallel.evaluate got no samples (arrays with {batches.num_samples} samples)")
    means = _metrics.mean_metrics({"sums": totals, "count": count}, comm=self.comm)
    return {k: v / means["count"] for k, v in means["sums"].items()}
