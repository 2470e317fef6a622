"""The main job: data-parallel training of a small CNN on scikit-learn's 8x8 digits.

Run it on 4 ranks (CPU is enough; it finishes in well under a minute)::

    mpijax-run -n 4 -- python -m mpijax.examples.digits
    mpijax-run -n 4 -- python -m mpijax.examples.digits --model flax-bn   # Flax, SyncBatchNorm

Every rank loads the same bundled dataset (1797 images shipped with scikit-learn, no download), starts
from rank 0's parameters (``broadcast``), trains on its own quarter of every
global batch (``shard_batches``), and averages gradients inside the jitted
step (``DataParallel`` -> fused bucket all-reduce). ``--model flax-bn`` is a
Flax linen CNN with BatchNorm whose statistics are those of the global batch
(``DataParallel(axis_name="batch")``, ``nn.BatchNorm(axis_name="batch")``).

The run is restartable: it writes numbered checkpoints under
``OUT/checkpoints`` (every ``--checkpoint-every`` steps and at every epoch's
end) and, when started again with the same ``--out``, resumes from the newest
complete one at its step, also under another rank count, ending bit for bit
where an uninterrupted run ends. SIGTERM or SIGUSR1 (a scheduler's notice)
makes every rank stop after the same step, checkpoint, and exit with status
75. Rank 0 shows the progress bar and writes, under ``--out``,
``metrics.json`` and ``curves.png`` (loss and accuracy per epoch); the last
lines printed are the final test accuracy and a digest of the parameters.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpijax
from mpijax import train


def _bundled_digits() -> tuple[np.ndarray, np.ndarray]:
  """scikit-learn's bundled digits (1797 x 64 pixels in 0..16, labels 0..9).

  Reads the CSV that ships inside scikit-learn without importing
  ``sklearn.datasets`` (which pulls in SciPy: seconds per rank when four ranks
  start on two cores); falls back to ``load_digits`` if the file moved.
  """
  import importlib.util

  spec = importlib.util.find_spec("sklearn")
  if spec is not None and spec.submodule_search_locations:
    path = os.path.join(
      list(spec.submodule_search_locations)[0], "datasets", "data", "digits.csv.gz"
    )
    if os.path.exists(path):
      table = np.loadtxt(path, delimiter=",", dtype=np.float32)
      return table[:, :-1], table[:, -1].astype(np.int32)
  from sklearn.datasets import load_digits

  x, y = load_digits(return_X_y=True)
  return x.astype(np.float32), y.astype(np.int32)


def load_data(seed: int = 0, test_fraction: float = 0.2):
  """(x_train, y_train, x_test, y_test): images scaled to [0, 1], stratified split.

  The split depends only on ``seed``, so every rank computes the same one.
  """
  x, y = _bundled_digits()
  x = (x / 16.0).reshape(-1, 8, 8, 1)
  rng = np.random.default_rng(seed)
  test = np.zeros(len(y), bool)
  for label in np.unique(y):  # the same fraction of every class in the test set
    members = rng.permutation(np.flatnonzero(y == label))
    test[members[: int(round(test_fraction * members.size))]] = True
  return x[~test], y[~test], x[test], y[test]


# --- model: conv(32) -> conv(64) -> maxpool -> dense(128) -> dense(10) -------


def init_params(seed: int) -> dict:
  """He-normal weights from NumPy's generator: no JAX compilation before training."""
  rng = np.random.default_rng(seed)

  def dense(fan_in, fan_out):
    return {
      "w": (rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in)).astype(np.float32),
      "b": np.zeros(fan_out, np.float32),
    }

  def conv(size, c_in, c_out):
    w = rng.standard_normal((size, size, c_in, c_out)) * np.sqrt(2.0 / (size * size * c_in))
    return {"w": w.astype(np.float32), "b": np.zeros(c_out, np.float32)}

  params = {
    "conv1": conv(3, 1, 32),
    "conv2": conv(3, 32, 64),
    "fc1": dense(4 * 4 * 64, 128),
    "fc2": dense(128, 10),
  }
  return jax.tree_util.tree_map(jnp.asarray, params)


