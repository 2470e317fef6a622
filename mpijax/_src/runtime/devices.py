"""What JAX's backend is given before it starts: the CPU device count, the size of
XLA's CPU thread pool, and which GPU a rank uses. ``mpijax.init()`` calls
:func:`configure` before the first use of JAX's devices."""

from __future__ import annotations

import os
import re

from mpijax._src import config
from mpijax._src import log

_FORCE_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def _user_cpu_device_count() -> int | None:
  """The CPU device count the user already asked JAX for, if any."""
  m = _FORCE_FLAG.search(os.environ.get("XLA_FLAGS", ""))
  if m:
    return int(m.group(1))
  import jax

  n = jax.config.jax_num_cpu_devices
  return n if n and n > 0 else None


def configure(devices_per_process: int | None, local_rank: int, local_size: int) -> int:
  """Sets JAX's local device count / GPU choice before JAX's backend starts.

  Returns the number of local CPU devices JAX will have (or has).
  """
  import jax

  from mpijax._src import jax_compat

  requested = (
    devices_per_process if devices_per_process is not None else config.get("devices_per_process")
  )
  if requested is not None and requested < 1:
    raise ValueError(f"devices_per_process must be >= 1, got {requested}")
  user = _user_cpu_device_count()
  if jax_compat.backends_started():
    if (
      requested is not None
      and jax.local_device_count() != requested
      and jax.default_backend() == "cpu"
    ):
      raise RuntimeError(
        f"devices_per_process={requested} was requested but JAX already started with "
        f"{jax.local_device_count()} CPU devices. Call mpijax.init() before the first use of "
        "JAX devices (jax.devices(), creating arrays, jit calls)."
      )
    if jax.default_backend() == "cpu":
      _warn_small_cpu_pool(jax.local_device_count())
    return jax.local_device_count()
  if requested is not None:
    if user is not None and user != requested:
      raise ValueError(
        f"devices_per_process={requested} conflicts with the user's own setting of {user} CPU "
        "devices (XLA_FLAGS=--xla_force_host_platform_device_count or jax_num_cpu_devices). "
        "Drop one of the two."
      )
    if user is None:
      jax.config.update("jax_num_cpu_devices", requested)
  _size_cpu_pool(requested or user or 1, local_size)
  _configure_gpu(local_rank, local_size)
  return requested or user or 1


# XLA's CPU client sizes its thread pool to max(cores, local devices) (the
# PJRT_NPROC variable overrides the core count), and its compiler splits a
# large loop over up to that many threads. Ranks that share a node unbound
# each see every core, so each split waits for threads that the other ranks'
# work holds: at 2 ranks on 2 cores a psum_scatter of 256 KiB rows took
# 99-126 us, 38-39 with a pool of 1 (a 4 MiB x + 1: 137-187 -> 101-109 us).
# So a rank gets its share of the cores. A multi-device execution also
# takes one thread per device to launch it, and those launch threads block
# while the device's queue of in-flight executions is full; its device parts
# then need one more thread each, at the same time (they meet in collectives:
# XLA's own, and mpijax's, which pair up across ranks). With fewer than two
# threads per device, independent multi-device calls dispatched back to back
# stall for good (JAX alone too: a jitted psum over 2 CPU devices on 2 cores
# aborts in XLA's rendezvous within 1,000 calls; with mpijax's MPI calls the
# stall inspector reported it within 5-42 calls at 2 ranks x 2 devices).
_POOL_VARS = ("PJRT_NPROC", "NPROC")  # what XLA reads, in its order


def _cpu_pool_threads(devices: int) -> int:
  """The thread count XLA's CPU client will have for ``devices`` local devices."""
  for var in _POOL_VARS:
    value = os.environ.get(var)
    if value is not None and value.strip().isdigit():
      return max(int(value), devices)
  return max(
    len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1),
    devices,
  )


def _core_share(local_size: int) -> int | None:
  """This rank's share of its node's cores where ``local_size`` ranks run on all of them;
  None where it has the node alone or its launcher (or a cpuset) gave it its own cores."""
  if local_size <= 1 or not hasattr(os, "sched_getaffinity"):
    return None
  cpus = len(os.sched_getaffinity(0))
  if cpus < (os.cpu_count() or cpus):
    return None
  return max(1, cpus // local_size)


def _size_cpu_pool(devices: int, local_size: int = 1) -> None:
  """Sizes XLA's CPU thread pool before it starts: this rank's share of the node's cores,
  and at least two threads per local device. A PJRT_NPROC of the user's own wins."""
  if any(os.environ.get(v) is not None for v in _POOL_VARS):
    _warn_small_cpu_pool(devices)
    return
  default = _cpu_pool_threads(devices)
  threads = default
  share = _core_share(local_size)
  if share is not None:
    threads = min(threads, max(share, devices))
  if devices > 1:
    threads = max(threads, 2 * devices)
  if threads != default:
    os.environ["PJRT_NPROC"] = str(threads)


def _warn_small_cpu_pool(devices: int) -> None:
  threads = _cpu_pool_threads(devices)
  if devices > 1 and threads < 2 * devices:
    log.warning(
      f"JAX's CPU client has {threads} threads for {devices} local devices "
      f"(fewer than 2 per device): independent multi-device calls dispatched back "
      f"to back can stall. Call mpijax.init() before JAX starts (mpijax then sets "
      f"PJRT_NPROC={2 * devices}), or set PJRT_NPROC={2 * devices} yourself."
    )


def _configure_gpu(local_rank: int, local_size: int) -> None:
  """One GPU per rank, chosen by local rank among the visible ones."""
  import importlib.util

  import jax

  has_cuda = any(
    importlib.util.find_spec(m) is not None for m in ("jax_cuda13_plugin", "jax_cuda12_plugin")
  )
  if not has_cuda or "JAX_CUDA_VISIBLE_DEVICES" in os.environ:
    return
  platforms = jax.config.jax_platforms or ""
  if platforms and "cuda" not in platforms and "gpu" not in platforms:
    return
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  if visible is not None:
    n = len([v for v in visible.split(",") if v.strip()])
  else:
    n = None
  if n is not None and n == 0:
    return
  index = local_rank if n is None else local_rank % n
  if n is not None and local_size > n:
    log.warning(
      f"{local_size} ranks on this node share {n} visible GPUs "
      f"(CUDA_VISIBLE_DEVICES={visible!r}); rank {local_rank} uses GPU {index}."
    )
  # Indexes JAX's view, which already honours CUDA_VISIBLE_DEVICES.
  jax.config.update("jax_cuda_visible_devices", str(index))
