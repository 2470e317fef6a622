"""The one module that reads MPIJAX_* variables."""

from __future__ import annotations

from pathlib import Path

import pytest

from mpijax._src import config

CONFIG_DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_environment_default_and_override(monkeypatch):
  monkeypatch.delenv("MPIJAX_TIMEOUT", raising=False)
  assert config.get("timeout") == 300.0
  monkeypatch.setenv("MPIJAX_TIMEOUT", "7.5")
  assert config.get("timeout") == 7.5
  config.update("timeout", 3.0)
  try:
    assert config.get("timeout") == 3.0  # code beats the environment
  finally:
    config.reset("timeout")
  assert config.get("timeout") == 7.5


def test_bad_value_names_the_variable(monkeypatch):
  monkeypatch.setenv("MPIJAX_CHECK", "maybe")
  with pytest.raises(ValueError, match="MPIJAX_CHECK='maybe'"):
    config.get("check")


def test_unknown_setting():
  with pytest.raises(KeyError, match="no setting 'nope'"):
    config.get("nope")


def test_docs_table_is_current():
  text = CONFIG_DOC.read_text()
  start, end = "<!-- config-table:start -->\n", "\n<!-- config-table:end -->"
  table = text[text.index(start) + len(start):text.index(end)]
  assert table.strip() == config.markdown_table().strip(), (
      "docs/configuration.md's table is stale; regenerate it with "
      "python -m mpijax._src.config and paste it between the markers")


def test_straggler_interval_is_off_or_at_least_a_second(monkeypatch):
  for text, value in (("0", 0.0), ("inf", 0.0), ("1", 1.0), ("90", 90.0)):
    monkeypatch.setenv("MPIJAX_STRAGGLER_INTERVAL", text)
    assert config.get("straggler_interval") == value
  for bad in ("0.01", "-1", "nan"):
    monkeypatch.setenv("MPIJAX_STRAGGLER_INTERVAL", bad)
    with pytest.raises(ValueError, match=rf"MPIJAX_STRAGGLER_INTERVAL='{bad}' is not valid"):
      config.get("straggler_interval")
  monkeypatch.setenv("MPIJAX_STRAGGLER_INTERVAL", "0.5")
  with pytest.raises(ValueError, match="at least 1 second"):
    config.get("straggler_interval")


def test_timeout_accepts_inf_as_never_and_refuses_nan_and_negative(monkeypatch):
  monkeypatch.setenv("MPIJAX_TIMEOUT", "inf")
  assert config.get("timeout") == 0.0
  for bad in ("nan", "-5"):
    monkeypatch.setenv("MPIJAX_TIMEOUT", bad)
    with pytest.raises(ValueError, match=rf"MPIJAX_TIMEOUT='{bad}' is not valid: .*>= 0"):
      config.get("timeout")
  assert config.parse("timeout", float("inf")) == 0.0
