"""The MPI suite: every test here runs inside an MPI job, on every rank.

Every test collected in this folder carries pytest-mpi's ``mpi`` marker, so
it is skipped unless pytest runs with ``--with-mpi``, as users of MPI Python
projects run their suites::

    mpirun -n 4 python -m pytest --with-mpi tests/mpi
    mpijax-run -n 2 --devices-per-process 2 python -m pytest --with-mpi tests/mpi

Without ``--with-mpi`` (``python -m pytest tests``) the modules are only
imported, so none of them may start MPI or JAX's backends at import:
``mpijax.init()`` runs in the ``rt`` fixture below.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import mpijax

_HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before pytest-mpi's hook reads the marker
def pytest_collection_modifyitems(config, items):
  has_plugin = config.pluginmanager.hasplugin("pytest_mpi")
  for item in items:
    if _HERE in Path(str(item.fspath)).resolve().parents:
      item.add_marker(pytest.mark.mpi)
      if not has_plugin:  # nothing would skip them: they would run outside MPI
        item.add_marker(pytest.mark.skip(
            reason="MPI test: needs pytest-mpi and --with-mpi (pip install -e '.[test]')"))


@pytest.fixture(scope="session", autouse=True)
def rt():
  """The mpijax runtime, initialized once per rank for the whole session."""
  return mpijax.init()


@pytest.fixture(scope="session")
def jax_multiprocess(rt):
  """Skips unless JAX knows every rank (its distributed runtime is on)."""
  import jax
  if jax.process_count() != rt.size:
    pytest.skip(f"JAX's distributed runtime is off in this job (JAX sees "
                f"{jax.process_count()} process, the job has {rt.size} ranks): plain JAX "
                "code does not span the ranks")
