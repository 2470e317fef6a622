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
  table = text[text.index(start) + len(start) : text.index(end)]
  assert table.strip() == config.markdown_table().strip(), (
    "docs/configuration.md's table is stale; regenerate it with "
    "python -m mpijax._src.config_table and paste it between the markers"
  )


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


def test_unknown_names_are_reported_with_the_closest_setting():
  env = {
    "MPIJAX_TIMOUT": "5",
    "MPIJAX_XLA_COLLECTIVE": "gloo",
    "MPIJAX_ZZZZZZZZZ": "1",
    "MPIJAX_TIMEOUT": "5",  # known
    "MPIJAX_RUN": "1",  # mpijax-run's own channel to the ranks
    "MPIJAX_JOB_FILES": "/tmp/x",
    "MPIJAX_RESTART_ATTEMPT": "0",
    "MPIJAX_MPICC": "mpicc",  # read by the build
    "MPIJAX_TEST_SLOW": "1",  # the tests' own
    "MPIJAX_BENCH_MARKER": "x",
    "JAX_TIMEOUT": "1",  # not ours
  }
  assert config.unknown(env) == [
    ("MPIJAX_TIMOUT", "MPIJAX_TIMEOUT"),
    ("MPIJAX_XLA_COLLECTIVE", "MPIJAX_XLA_COLLECTIVES"),
    ("MPIJAX_ZZZZZZZZZ", None),
  ]
  assert config.unknown_message("MPIJAX_TIMOUT", "MPIJAX_TIMEOUT") == (
    "MPIJAX_TIMOUT is not an mpijax setting and is ignored (did you mean MPIJAX_TIMEOUT?)"
  )
  assert "docs/configuration.md" in config.unknown_message("MPIJAX_ZZZZZZZZZ", None)


def test_every_set_value_is_checked_with_the_form_expected():
  env = {
    "MPIJAX_TIMEOUT": "soon",
    "MPIJAX_RING_MIN_BYTES": "1MB",
    "MPIJAX_WAIT_SPIN_US": "fast",
    "MPIJAX_STALL_ACTION": "ignore",
    "MPIJAX_LAUNCHER": "ompi",
    "MPIJAX_CHECK": "1",  # fine
    "JAX_COORDINATOR_ADDRESS": "nohost",
  }
  assert config.problems(env) == [
    "MPIJAX_LAUNCHER='ompi' is not valid: expected one of openmpi4, prrte, slurm, mpich, mpi, "
    "single (or unset: detect it)",
    "JAX_COORDINATOR_ADDRESS='nohost' is not valid: expected 'host:port' with a port in "
    "1..65535, e.g. '10.0.0.1:12345'",
    "MPIJAX_TIMEOUT='soon' is not valid: expected a number of seconds >= 0 (0 or inf: never)",
    "MPIJAX_STALL_ACTION='ignore' is not valid: expected abort (report the stall, then end "
    "the job) or warn",
    "MPIJAX_RING_MIN_BYTES='1MB' is not valid: expected an integer, e.g. 65536",
    "MPIJAX_WAIT_SPIN_US='fast' is not valid: expected a number, e.g. 50 or 2.5",
  ]
  assert config.problems({"MPIJAX_CHECK": "1", "MPIJAX_TIMEOUT": "inf"}) == []


def test_the_configuration_table_prints_without_a_warning():
  import subprocess
  import sys

  out = subprocess.run(
    [sys.executable, "-m", "mpijax._src.config_table"], capture_output=True, text=True, timeout=120
  )
  assert out.returncode == 0 and out.stderr == "", out.stderr
  assert out.stdout.strip() == config.markdown_table().strip()
