"""The main job: data-parallel training of a small CNN on scikit-learn's 8x8 digits.

Run it on 4 ranks (CPU is enough; it finishes in well under a minute)::

    mpijax-run -n 4 -- python -m mpijax.examples.digits

Every rank loads the same bundled dataset (1797 images shipped with scikit-learn, no download), starts
from rank 0's parameters (``broadcast``), trains on its own quarter of every
global batch (``shard_batches``), and averages gradients inside the jitted
step (``DataParallel`` -> fused bucket all-reduce). Rank 0 shows the progress
bar and writes, under ``--out``: ``checkpoint.ckpt`` (full training state,
resumable with ``--resume`` under any rank count), ``metrics.json`` and
``curves.png`` (loss and accuracy per epoch).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
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
    path = os.path.join(list(spec.submodule_search_locations)[0], "datasets", "data", "digits.csv.gz")
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
    test[members[:int(round(test_fraction * members.size))]] = True
  return x[~test], y[~test], x[test], y[test]


# --- model: conv(32) -> conv(64) -> maxpool -> dense(128) -> dense(10) -------

def init_params(seed: int) -> dict:
  """He-normal weights from NumPy's generator: no JAX compilation before training."""
  rng = np.random.default_rng(seed)

  def dense(fan_in, fan_out):
    return {"w": (rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in)).astype(np.float32),
            "b": np.zeros(fan_out, np.float32)}

  def conv(size, c_in, c_out):
    w = rng.standard_normal((size, size, c_in, c_out)) * np.sqrt(2.0 / (size * size * c_in))
    return {"w": w.astype(np.float32), "b": np.zeros(c_out, np.float32)}

  params = {"conv1": conv(3, 1, 32), "conv2": conv(3, 32, 64),
            "fc1": dense(4 * 4 * 64, 128), "fc2": dense(128, 10)}
  return jax.tree_util.tree_map(jnp.asarray, params)


