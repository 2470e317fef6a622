"""Whether jaxlib can load mpijax's MPI bridge, and MPITRAMPOLINE_LIB.

XLA's CPU collectives reach MPI through MPItrampoline, built into jaxlib. It
reads ``MPITRAMPOLINE_LIB`` once, when jaxlib loads (``import jax``), loads
that library and resolves every name of MPI ABI 2.9 in it; a missing name or
another ABI version EXITS the process. So the variable must name mpijax's
bridge (``libmpijax_bridge.so``) before ``import jax``, and only once this
jaxlib is known to accept the bridge. This module decides both, with the
standard library only: it runs in ``import mpijax`` before JAX is imported,
in ``mpijax-run``, and from the ``mpijax-startup.pth`` hook at interpreter
start (``_mpijax_startup.py``), where importing mpijax would import JAX.

Whether a jaxlib accepts the bridge is found out by the trampoline itself: a
child Python loads ``libjax_common.so`` with the bridge named (about 0.5 s).
The answer is kept per (jaxlib library, bridge) in
``$XDG_CACHE_HOME/mpijax/xla-bridge.json`` (else ``~/.cache``), and the build
records it for the jaxlib it was built with.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

LIB_NAME = "libmpijax_bridge.so"
VERDICT_NAME = "libmpijax_bridge.verdict.json"  # written by the build, beside the library
ENV = "MPITRAMPOLINE_LIB"
_PROBE_OK = "mpijax-bridge-probe-ok"
# Variables of the launchers mpijax knows that give the job's size.
_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS")


def installed_bridge() -> str | None:
  """The bridge installed beside mpijax's extension, or None (imports mpijax)."""
  import importlib.util
  try:
    spec = importlib.util.find_spec("mpijax._src.ffi._mpijax_ffi")
  except (ImportError, ValueError):
    return None
  if spec is None or not spec.origin:
    return None
  path = os.path.join(os.path.dirname(spec.origin), LIB_NAME)
  return path if os.path.exists(path) else None


def jaxlib_library() -> str | None:
  """jaxlib's libjax_common.so (MPItrampoline's home), found without importing jaxlib."""
  import importlib.util
  try:
    spec = importlib.util.find_spec("jaxlib")
  except (ImportError, ValueError):
    return None
  locations = list(spec.submodule_search_locations or []) if spec else []
  if not locations:
    # At interpreter start (the .pth hook) a venv's system site-packages are
    # not on sys.path yet; site knows them, in the order they will come.
    import site
    locations = [os.path.join(d, "jaxlib") for d in site.getsitepackages()]
  for location in locations:
    path = os.path.join(location, "libjax_common.so")
    if os.path.exists(path):
      return path
  return None


def _bridge_id(path: str) -> str:
  """The id gen_stubs.py compiled into the bridge (the same once installed and
  stripped), else a hash of the file."""
  with open(path, "rb") as f:
    data = f.read()
  at = data.find(b"mpijax-bridge-id:")
  if at >= 0:
    return data[at + 17:data.index(b"\0", at)].decode("ascii", "replace")
  return hashlib.sha256(data).hexdigest()[:20]


def key(bridge: str, jaxlib_so: str) -> str:
  """Identifies a (bridge build, jaxlib library) pair."""
  st = os.stat(jaxlib_so)
  return f"{_bridge_id(bridge)}|{os.path.realpath(jaxlib_so)}:{st.st_size}:{st.st_mtime_ns}"


