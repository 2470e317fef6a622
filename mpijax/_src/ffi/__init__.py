"""Loads mpijax's C++ MPI transport and checks it matches the run-time MPI.

The extension ``_mpijax_ffi`` links ``libmpi`` by SONAME without an rpath, so
``mpi4py.MPI`` must be imported first: it loads the libmpi it was built for
(mpi4py 4 wheels choose Open MPI or MPICH at run time), and the dynamic loader
then reuses that library for mpijax. :func:`load` does this in the right
order, compares the MPI family and major version recorded at build time with
``MPI.Get_library_version()``, and registers the FFI targets with JAX once.

Loading is lazy (first collective), so ``import mpijax`` never initializes MPI
before ``mpijax.init()`` chose the thread level.
"""

from __future__ import annotations

import os
import re
import threading
from types import ModuleType

_lock = threading.Lock()
_module: ModuleType | None = None

def _parse_family(version: str) -> tuple[str, int]:
  """('Open MPI', 5) from an MPI library version string, ('unknown', 0) if unsure."""
  patterns = [
      ("Intel MPI", r"Intel\(R\) MPI Library (\d+)"),
      ("MVAPICH", r"MVAPICH2? Version:?\s*(\d+)"),
      ("Open MPI", r"Open MPI v?(\d+)"),
      ("MPICH", r"MPICH Version:?\s*(\d+)"),
  ]
  for family, pattern in patterns:
    m = re.search(pattern, version)
    if m:
      return family, int(m.group(1))
  return "unknown", 0


def _source_dir() -> str:
  here = os.path.dirname(os.path.abspath(__file__))
  root = os.path.normpath(os.path.join(here, "..", "..", ".."))
  if os.path.exists(os.path.join(root, "pyproject.toml")):
    return root
  return "<path to the mpijax source checkout>"


def _rebuild_hint() -> str:
  return (
      "Rebuild mpijax against the MPI that mpi4py uses at run time:\n"
      "  pip install scikit-build-core nanobind jaxlib\n"
      f"  MPICC=$(which mpicc) pip install --no-build-isolation --no-deps "
      f"--force-reinstall -e {_source_dir()}\n"
      "(MPICC must be the compiler wrapper of that MPI; "
      "`python -c 'from mpi4py import MPI; print(MPI.Get_library_version())'` "
      "shows which one mpi4py loaded).")


def _run_time_mpi() -> str:
  from mpijax._src import mpi_util
  MPI = mpi_util.import_mpi()  # loads libmpi (and initializes MPI) first
  return MPI.Get_library_version()


def _check_agreement(runtime_version: str) -> None:
  try:
    from mpijax._src.ffi import _build_info
  except ImportError as e:
    raise ImportError(
        "mpijax's C++ extension is not built (mpijax/_src/ffi/_build_info.py "
        f"missing: {e}). Install mpijax with `pip install -e .` from the "
        "source checkout (it compiles the extension), or:\n" + _rebuild_hint()
    ) from None
  built = (_build_info.MPI_FAMILY, int(_build_info.MPI_VERSION.split(".")[0] or 0))
  running = _parse_family(runtime_version)
  if built != running:
    raise ImportError(
        f"mpijax was built against {_build_info.MPI_FAMILY} "
        f"{_build_info.MPI_VERSION} (mpicc: {_build_info.MPICC}), but mpi4py "
        f"runs on {running[0]} {running[1]} "
        f"({runtime_version.strip().splitlines()[0]!r}). The two must be the "
        "same MPI implementation and major version.\n" + _rebuild_hint())


def loaded() -> ModuleType | None:
  """The extension module if :func:`load` has loaded it, else None (never loads it)."""
  return _module


def extension_path() -> str | None:
  """The extension's file, found without loading it (None if it is not built)."""
  import importlib.util

  spec = importlib.util.find_spec("mpijax._src.ffi._mpijax_ffi")
  return spec.origin if spec is not None else None


def load() -> ModuleType:
  """The extension module, loaded, checked and registered with JAX (once)."""
  global _module
  if _module is not None:
    return _module
  with _lock:
    if _module is not None:
      return _module
    runtime_version = _run_time_mpi()
    _check_agreement(runtime_version)
    try:
      from mpijax._src.ffi import _mpijax_ffi as ext
    except ImportError as e:
      if "libmpi" in str(e):
        raise ImportError(
            f"mpijax's extension could not load its MPI library ({e}); mpi4py "
            f"runs on {runtime_version.strip().splitlines()[0]!r}.\n"
            + _rebuild_hint()) from None
      raise
    import jax
    try:
      for name, capsule in ext.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    except Exception as e:  # jaxlib's XlaRuntimeError
      if "API version" not in str(e):
        raise
      raise ImportError(_jaxlib_mismatch(e)) from None
    _module = ext
    return ext


def _jaxlib_mismatch(error: Exception) -> str:
  """The message for an extension built with a newer jaxlib's XLA FFI headers.

  XLA accepts handlers built against its own or an older FFI API version
  only. pyproject.toml builds against the oldest supported jaxlib for that
  reason; a --no-build-isolation build uses the jaxlib installed at the time.
  """
  import jaxlib

  from mpijax._src.ffi import _build_info
  built = getattr(_build_info, "JAXLIB_VERSION", "unknown")
  source = _source_dir()
  target = f"-e {source}" if os.path.isabs(source) else "--no-binary mpijax mpijax"
  return (
      f"mpijax's extension was built against jaxlib {built}, whose XLA FFI API is newer "
      f"than that of the jaxlib {jaxlib.__version__} it runs on ({error}). Rebuild it "
      "against the installed jaxlib:\n"
      "  pip install scikit-build-core nanobind\n"
      f"  pip install --no-build-isolation --no-deps --force-reinstall {target}\n"
      f"or upgrade jax and jaxlib to {built}.")
