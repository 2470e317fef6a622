"""The transport's settings, sent from :mod:`mpijax.config` to the C++ side.

mpijax's own collectives and XLA's through the bridge read the same ones.
"""

from __future__ import annotations

from mpijax._src import config
from mpijax._src import ffi as _ffi

_pushed: dict[str, int | float | bool] | None = None
_oversubscribed = False


def set_oversubscribed(value: bool) -> None:
  """Notes whether this rank's node runs more ranks than it has cores (mpijax's
  import finds out; see mpijax/_src/run/cpu_bind.py): waits then yield the core
  after every poll."""
  global _oversubscribed
  _oversubscribed = bool(value)


def push_settings() -> None:
  """Sends the transport settings to C++ (again if they changed)."""
  global _pushed
  action = str(config.get("stall_action")).strip().lower()
  if action not in ("abort", "warn"):
    raise ValueError(
        f"MPIJAX_STALL_ACTION={action!r} is not valid: use 'abort' (report the "
        "stall, then end the job) or 'warn' (report it and keep waiting).")
  timeout = config.parse("timeout", config.get("timeout"))  # also after config.update
  settings = dict(
      max_chunk_bytes=int(config.get("max_chunk_bytes")), timeout_s=timeout,
      stall_abort=action == "abort", check_every=bool(config.get("check")),
      blocking_min_bytes=int(config.get("blocking_min_bytes")),
      ring_min_bytes=int(config.get("ring_min_bytes")),
      ring_in_place_min_bytes=int(config.get("ring_in_place_min_bytes")),
      shm_max_bytes=int(config.get("shm_max_bytes")),
      cma_min_bytes=int(config.get("cma_min_bytes")),
      wait_spin_s=float(config.get("wait_spin_us")) * 1e-6,
      oversubscribed=_oversubscribed)
  if settings != _pushed:
    _ffi.load().setup(**settings)
    _pushed = settings
