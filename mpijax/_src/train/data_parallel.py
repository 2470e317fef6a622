"""``DataParallel``: the common data-parallel loop in a few lines."""

from __future__ import annotations

import collections.abc
import contextlib
import os
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpijax._src import config
from mpijax._src import log
from mpijax._src import mpi_util
from mpijax._src.ops import communicators
from mpijax._src.timeline import record as _timeline
from mpijax._src.timeline import straggler_watch as _stragglers
from mpijax._src.train import broadcast as _bcast
from mpijax._src.train import communicator
from mpijax._src.train import data as _data
from mpijax._src.train import gradients as _grads
from mpijax._src.train import metrics as _metrics
from mpijax._src.train import model_state as _ms
from mpijax._src.train import preemption as _preempt
from mpijax._src.train import resume as _resume


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
  communicator.idle_barrier(comm)
  problem = "" if error is None else f"{type(error).__name__}: {error}".split("\n")[0][:500]
  bad = mpi_util.rank_problems(comm, problem) if comm.Get_size() > 1 else []
  if error is not None:
    raise error
  if bad:
    lines = mpi_util.rank_lines(bad)
    raise RuntimeError(
      f"{what} failed on other ranks, so every rank stops here:\n{lines}\n"
      "Every rank must pass data of the same structure, shapes and dtypes "
      "(shard_batches gives every rank the same)."
    )


class TrainState(NamedTuple):
  """Replicated training state (a pytree: checkpoint it with ``save_checkpoint``).

  Attributes:
    step: int32 scalar, the optimizer steps taken (also the data position).
    params: the model's parameters.
    opt_state: the optimizer's state.
    rng: the base PRNG key; step ``s`` uses ``fold_in(rng, s)``.
    model_state: mutable model state (BatchNorm statistics, ...); None for
      a stateless model.
  """

  step: jax.Array  # int32 scalar, optimizer steps taken (also the data position)
  params: Any
  opt_state: Any
  rng: jax.Array  # base PRNG key; step s uses fold_in(rng, s)
  # Mutable model state (BatchNorm statistics, ...); None for a stateless model.
  model_state: Any = None