def apply(params, x):
  def conv(p, h):
    return (
      jax.lax.conv_general_dilated(
        h, p["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
      )
      + p["b"]
    )

  h = jax.nn.relu(conv(params["conv1"], x))
  h = jax.nn.relu(conv(params["conv2"], h))
  h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
  h = h.reshape(h.shape[0], -1)
  h = jax.nn.relu(h @ params["fc1"]["w"] + params["fc1"]["b"])
  return h @ params["fc2"]["w"] + params["fc2"]["b"]


def loss_fn(params, batch, label_smoothing: float = 0.1):
  """Per-example label-smoothed cross-entropy, and per-example correctness as an aux metric."""
  x, y = batch
  logits = apply(params, x)
  targets = optax.smooth_labels(jax.nn.one_hot(y, 10), label_smoothing)
  losses = optax.softmax_cross_entropy(logits, targets)
  return losses, {"accuracy": (jnp.argmax(logits, -1) == y).astype(jnp.float32)}


# --- outputs -----------------------------------------------------------------


def save_plot(history: dict, path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  epochs = np.arange(1, len(history["train_loss"]) + 1)
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
  ax1.plot(epochs, history["train_loss"], label="train")
  ax1.plot(epochs, history["test_loss"], label="test")
  ax1.set(xlabel="epoch", ylabel="cross-entropy (label-smoothed)", title="loss", yscale="log")
  ax1.legend()
  ax2.plot(epochs, history["train_accuracy"], label="train")
  ax2.plot(epochs, history["test_accuracy"], label="test")
  ax2.set(xlabel="epoch", ylabel="accuracy", title="accuracy")
  lowest = min(history["test_accuracy"] + history["train_accuracy"])
  ax2.set_ylim(min(0.9, np.floor(lowest * 20) / 20), 1.0)
  ax2.legend()
  fig.suptitle(f"digits, {history['ranks']} ranks, global batch {history['global_batch_size']}")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def _atomic_write_text(path: str, text: str) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, path)


# --- model: Flax linen CNN with BatchNorm (--model flax-bn) ----------------------


def flax_bn_model(axis_name: str | None):
  """conv(32)-BN-relu -> conv(64)-BN-relu -> maxpool -> dense(128)-BN-relu -> dense(10).

  ``axis_name`` is the data axis BatchNorm reduces its statistics over
  (SyncBatchNorm); None keeps them per rank.
  """
  import flax.linen as nn  # only for this model: the plain CNN needs no Flax

  class CNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
      bn = functools.partial(
        nn.BatchNorm, use_running_average=not train, momentum=0.9, axis_name=axis_name
      )
      # No bias before a BatchNorm: it would be subtracted right away.
      x = nn.relu(bn()(nn.Conv(32, (3, 3), use_bias=False)(x)))
      x = nn.relu(bn()(nn.Conv(64, (3, 3), use_bias=False)(x)))
      x = nn.max_pool(x, (2, 2), (2, 2))
      x = x.reshape(x.shape[0], -1)
      x = nn.relu(bn()(nn.Dense(128, use_bias=False)(x)))
      return nn.Dense(10)(x)

  return CNN()


def flax_bn_fns(model, label_smoothing: float):
  """(loss_fn, eval_fn) for DataParallel: batch statistics in training, running averages in eval."""

  def losses(logits, y):
    targets = optax.smooth_labels(jax.nn.one_hot(y, 10), label_smoothing)
    return (
      optax.softmax_cross_entropy(logits, targets),
      {"accuracy": (jnp.argmax(logits, -1) == y).astype(jnp.float32)},
    )

  def loss_fn(params, model_state, batch):
    x, y = batch
    logits, new_state = model.apply(
      {"params": params, **model_state}, x, train=True, mutable=["batch_stats"]
    )
    return losses(logits, y), new_state

  def eval_fn(params, model_state, batch):
    x, y = batch
    return losses(model.apply({"params": params, **model_state}, x, train=False), y)

  return loss_fn, eval_fn


def init_flax_bn(model, seed: int):
  """(params, model_state) of the Flax model (its init compiled once)."""
  variables = jax.jit(functools.partial(model.init, train=False))(
    jax.random.key(seed), jnp.zeros((1, 8, 8, 1), jnp.float32)
  )
  return variables["params"], {"batch_stats": variables["batch_stats"]}


def digest(tree) -> str:
  """sha256 of every leaf's bytes, in tree order: equal digests = bit-for-bit equal trees."""
  h = hashlib.sha256()
  for leaf in jax.tree_util.tree_leaves(tree):
    h.update(np.asarray(leaf).tobytes())
  return h.hexdigest()


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    prog="python -m mpijax.examples.digits", description=__doc__.split("\n")[0]
  )
  p.add_argument(
    "--model",
    choices=["cnn", "flax-bn"],
    default="cnn",
    help="cnn: a plain JAX CNN; flax-bn: a Flax linen CNN with BatchNorm (default cnn)",
  )
  p.add_argument(
    "--bn",
    choices=["sync", "mean"],
    default="sync",
    help="flax-bn: BatchNorm statistics over the global batch (sync) or per rank, "
    "running averages averaged over ranks (mean) (default sync)",
  )
  p.add_argument("--epochs", type=int, default=12, help="epochs to train (default 12)")
  p.add_argument(
    "--batch-size",
    type=int,
    default=64,
    help="GLOBAL batch size, divisible by the rank count (default 64)",
  )
  p.add_argument(
    "--lr", type=float, default=2e-3, help="peak learning rate, cosine decay (default 2e-3)"
  )
  p.add_argument("--label-smoothing", type=float, default=0.1, help="(default 0.1)")
  p.add_argument("--seed", type=int, default=0, help="seed for init and shuffling (default 0)")
  p.add_argument(
    "--compression", choices=["bf16", "fp16"], default=None, help="send gradients in half precision"
  )
  p.add_argument(
    "--out",
    default=None,
    help="output directory for checkpoints/, metrics.json, curves.png (default "
    "runs/digits; runs/digits-flax-bn for --model flax-bn, "
    "runs/digits-flax-bn-mean with --bn mean)",
  )
  p.add_argument(
    "--checkpoint-every",
    type=int,
    default=20,
    help="steps between checkpoints, besides every epoch's end (default 20)",
  )
  p.add_argument(
    "--keep-checkpoints",
    type=int,
    default=2,
    help="how many of the newest checkpoints OUT/checkpoints keeps (default 2)",
  )
  p.add_argument(
    "--fresh",
    action="store_true",
    help="delete OUT/checkpoints and start afresh instead of resuming",
  )
  p.add_argument(
    "--resume",
    action="store_true",
    help="resume from OUT/checkpoints (the default; kept for old command lines)",
  )
  p.add_argument(
    "--max-steps", type=int, default=None, help="stop after this many steps in total (for tests)"
  )
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  p.add_argument(
    "--min-accuracy",
    type=float,
    default=0.0,
    help="exit with status 1 if the final test accuracy is below this (e.g. 0.97)",
  )
  args = p.parse_args(argv)
  if args.out is None:  # each model its own: a run resumes only its own checkpoints
    args.out = default_out(args.model, args.bn)
  return args


