"""mpijax refuses a JAX older than it supports at import, naming both versions."""

from __future__ import annotations

import jax
import jaxlib
import pytest

from mpijax._src import jax_compat


def test_installed_jax_passes():
  jax_compat.check_jax()


@pytest.mark.parametrize("module", [jax, jaxlib], ids=["jax", "jaxlib"])
def test_too_old_jax_is_refused_with_both_versions(monkeypatch, module):
  monkeypatch.setattr(module, "__version__", "0.6.2")
  need = ".".join(map(str, jax_compat.MIN_JAX))
  with pytest.raises(ImportError, match=(rf"mpijax needs {module.__name__}>={need}, but "
                                         rf"{module.__name__} 0\.6\.2 is installed.*pip install")):
    jax_compat.check_jax()


@pytest.mark.parametrize("version, expected", [
    ("0.10.2", (0, 10, 2)), ("0.7.2", (0, 7, 2)), ("0.11.0.dev20260101", (0, 11, 0)),
    ("0.8.0rc1", (0, 8, 0)), ("1.0", (1, 0))])
def test_version_tuple(version, expected):
  assert jax_compat._version_tuple(version) == expected


def test_min_jax_matches_pyproject():
  import pathlib
  import re
  text = (pathlib.Path(__file__).parents[2] / "pyproject.toml").read_text()
  need = ".".join(map(str, jax_compat.MIN_JAX))
  deps = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
  assert f'"jax>={need}"' in deps and f'"jaxlib>={need}"' in deps, deps
  build = re.search(r"^requires = \[(.*?)^\]", text, re.S | re.M).group(1)
  assert f'"jaxlib=={need}"' in build, build