class DataParallel:
  """One jitted data-parallel training step with the fused gradient all-reduce inside.

  ``loss_fn(params, data)`` (or ``loss_fn(params, data, rng)`` with
  ``with_rng=True``) returns the **per-example** losses of this rank's local
  batch, shape ``[local_batch]``, or ``(losses, aux)`` with ``has_aux=True``,
  where ``aux`` is any pytree: a leaf shaped like the losses is a per-example
  metric (averaged with the batch weights, so over the real samples of the
  global batch), any other leaf a per-batch value (averaged over ranks). The
  step minimizes the mean loss over the real samples of the global batch: per
  rank ``mean(weight * losses)`` with the weights from :func:`shard_batches`,
  then the gradients (and, in the same buckets, the metrics) are averaged
  over ranks in one fused all-reduce (:func:`fused_allreduce`), and
  ``optimizer`` updates the replicated parameters identically on every rank.

  **Model state.** With ``init(params, model_state=...)`` (Flax linen
  collections such as ``{"batch_stats": ...}``, or an NNX ``nnx.State`` of
  ``nnx.BatchStat``), ``loss_fn`` takes it after the parameters,
  ``loss_fn(params, model_state, data[, rng])``, and returns its usual output
  and the new model state: ``(losses, new_model_state)`` or
  ``((losses, aux), new_model_state)``. ``state_sync`` says, per top-level
  collection, how the replicas stay equal:

  * ``"sync"`` (SyncBatchNorm): while the step is traced, ``jax.lax``
    collectives on ``axis_name`` span every rank, so ``BatchNorm(axis_name=
    axis_name)`` normalizes with the statistics of the GLOBAL batch (and
    differentiates through them); its running averages are then the same on
    every rank with no further exchange. 4 ranks train exactly like one
    process on the global batch.
  * ``"mean"``: each rank normalizes with its own batch's statistics; the new
    running averages are averaged over ranks in the gradients' fused
    all-reduce.

  **Checkpoints and preemption.** With ``checkpoint_dir``, :meth:`resume_or_init`
  resumes from the newest complete checkpoint there, ``step`` writes one every
  ``checkpoint_every`` steps (and :meth:`save` on demand), and SIGTERM or
  SIGUSR1 on any rank stops every rank after the same step: each step's fused
  all-reduce carries the ranks' "stop" flags, so at the next ``step`` call
  every rank knows, writes the checkpoint together, and raises
  :class:`Preempted` (exit status 75). The data position is ``state.step``:
  resume with ``epoch, start = divmod(int(state.step), steps_per_epoch)`` and
  ``shard_batches(..., epoch=epoch, start_step=start)``.

  Args:
    loss_fn: see above.
    optimizer: an optax transformation (do not put ``allreduce_gradients``
      in it: the step already all-reduces).
    has_aux: ``loss_fn`` returns ``(losses, aux)``.
    with_rng: pass a per-step PRNG key (``fold_in(state.rng, state.step)``,
      the same on every rank) as last argument.
    bucket_bytes: the largest gradient bucket (see
      :func:`allreduce_gradients`).
    compression: ``None``, ``"bf16"`` or ``"fp16"`` (see
      :func:`allreduce_gradients`); the metrics and averaged model state
      then travel uncompressed in a second call.
    overlap: all-reduce each gradient bucket as soon as the backward pass has
      computed it, overlapping communication with the rest of the backward
      pass (see :func:`allreduce_gradients`); the buckets follow the order in
      which ``loss_fn`` first reads the parameters, reversed, found from its
      jaxpr when the step is traced. The same parameters bit for bit as
      without. Default ``config.get("overlap")`` (``MPIJAX_OVERLAP``).
    root: the rank whose initial parameters everyone starts from.
    comm: an mpi4py communicator; default mpijax's.
    axis_name: the name of the data axis (e.g. ``"batch"``) that ``jax.lax``
      collectives inside ``loss_fn`` reduce over; every rank is one position
      along it.
    state_sync: ``"sync"`` or ``"mean"`` for all of the model state, or a dict
      from top-level collection name to one of them. Default: ``"sync"`` with
      ``axis_name``, else ``"mean"``.
    eval_fn: what :meth:`evaluate` calls instead of ``loss_fn``, with the same
      arguments; it returns what ``loss_fn`` returns without the new model
      state (e.g. the model in inference mode: running averages instead of
      batch statistics). Default ``loss_fn`` (its new model state dropped).
    checkpoint_dir: directory for numbered checkpoints (see above).
    checkpoint_every: write a checkpoint after every this many steps (None:
      only on preemption and :meth:`save`). No more steps than this are lost
      when a job dies.
    keep_checkpoints: how many checkpoints the directory keeps (>= 1).
    checkpoint_metadata: called at every save, with no argument; returns
      JSON-serializable extras stored with the checkpoint (read them back
      with ``mpijax.train.checkpoint_metadata(path)``), e.g. a metrics history.
      ``step`` saves before its step runs, so these are as of the saved state.
    handle_preemption: install the SIGTERM/SIGUSR1 handler (default: when
      ``checkpoint_dir`` is given).

  Raises:
    ValueError: an unsupported ``compression`` or ``state_sync``, a
      ``checkpoint_every`` or ``keep_checkpoints`` that is not an integer
      >= 1, or ``checkpoint_every``/``handle_preemption`` without
      ``checkpoint_dir``.
    TypeError: ``overlap`` is not True, False or None.

  Examples:
    >>> dp = mpijax.train.DataParallel(loss_fn, optax.adam(1e-3), has_aux=True)  # doctest: +SKIP
    >>> state = dp.init(params, rng=jax.random.key(0))
    >>> for batch in mpijax.train.shard_batches((x, y), 256, seed=0, epoch=0):
    ...   state, metrics = dp.step(state, batch)
    >>> dp.evaluate(state, (x_test, y_test), batch_size=512)

    Flax linen with SyncBatchNorm (``nn.BatchNorm(axis_name="batch")`` inside)::

      def loss_fn(params, model_state, batch):
        x, y = batch
        logits, new_state = model.apply({"params": params, **model_state}, x, train=True,
                                        mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, y), new_state

      dp = mpijax.train.DataParallel(loss_fn, optax.adam(1e-3), axis_name="batch")
      variables = model.init(key, x[:1], train=False)
      state = dp.init(variables["params"], model_state={"batch_stats": variables["batch_stats"]})
  """

  def __init__(
    self,
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    *,
    has_aux: bool = False,
    with_rng: bool = False,
    bucket_bytes: int | None = None,
    compression: str | None = None,
    root: int = 0,
    comm: Any | None = None,
    axis_name: Any = None,
    state_sync: str | Mapping[str, str] | None = None,
    eval_fn: Callable[..., Any] | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int | None = None,
    keep_checkpoints: int = 2,
    checkpoint_metadata: Callable[[], dict[str, Any]] | None = None,
    handle_preemption: bool | None = None,
    overlap: bool | None = None,
  ):
    if compression is not None and compression not in _grads._COMPRESSION:
      # Here, not at the first step after the data is loaded and the model traced.
      raise ValueError(
        f"DataParallel(compression={compression!r}) is not supported; use None, 'bf16' or 'fp16'"
      )
    if overlap is not None and not isinstance(overlap, (bool, np.bool_)):
      raise TypeError(
        f"DataParallel(overlap={overlap!r}) must be True, False or None "
        "(the default, config.get('overlap'))"
      )
    if state_sync is None:
      state_sync = _ms.SYNC if axis_name is not None else _ms.MEAN
    _ms.check_policy(state_sync, axis_name)
    if checkpoint_every is not None and (
      not isinstance(checkpoint_every, int) or checkpoint_every < 1
    ):
      raise ValueError(
        f"DataParallel(checkpoint_every={checkpoint_every!r}) must be an integer >= 1 "
        "(steps between checkpoints) or None"
      )
    if not isinstance(keep_checkpoints, int) or keep_checkpoints < 1:
      raise ValueError(
        f"DataParallel(keep_checkpoints={keep_checkpoints!r}) must be an integer >= 1"
      )
    if checkpoint_dir is None and (checkpoint_every is not None or handle_preemption):
      raise ValueError(
        "DataParallel(checkpoint_every=..., handle_preemption=True) needs "
        "checkpoint_dir: the directory the checkpoints are written to"
      )
    self.loss_fn = loss_fn
    self.eval_fn = eval_fn
    self.optimizer = optimizer
    self.has_aux = has_aux
    self.with_rng = with_rng
    self.bucket_bytes = bucket_bytes
    self.compression = compression
    self.overlap = None if overlap is None else bool(overlap)
    self.root = root
    self.comm = comm
    self.axis_name = axis_name
    self.state_sync = state_sync
    self.checkpoint_dir = None if checkpoint_dir is None else os.fspath(checkpoint_dir)
    self.checkpoint_every = checkpoint_every
    self.keep_checkpoints = keep_checkpoints
    self.checkpoint_metadata = checkpoint_metadata
    if handle_preemption is None:
      handle_preemption = checkpoint_dir is not None
    self.handle_preemption = bool(handle_preemption)
    if self.handle_preemption:
      _preempt.install_preemption_handler()
    self._pending_stop: jax.Array | None = None
    self._saved_step = -1  # the step of the last checkpoint written or resumed from
    self._step = jax.jit(self._step_impl)
    self._eval = jax.jit(self._eval_impl)
    self._compiled: dict[Any, Any] = {}  # input signature -> compiled step
    self._timeline_steps = 0  # steps recorded in the timeline

  # -- state ------------------------------------------------------------------

  def init(self, params: Any, rng: jax.Array | None = None, model_state: Any = None) -> TrainState:
    """Broadcasts ``root``'s parameters, key and model state, and builds the optimizer state.

    Collective: every rank calls it, with trees of the same structure,
    shapes and dtypes (e.g. each its own fresh initialization); ``root``'s
    values win, so the replicas start equal.

    Args:
      params: the model's parameters (a pytree).
      rng: the base PRNG key (default ``jax.random.key(0)``); step ``s``
        uses ``fold_in(rng, s)``.
      model_state: mutable model state (Flax collections such as
        ``{"batch_stats": ...}``, an NNX ``nnx.State``), or None.

    Returns:
      A :class:`TrainState` at step 0 with ``root``'s values and
      ``optimizer.init(params)``.

    Raises:
      ValueError: on every rank, when the ranks' trees differ (naming the
        first differing leaf).
    """
    if rng is None:
      rng = jax.random.key(0)
    params, rng, model_state = _bcast.broadcast(
      (params, rng, model_state), self.root, comm=self.comm
    )
    # One compiled call instead of many small eager ops (each would compile).
    opt_state = jax.jit(self.optimizer.init)(params)
    return TrainState(jnp.zeros((), jnp.int32), params, opt_state, rng, model_state)

  def resume_or_init(
    self, params: Any, rng: jax.Array | None = None, model_state: Any = None
  ) -> TrainState:
    """The newest complete checkpoint of ``checkpoint_dir``, else :meth:`init`'s state.

    Collective. See :func:`mpijax.train.resume_or_init`; the restored
    ``step`` is the data position to continue from. Without
    ``checkpoint_dir`` it is :meth:`init`.

    Args:
      params: the model's parameters, as for :meth:`init`.
      rng: the base PRNG key, as for :meth:`init`.
      model_state: mutable model state, as for :meth:`init`.

    Returns:
      The restored :class:`TrainState`, or :meth:`init`'s.

    Raises:
      CheckpointMismatch: the newest checkpoint holds another model's state.
      CheckpointError: there are checkpoints, but none could be read.

    Examples:
      >>> state = dp.resume_or_init(params, rng=jax.random.key(0))  # doctest: +SKIP
      >>> epoch, start = divmod(int(state.step), steps_per_epoch)  # doctest: +SKIP
    """
    init = lambda: self.init(params, rng, model_state)
    if self.checkpoint_dir is None:
      return init()
    state = _resume.resume_or_init(self.checkpoint_dir, init, comm=self.comm)
    self._saved_step = int(state.step)  # on disk already (or step 0: nothing to save)
    return state

  def save(self, state: TrainState) -> str:
    """Writes ``state`` as checkpoint ``step_<state.step>`` of ``checkpoint_dir`` (collective)."""
    if self.checkpoint_dir is None:
      raise ValueError(
        "DataParallel.save needs DataParallel(checkpoint_dir=...); or call "
        "mpijax.train.save_checkpoint(path, state)"
      )
    metadata = self.checkpoint_metadata() if self.checkpoint_metadata is not None else None
    step = int(state.step)
    path = _resume.save_step_checkpoint(
      self.checkpoint_dir,
      state,
      step,
      keep=self.keep_checkpoints,
      metadata=metadata,
      comm=self.comm,
    )
    self._saved_step = step
    return path

  # -- calling the user's functions ---------------------------------------------

  def _call(self, fn: Callable[..., Any], params, model_state, data, rng, *, new_state: bool):
    """(losses, aux, new model state) from ``fn``, its output checked."""
    stateful = model_state is not None
    args = (params, model_state, data) if stateful else (params, data)
    out = fn(*args, rng) if self.with_rng else fn(*args)
    new_ms = None
    if stateful and new_state:
      if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError(
          "DataParallel with model state: loss_fn must return (its output, new "
          "model state), i.e. (losses, new_state) or ((losses, aux), new_state); "
          f"got {jax.tree.map(jnp.shape, out)!r} (shapes)"
        )
      out, new_ms = out
      _ms.check_new_state(model_state, new_ms)
    if self.has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
      raise TypeError(
        "DataParallel(has_aux=True): loss_fn must return (losses, aux) with aux "
        f"a pytree of metrics; got {jax.tree.map(jnp.shape, out)!r} (shapes). "
        "Return a pair, or use has_aux=False."
      )
    if not self.has_aux and isinstance(out, (tuple, list)):
      raise TypeError(
        f"DataParallel(has_aux=False): loss_fn returned a {type(out).__name__} of "
        f"{len(out)} ({jax.tree.map(jnp.shape, out)!r} shapes); return the per-example "
        "losses alone, or (losses, aux) with has_aux=True"
        + (" (with model state: ((losses, aux), new_state))" if stateful else "")
      )
    losses, aux = out if self.has_aux else (out, {})
    if jnp.ndim(losses) != 1:
      raise ValueError(
        f"DataParallel: loss_fn must return per-example losses of shape [batch], "
        f"got shape {jnp.shape(losses)}; return the unreduced loss vector"
      )
    return losses, aux, new_ms

  @staticmethod
  def _metrics(loss, aux, per_example):
    """{"loss": loss, **aux} for a dict aux, else {"loss": loss, "aux": aux}; leaves reduced."""
    reduced = jax.tree_util.tree_map(per_example, aux)
    if isinstance(reduced, collections.abc.Mapping):
      return {"loss": loss, **reduced}
    return {"loss": loss, "aux": reduced}

  # -- one step ---------------------------------------------------------------

  def _step_impl(self, state: TrainState, data: Any, weight: jax.Array, stop: Any = None):
    rng = jax.random.fold_in(state.rng, state.step)

    def objective(params):
      losses, aux, new_ms = self._call(
        self.loss_fn, params, state.model_state, data, rng, new_state=True
      )
      loss = jnp.mean(weight * losses)

      def per_example(v):
        v = jnp.asarray(v)
        if v.shape == losses.shape:  # per example: the weighted mean over the real samples
          return jnp.mean(weight * v.astype(jnp.float32))
        return v if jnp.issubdtype(v.dtype, jnp.inexact) else v.astype(jnp.float32)

      return loss, (self._metrics(loss, aux, per_example), new_ms)

    (_, (metrics, new_ms)), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
    ms_leaves, ms_def = jax.tree_util.tree_flatten(new_ms)
    averaged = _ms.averaged_leaves(new_ms, self.state_sync) if ms_leaves else []
    means = [x for x, a in zip(ms_leaves, averaged) if a]
    # Metrics, averaged model state and the stop flag ride in the gradient
    # buckets: no extra collective.
    extra = (metrics, means, stop)
    overlap = self.overlap if self.overlap is not None else bool(config.get("overlap"))
    kw = dict(
      average=True,
      bucket_bytes=self.bucket_bytes,
      comm=self.comm,
      overlap=overlap,
      local_axis_name=None,
      fuse_leaf_bytes=None,
    )
    order = None
    if overlap:
      # The buckets in the order the backward pass completes them; the
      # metrics, averaged model state and stop flag are ready before it
      # starts, so they ride in the first bucket.
      order = _grads.gradient_ready_order(lambda p: objective(p)[0], state.params)
    if self.compression is None:
      n_grads = len(jax.tree_util.tree_leaves(grads))
      n_extra = len(jax.tree_util.tree_leaves(extra))
      if order is not None:
        order = list(range(n_grads, n_grads + n_extra)) + order
      grads, extra = _grads._fused_allreduce(
        (grads, extra), compression=None, ready_order=order, **kw
      )
    else:
      grads = _grads._fused_allreduce(grads, compression=self.compression, ready_order=order, **kw)
      extra = _grads._fused_allreduce(extra, compression=None, **{**kw, "overlap": False})
    metrics, means, stop = extra
    it = iter(means)
    new_ms = jax.tree_util.tree_unflatten(
      ms_def, [next(it) if a else x for x, a in zip(ms_leaves, averaged)]
    )
    updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    new_state = TrainState(state.step + 1, params, opt_state, state.rng, new_ms)
    return (new_state, metrics) if stop is None else (new_state, metrics, stop)

  def _stop_if_agreed(self, state: TrainState) -> None:
    """Writes the checkpoint and raises Preempted when the last step's flags said stop."""
    pending, self._pending_stop = self._pending_stop, None
    if pending is None or not float(pending) > 0:
      return
    path = self.save(state)
    step = int(state.step)
    log.notice(
      f"mpijax.train: preemption requested; every rank stopped after step {step}, "
      f"checkpoint {path}; exiting with status {_preempt.PREEMPTED_EXIT_CODE}"
    )
    raise _preempt.Preempted(step, path)

  def step(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step on this rank's part of a global batch.

    With ``checkpoint_dir``: first, if any rank was signalled to stop (as
    agreed in the previous step's all-reduce), writes ``state`` as a
    checkpoint on every rank's behalf and raises :class:`Preempted`; else,
    when ``state.step`` is a multiple of ``checkpoint_every``, writes it as a
    checkpoint before the step.

    Args:
      state: the replicated :class:`TrainState`.
      batch: a :class:`Batch` from :func:`shard_batches` (its ``weight`` makes
        the loss the exact global mean, padding included), or plain data
        (every sample weighted 1).

    Returns:
      ``(new_state, metrics)``: metrics are global means over the real samples
      of the global batch (``"loss"`` and the ``aux`` keys, or ``"aux"`` for
      an ``aux`` that is not a dict), as jax values.

    Raises:
      Preempted: on every rank, after the agreed preemption checkpoint.
      TypeError: called under a JAX transformation (``jax.jit`` etc.), or
        ``loss_fn`` returned the wrong structure for ``has_aux`` and the
        model state.
      ValueError: ``loss_fn``'s losses are not one per example.
      RuntimeError: building the step failed on another rank (this rank
        raises its own error).
    """
    # A rank that calls its step later than the others was still getting the
    # batch: the straggler report splits its lateness into input and compute.
    _stragglers.note_step()
    if _timeline.active():
      # The span ends when the step's results are ready: with the timeline
      # on, each step waits for its own before returning.
      start = _timeline.now_ns()
      out = self._step_once(state, batch)
      jax.block_until_ready(out)
      self._timeline_steps += 1
      _timeline.add_span(
        "DataParallel.step",
        start,
        _timeline.now_ns(),
        category="step",
        step=self._timeline_steps - 1,
      )
      return out
    return self._step_once(state, batch)

  def _step_once(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
    if self.handle_preemption:
      self._stop_if_agreed(state)
    if self.checkpoint_every:
      # The state passed in, before this step: the caller has seen every
      # earlier step's metrics, so what checkpoint_metadata returns is as of
      # this state too.
      done = int(state.step)
      if done and done % self.checkpoint_every == 0 and done != self._saved_step:
        self.save(state)
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
    if self.handle_preemption:
      args += (np.float32(1.0 if _preempt.preemption_requested() else 0.0),)
    leaves, treedef = jax.tree_util.tree_flatten(args)
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
      # Same answer on every rank (every rank traces the same program), so no
      # rank is left waiting. JAX's own error does not say what to do.
      raise TypeError(
        "DataParallel.step was called under a JAX transformation (jax.jit, vmap, "
        "grad, scan, ...) with traced arguments: it compiles and runs the whole "
        "step itself, so call it from Python, outside jax.jit. For a step inside "
        "your own jitted code, use optax.chain(mpijax.train.allreduce_gradients(), "
        "optimizer)."
      )
    compiled = signature = None
    if error is None:
      signature = (
        treedef,
        tuple(
          (np.shape(x), str(getattr(x, "dtype", type(x))), getattr(x, "sharding", None))
          for x in leaves
        ),
      )
      compiled = self._compiled.get(signature)
    if compiled is None:
      # Compile ahead of time, then wait for every rank without spinning, so
      # ranks that compile faster do not busy-wait in the first all-reduce on
      # cores the slower ranks need (oversubscribed CPU runs). A rank whose
      # batch does not fit the model fails here, and every rank hears of it.
      comm = communicator.get_comm(self.comm, "mpijax.train.DataParallel.step")
      # The first trace of an mpijax op on a communicator registers it, a
      # collective: do it here, on every rank, so that a rank whose trace
      # fails early cannot leave the others in that collective.
      communicators.resolve_comm(self.comm, "mpijax.train.DataParallel.step")
      with (
        _all_ranks_or_none(comm, "DataParallel.step: building the step"),
        _timeline.span("DataParallel compile"),
      ):
        if error is not None:
          raise error
        with _ms.bind_data_axis(self.axis_name, comm) as axis:
          compiled = self._step.lower(*args).compile()
        self._check_synced(state.model_state, axis)
      self._compiled[signature] = compiled
    out = compiled(*args)
    if self.handle_preemption:
      new_state, metrics, self._pending_stop = out
      return new_state, metrics
    return out

  def _check_synced(self, model_state: Any, axis: Any) -> None:
    """'sync' state whose loss made no collective over the data axis would drift apart."""
    leaves = jax.tree_util.tree_leaves(model_state)
    if not leaves or axis is None or axis.calls:
      return
    if all(_ms.averaged_leaves(model_state, self.state_sync)):
      return
    raise ValueError(
      f"DataParallel(axis_name={self.axis_name!r}, state_sync={self.state_sync!r}): the model "
      f"state is 'sync', but loss_fn made no collective over axis {self.axis_name!r}, so each "
      "rank's statistics would stay local and the replicas drift apart. Give the normalization "
      f"layers axis_name={self.axis_name!r} (Flax: nn.BatchNorm(axis_name=...), "
      "nnx.BatchNorm(..., axis_name=...)), or use state_sync='mean'."
    )

  # -- evaluation -------------------------------------------------------------

  def _eval_impl(self, params: Any, model_state: Any, data: Any, mask: jax.Array):
    fn = self.eval_fn if self.eval_fn is not None else self.loss_fn
    losses, aux, _ = self._call(
      fn, params, model_state, data, jax.random.key(0), new_state=self.eval_fn is None
    )
    count = jnp.sum(mask)

    def per_example(v):
      v = jnp.asarray(v)
      if v.shape == losses.shape:
        return jnp.sum(mask * v.astype(jnp.float32))
      # A per-batch value counts once per real sample of its batch.
      return (v if jnp.issubdtype(v.dtype, jnp.inexact) else v.astype(jnp.float32)) * count

    return self._metrics(jnp.sum(mask * losses), aux, per_example), count

  def evaluate(self, state: TrainState, arrays: Any, batch_size: int) -> dict[str, float]:
    """Mean loss and aux metrics over ``arrays`` (the same full dataset on every rank).

    Each rank evaluates its share (in data order, padded last batch masked);
    the sums meet in one host all-reduce at the end. Per-example ``aux``
    leaves are averaged over the samples, per-batch ones weighted by their
    batch's real samples. Uses ``eval_fn`` if given.

    Args:
      state: the training state.
      arrays: pytree of arrays with a leading sample dimension.
      batch_size: global evaluation batch size (divisible by the rank count).

    Returns:
      ``{"loss": ..., **aux}`` (or ``{"loss": ..., "aux": aux}``), scalars as
      Python floats, identical on every rank.

    Raises:
      ValueError: ``arrays`` is unusable or holds no samples, or
        ``batch_size`` is not a multiple of the rank count.
      RuntimeError: the evaluation failed on another rank.
    """
    comm = communicator.get_comm(self.comm, "mpijax.train.DataParallel.evaluate")
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
    with (
      _all_ranks_or_none(comm, "DataParallel.evaluate"),
      _ms.bind_data_axis(self.axis_name, comm),
    ):
      for batch in batches:
        sums, n = self._eval(state.params, state.model_state, batch.data, batch.mask)
        totals = sums if totals is None else jax.tree_util.tree_map(jnp.add, totals, sums)
        count = count + n
    if totals is None:
      raise ValueError(
        f"DataParallel.evaluate got no samples (arrays with {batches.num_samples} samples)"
      )
    means = _metrics.mean_metrics({"sums": totals, "count": count}, comm=self.comm)
    return jax.tree_util.tree_map(lambda v: v / means["count"], means["sums"])