def apply(params, x):
  def conv(p, h):
    return jax.lax.conv_general_dilated(h, p["w"], (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC")) + p["b"]
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


def parse_args(argv=None):
  p = argparse.ArgumentParser(prog="python -m mpijax.examples.digits", description=__doc__.split("\n")[0])
  p.add_argument("--epochs", type=int, default=12, help="epochs to train (default 12)")
  p.add_argument("--batch-size", type=int, default=64,
                 help="GLOBAL batch size, divisible by the rank count (default 64)")
  p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate, cosine decay (default 2e-3)")
  p.add_argument("--label-smoothing", type=float, default=0.1, help="(default 0.1)")
  p.add_argument("--seed", type=int, default=0, help="seed for init and shuffling (default 0)")
  p.add_argument("--compression", choices=["bf16", "fp16"], default=None,
                 help="send gradients in half precision")
  p.add_argument("--out", default=os.path.join("runs", "digits"),
                 help="output directory for checkpoint.ckpt, metrics.json, curves.png (default runs/digits)")
  p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.ckpt if it exists")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  p.add_argument("--min-accuracy", type=float, default=0.0,
                 help="exit with status 1 if the final test accuracy is below this (e.g. 0.97)")
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  t_start = time.perf_counter()
  rt = mpijax.init()
  rank, ranks = rt.rank, rt.size
  x_train, y_train, x_test, y_test = load_data(args.seed)
  train.log(f"digits: {len(x_train)} train / {len(x_test)} test images, {ranks} ranks, "
            f"global batch {args.batch_size} ({args.batch_size // max(ranks, 1)} per rank), "
            f"{args.epochs} epochs, jax {jax.__version__} on {jax.default_backend()}")

  steps_per_epoch = len(train.shard_batches((x_train, y_train), args.batch_size, seed=args.seed, epoch=0))
  schedule = optax.cosine_decay_schedule(args.lr, args.epochs * steps_per_epoch)
  dp = train.DataParallel(functools.partial(loss_fn, label_smoothing=args.label_smoothing),
                          optax.adamw(schedule, weight_decay=1e-4), has_aux=True,
                          compression=args.compression)
  # Each rank draws different parameters; init() broadcasts rank 0's to all.
  state = dp.init(init_params(args.seed + rank), rng=jax.random.key(args.seed))
  n_params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))

  if rank == 0:
    os.makedirs(args.out, exist_ok=True)
  ckpt_path = os.path.join(args.out, "checkpoint.ckpt")
  history = {"train_loss": [], "train_accuracy": [], "test_loss": [], "test_accuracy": [],
             "epoch_seconds": [], "ranks": ranks, "global_batch_size": args.batch_size}
  start_epoch = 0
  # Rank 0's view decides for every rank: with node-local disks a rank that
  # does not see the file gets restore_checkpoint's error, on every rank,
  # instead of training alone while the others wait in the restore.
  if args.resume and train.broadcast(os.path.exists(ckpt_path)):
    saved = train.restore_checkpoint(ckpt_path, like={"state": state, "epoch": 0})
    state, start_epoch = saved["state"], saved["epoch"]
    history.update({k: v for k, v in train.checkpoint_metadata(ckpt_path)["history"].items()
                    if k in ("train_loss", "train_accuracy", "test_loss", "test_accuracy", "epoch_seconds")})
    train.log(f"resumed from {ckpt_path} at epoch {start_epoch} (step {int(state.step)})")
  train.log(f"model: small CNN, {n_params:,} parameters in {len(jax.tree_util.tree_leaves(state.params))} leaves")

  eval_batch = -(-len(x_test) // ranks) * ranks  # the whole test set in one padded step
  train_samples, train_seconds, t_first_step = 0, 0.0, None
  for epoch in range(start_epoch, args.epochs):
    t_epoch = time.perf_counter()
    batches = train.shard_batches((x_train, y_train), args.batch_size, seed=args.seed, epoch=epoch)
    bar = train.progress(batches, desc=f"epoch {epoch + 1}/{args.epochs}", leave=False,
                         disable=args.no_progress, unit="step")
    sums = {"loss": 0.0, "accuracy": 0.0}
    for i, batch in enumerate(bar):
      state, metrics = dp.step(state, batch)
      if t_first_step is None:
        jax.block_until_ready(state)
        t_first_step = time.perf_counter()  # compilation done
      # metrics are means over the real samples of the global batch; weight
      # them by that count (the last batch may be partial) for epoch means.
      n_real = min(args.batch_size, len(x_train) - i * args.batch_size)
      sums = {k: sums[k] + metrics[k] * n_real for k in sums}
    jax.block_until_ready(state)
    seconds = time.perf_counter() - t_epoch
    n_epoch = len(x_train)
    train_loss, train_acc = float(sums["loss"]) / n_epoch, float(sums["accuracy"]) / n_epoch
    test = dp.evaluate(state, (x_test, y_test), batch_size=eval_batch)
    if epoch > start_epoch:
      train_samples += n_epoch
      train_seconds += seconds
    else:  # the run's first step compiled: count only the steps after it
      train_samples += n_epoch - min(args.batch_size, n_epoch)
      train_seconds += t_epoch + seconds - t_first_step
    history["train_loss"].append(train_loss)
    history["train_accuracy"].append(train_acc)
    history["test_loss"].append(test["loss"])
    history["test_accuracy"].append(test["accuracy"])
    history["epoch_seconds"].append(seconds)
    train.log(f"epoch {epoch + 1:3d}/{args.epochs}  train loss {train_loss:.4f} acc {train_acc:.4f}  "
              f"test loss {test['loss']:.4f} acc {test['accuracy']:.4f}  "
              f"{n_epoch / seconds:,.0f} samples/s")
    # Every epoch: a killed run resumes (--resume) from the last finished epoch.
    train.save_checkpoint(ckpt_path, {"state": state, "epoch": epoch + 1},
                          metadata={"history": history, "args": vars(args)})

  final = dp.evaluate(state, (x_test, y_test), batch_size=eval_batch) \
      if start_epoch >= args.epochs else {"accuracy": history["test_accuracy"][-1],
                                           "loss": history["test_loss"][-1]}
  samples_per_s = train_samples / train_seconds if train_seconds else float("nan")
  wall = time.perf_counter() - t_start
  summary = {
      "ranks": ranks, "epochs": args.epochs, "global_batch_size": args.batch_size,
      "steps": int(state.step), "parameters": int(n_params),
      "test_accuracy": final["accuracy"], "test_loss": final["loss"],
      "train_samples_per_s": samples_per_s, "wall_seconds": wall,
      "compile_and_first_step_seconds": (t_first_step - t_start) if t_first_step else None,
      "compression": args.compression,
  }
  if rank == 0:
    _atomic_write_text(os.path.join(args.out, "metrics.json"),
                       json.dumps({"summary": summary, "history": history}, indent=2))
    save_plot(history, os.path.join(args.out, "curves.png"))
  train.log(f"final test accuracy {final['accuracy']:.4f} ({final['accuracy'] * 100:.2f} %), "
            f"{samples_per_s:,.0f} train samples/s on {ranks} ranks (after compilation), "
            f"wall {wall:.1f} s")
  train.log(f"wrote {ckpt_path}, {os.path.join(args.out, 'metrics.json')}, "
            f"{os.path.join(args.out, 'curves.png')}")
  return 0 if final["accuracy"] >= args.min_accuracy else 1


if __name__ == "__main__":
  sys.exit(main())