def probe(bridge: str, jaxlib_so: str, timeout: float = 120.0) -> tuple[bool, str]:
  """Loads ``jaxlib_so`` in a child with the bridge named: (accepted, detail).

  The child runs without site-packages (``python -S``), so no startup hook,
  and only loads the library: MPItrampoline's constructor does the checks.
  """
  env = dict(os.environ)
  for name in ("MPITRAMPOLINE_DELAY_INIT", "MPITRAMPOLINE_PRELOAD"):
    env.pop(name, None)
  env.update({ENV: bridge, "MPITRAMPOLINE_VERBOSE": "1"})
  code = f"import ctypes, sys; ctypes.CDLL(sys.argv[1]); print({_PROBE_OK!r}, flush=True)"
  try:
    out = subprocess.run([sys.executable, "-S", "-c", code, jaxlib_so], env=env,
                         capture_output=True, text=True, timeout=timeout,
                         stdin=subprocess.DEVNULL, check=False)
  except (OSError, subprocess.TimeoutExpired) as e:
    return False, f"could not run the check ({e})"
  lines = [l.strip() for l in out.stderr.splitlines()]
  wants = next((l.split("version", 1)[1].strip() for l in lines
                if l.startswith("[MPItrampoline] Requiring MPI ABI version")), "?")
  if out.returncode == 0 and _PROBE_OK in out.stdout:
    return True, f"jaxlib's MPItrampoline (MPI ABI {wants}) accepts the bridge"
  errors = [l for l in lines if l.startswith("MPItrampoline:")][:3]
  detail = "; ".join(errors) or f"the check exited with status {out.returncode}"
  return False, f"jaxlib's MPItrampoline (MPI ABI {wants}) refuses the bridge: {detail}"


def _cache_file() -> str:
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "mpijax", "xla-bridge.json")


def _read(path: str) -> dict:
  try:
    with open(path) as f:
      data = json.load(f)
    return data if isinstance(data, dict) else {}
  except (OSError, ValueError):
    return {}


def _remember(k: str, ok: bool, detail: str) -> None:
  path = _cache_file()
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    data = _read(path)
    data[k] = {"ok": ok, "detail": detail}
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
      json.dump(data, f, indent=1)
    os.replace(tmp, path)  # atomic: ranks starting together may all write
  except OSError:
    pass  # an unwritable home: check again next time


def verdict(bridge: str, *, allow_probe: bool = True) -> tuple[bool | None, str]:
  """Whether the installed jaxlib accepts ``bridge``: (True/False, detail), or
  (None, why) when unknown and ``allow_probe`` is False."""
  jaxlib_so = jaxlib_library()
  if jaxlib_so is None:
    return False, "jaxlib's libjax_common.so was not found"
  try:
    k = key(bridge, jaxlib_so)
  except OSError as e:
    return False, f"cannot read {e.filename}"
  for source in (os.path.join(os.path.dirname(bridge), VERDICT_NAME), _cache_file()):
    hit = _read(source).get(k)
    if isinstance(hit, dict) and "ok" in hit:
      return bool(hit["ok"]), str(hit.get("detail", ""))
  if not allow_probe:
    return None, "not checked yet for this jaxlib"
  ok, detail = probe(bridge, jaxlib_so)
  _remember(k, ok, detail)
  return ok, detail


def launcher_size(environ=None) -> int:
  """The job size a launcher announces (1 when none does)."""
  environ = os.environ if environ is None else environ
  for name in _SIZE_VARS:
    value = environ.get(name, "")
    if value.isdigit():
      return int(value)
  return 1


def select(bridge: str | None, *, collectives: str, distributed: bool,
           environ=None, allow_probe: bool = True, need_launcher: bool = True
           ) -> tuple[bool, str]:
  """Names the bridge in ``MPITRAMPOLINE_LIB`` where it is wanted and safe.

  Returns (whether the variable names mpijax's bridge now, why not). The
  variable is never changed once set (by the user, ``mpijax-run``, or an
  earlier call), never set for a single process (``need_launcher``) or when
  mpijax is told not to use XLA's MPI collectives.
  """
  environ = os.environ if environ is None else environ
  current = environ.get(ENV)
  if current is not None:
    mine = bool(bridge) and os.path.exists(current) and os.path.exists(bridge) and \
        os.path.samefile(current, bridge)
    return mine, "" if mine else f"{ENV}={current} names another library"
  if collectives == "gloo":
    return False, "MPIJAX_XLA_COLLECTIVES=gloo"
  if not distributed:
    return False, "JAX's distributed runtime is off (MPIJAX_JAX_DISTRIBUTED=0)"
  if need_launcher and launcher_size(environ) <= 1:
    return False, "not launched as a multi-rank job"
  if not bridge or not os.path.exists(bridge):
    return False, f"mpijax's bridge ({LIB_NAME}) is not built; reinstall mpijax"
  ok, detail = verdict(bridge, allow_probe=allow_probe)
  if not ok:
    return False, detail
  environ[ENV] = bridge
  return True, ""