def default_out(model: str, bn: str) -> str:
  """The default --out of a model: runs/digits, runs/digits-flax-bn, runs/digits-flax-bn-mean."""
  name = "digits" if model == "cnn" else f"digits-{model}" + ("-mean" if bn == "mean" else "")
  return os.path.join("runs", name)


_HISTORY_KEYS = ("train_loss", "train_accuracy", "test_loss", "test_accuracy", "epoch_seconds")


def main(argv=None) -> int:
  args = parse_args(argv)
  t_start = time.perf_counter()
  rt = mpijax.init()
  rank, ranks = rt.rank, rt.size
  if rt.local_device_count > 1:
    # DataParallel steps on one device per rank: the others would sit idle.
    devices = rt.local_device_count
    raise SystemExit(
      f"python -m mpijax.examples.digits: this rank has {devices} local devices "
      "(mpijax-run --devices-per-process, MPIJAX_DEVICES_PER_PROCESS or XLA_FLAGS), but the "
      "job trains on one device per rank and would leave the others idle. Start one rank "
      f"per device instead: mpijax-run -n {ranks * devices} -- python -m "
      "mpijax.examples.digits"
    )
  x_train, y_train, x_test, y_test = load_data(args.seed)
  train.log(
    f"digits ({args.model}): {len(x_train)} train / {len(x_test)} test images, {ranks} ranks, "
    f"global batch {args.batch_size} ({args.batch_size // max(ranks, 1)} per rank), "
    f"{args.epochs} epochs, jax {jax.__version__} on {jax.default_backend()}, "
    f"restart attempt {train.restart_attempt()}"
  )

  steps_per_epoch = len(
    train.shard_batches((x_train, y_train), args.batch_size, seed=args.seed, epoch=0)
  )
  total_steps = args.epochs * steps_per_epoch
  if args.max_steps is not None:
    total_steps = min(total_steps, args.max_steps)
  schedule = optax.cosine_decay_schedule(args.lr, args.epochs * steps_per_epoch)
  optimizer = optax.adamw(schedule, weight_decay=1e-4)

  ckpt_dir = os.path.join(args.out, "checkpoints")
  if args.fresh and rank == 0:
    shutil.rmtree(ckpt_dir, ignore_errors=True)
  history = {k: [] for k in _HISTORY_KEYS}
  history.update(ranks=ranks, global_batch_size=args.batch_size)
  sums = {"loss": 0.0, "accuracy": 0.0}  # this epoch's metric sums so far
  common = dict(
    has_aux=True,
    compression=args.compression,
    checkpoint_dir=ckpt_dir,
    checkpoint_every=args.checkpoint_every or None,
    keep_checkpoints=args.keep_checkpoints,
    checkpoint_metadata=lambda: {
      "history": history,
      "args": vars(args),
      "epoch_sums": {k: float(v) for k, v in sums.items()},
    },
  )
  if args.model == "cnn":
    dp = train.DataParallel(
      functools.partial(loss_fn, label_smoothing=args.label_smoothing), optimizer, **common
    )
    # Each rank draws different parameters; init() broadcasts rank 0's to all.
    params, model_state = init_params(args.seed + rank), None
  else:
    sync = args.bn == "sync"
    model = flax_bn_model("batch" if sync else None)
    loss, evaluate = flax_bn_fns(model, args.label_smoothing)
    dp = train.DataParallel(
      loss,
      optimizer,
      eval_fn=evaluate,
      axis_name="batch" if sync else None,
      state_sync=args.bn,
      **common,
    )
    params, model_state = init_flax_bn(model, args.seed + rank)
  # A restarted run continues from the newest complete checkpoint, else starts afresh.
  try:
    state = dp.resume_or_init(params, rng=jax.random.key(args.seed), model_state=model_state)
  except train.CheckpointMismatch as e:
    raise train.CheckpointMismatch(
      f"{ckpt_dir} holds the checkpoints of another run than --model {args.model}"
      f"{' --bn ' + args.bn if args.model == 'flax-bn' else ''}: pass --fresh to start over "
      f"there, or --out DIR for a directory of its own.\n{e}"
    ) from None
  n_params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
  start = int(state.step)
  if start:
    saved = train.checkpoint_metadata(train.checkpoint_path(ckpt_dir, start))
    history.update({k: v for k, v in saved["history"].items() if k in _HISTORY_KEYS})
    sums.update(saved.get("epoch_sums", {}))
    train.log(
      f"resumed from {train.checkpoint_path(ckpt_dir, start)} at step {start} "
      f"(epoch {start // steps_per_epoch}, step {start % steps_per_epoch} of {steps_per_epoch})"
    )
  train.log(
    f"model: {args.model}, {n_params:,} parameters in "
    f"{len(jax.tree_util.tree_leaves(state.params))} leaves"
  )

  eval_batch = -(-len(x_test) // ranks) * ranks  # the whole test set in one padded step
  train_samples, train_seconds, t_first_step = 0, 0.0, None
  start_epoch, start_in_epoch = divmod(start, steps_per_epoch)
  epoch = start_epoch
  while int(state.step) < total_steps:
    t_epoch = time.perf_counter()
    first = start_in_epoch if epoch == start_epoch else 0
    batches = train.shard_batches(
      (x_train, y_train), args.batch_size, seed=args.seed, epoch=epoch, start_step=first
    )
    bar = train.progress(
      batches,
      desc=f"epoch {epoch + 1}/{args.epochs}",
      leave=False,
      disable=args.no_progress,
      unit="step",
    )
    n_epoch = 0
    for i, batch in enumerate(bar, start=first):
      if epoch * steps_per_epoch + i >= total_steps:
        break
      state, metrics = dp.step(state, batch)
      if t_first_step is None:
        jax.block_until_ready(state)
        t_first_step = time.perf_counter()  # compilation done
      # metrics are means over the real samples of the global batch; weight
      # them by that count (the last batch may be partial) for epoch means.
      n_real = min(args.batch_size, len(x_train) - i * args.batch_size)
      n_epoch += n_real
      sums = {k: sums[k] + metrics[k] * n_real for k in sums}
    jax.block_until_ready(state)
    seconds = time.perf_counter() - t_epoch
    if epoch > start_epoch:
      train_samples += n_epoch
      train_seconds += seconds
    elif t_first_step is not None:  # the run's first step compiled: count only the steps after it
      train_samples += n_epoch - min(args.batch_size, n_epoch)
      train_seconds += t_epoch + seconds - t_first_step
    if int(state.step) % steps_per_epoch:
      break  # --max-steps ended the run inside an epoch
    test = dp.evaluate(state, (x_test, y_test), batch_size=eval_batch)
    n_seen = len(x_train)
    history["train_loss"].append(float(sums["loss"]) / n_seen)
    history["train_accuracy"].append(float(sums["accuracy"]) / n_seen)
    history["test_loss"].append(test["loss"])
    history["test_accuracy"].append(test["accuracy"])
    history["epoch_seconds"].append(seconds)
    sums = {"loss": 0.0, "accuracy": 0.0}
    train.log(
      f"epoch {epoch + 1:3d}/{args.epochs}  train loss {history['train_loss'][-1]:.4f} "
      f"acc {history['train_accuracy'][-1]:.4f}  test loss {test['loss']:.4f} "
      f"acc {test['accuracy']:.4f}  {n_epoch / seconds:,.0f} samples/s"
    )
    # Every epoch's end: a restart resumes from here at the latest.
    dp.save(state)
    epoch += 1

  final = dp.evaluate(state, (x_test, y_test), batch_size=eval_batch)
  if int(state.step) % steps_per_epoch:
    dp.save(state)
  samples_per_s = train_samples / train_seconds if train_seconds else None
  wall = time.perf_counter() - t_start
  params_digest = digest((state.params, state.model_state))
  summary = {
    "model": args.model,
    "ranks": ranks,
    "epochs": args.epochs,
    "global_batch_size": args.batch_size,
    "steps": int(state.step),
    "parameters": int(n_params),
    "test_accuracy": final["accuracy"],
    "test_loss": final["loss"],
    "params_sha256": params_digest,
    "resumed_from_step": start,
    "restart_attempt": train.restart_attempt(),
    "train_samples_per_s": samples_per_s,
    "wall_seconds": wall,
    "compile_and_first_step_seconds": (t_first_step - t_start) if t_first_step else None,
    "compression": args.compression,
  }
  if rank == 0:
    os.makedirs(args.out, exist_ok=True)
    _atomic_write_text(
      os.path.join(args.out, "metrics.json"),
      json.dumps({"summary": summary, "history": history}, indent=2),
    )
    if history["test_accuracy"]:
      save_plot(history, os.path.join(args.out, "curves.png"))
  speed = (
    f"{samples_per_s:,.0f} train samples/s on {ranks} ranks (after compilation)"
    if samples_per_s is not None
    else f"no training step to time (step {start} was the end)"
    if start >= total_steps
    else "too few steps to time after compilation"
  )
  train.log(
    f"final test accuracy {final['accuracy']:.4f} ({final['accuracy'] * 100:.2f} %), "
    f"{speed}, wall {wall:.1f} s"
  )
  train.log(f"params sha256 {params_digest} (step {int(state.step)})")
  train.log(
    f"wrote {ckpt_dir}, {os.path.join(args.out, 'metrics.json')}, "
    f"{os.path.join(args.out, 'curves.png')}"
  )
  return 0 if final["accuracy"] >= args.min_accuracy else 1


if __name__ == "__main__":
  sys.exit(main())
