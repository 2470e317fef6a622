"""Fixtures for tests that run inside an MPI job (see tests/conftest.py)."""

from __future__ import annotations

import pytest

import mpijax


@pytest.fixture(scope="session", autouse=True)
def rt():
  """The mpijax runtime, initialized once per rank for the whole session."""
  return mpijax.init()
