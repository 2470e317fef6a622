"""mpijax's MPI bridge for XLA, seen from one process (no MPI job).

jaxlib's own MPItrampoline decides whether it accepts a bridge library, so
these tests load the real ``libjax_common.so`` in children, with the
installed bridge and with deliberately broken ones.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mpijax._src.ffi import bridge_env
from mpijax._src.xla import distributed as jax_runtime

BRIDGE_SRC = Path(__file__).resolve().parents[2] / "mpijax" / "_src" / "ffi" / "bridge"


@pytest.fixture(scope="module")
def bridge() -> str:
  path = bridge_env.installed_bridge()
  assert path is not None, "the bridge library is not installed (pip install -e .)"
  return path


@pytest.fixture(scope="module")
def jaxlib_so() -> str:
  path = bridge_env.jaxlib_library()
  assert path is not None
  return path


def _cc(tmp_path, source: str, name: str) -> str:
  cc = shutil.which("cc") or shutil.which("gcc")
  if cc is None:
    pytest.skip("no C compiler to build a test library")
  c = tmp_path / f"{name}.c"
  c.write_text(source)
  out = tmp_path / f"{name}.so"
  subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(c)], check=True, timeout=60)
  return str(out)


def test_jaxlib_accepts_the_installed_bridge(bridge, jaxlib_so):
  ok, detail = bridge_env.probe(bridge, jaxlib_so)
  assert ok, detail
  assert "MPI ABI 2." in detail


def test_a_library_without_every_name_is_refused(tmp_path, jaxlib_so):
  # What a jaxlib whose MPItrampoline asks for a name the bridge lacks looks like.
  lib = _cc(tmp_path, "const int mpiabi_version_major = 2, mpiabi_version_minor = 9,"
            " mpiabi_version_patch = 0, mpiwrapper_version_major = 0,"
            " mpiwrapper_version_minor = 1, mpiwrapper_version_patch = 0;\n"
            "void mpiwrapper_export_fortran_constants_(void) {}\n", "partial")
  ok, detail = bridge_env.probe(lib, jaxlib_so)
  assert not ok
  assert "Could not resolve symbol" in detail, detail


def test_another_abi_version_is_refused(tmp_path, jaxlib_so):
  lib = _cc(tmp_path, "const int mpiabi_version_major = 3, mpiabi_version_minor = 0,"
            " mpiabi_version_patch = 0, mpiwrapper_version_major = 0,"
            " mpiwrapper_version_minor = 1, mpiwrapper_version_patch = 0;\n", "abi3")
  ok, detail = bridge_env.probe(lib, jaxlib_so)
  assert not ok
  assert "version" in detail.lower(), detail


def test_verdict_is_remembered_per_jaxlib(tmp_path, monkeypatch, bridge, jaxlib_so):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  copy = tmp_path / "lib" / bridge_env.LIB_NAME  # no build verdict beside it
  copy.parent.mkdir()
  shutil.copy(bridge, copy)
  assert bridge_env.verdict(str(copy), allow_probe=False)[0] is None
  ok, _ = bridge_env.verdict(str(copy))
  assert ok
  cache = tmp_path / "mpijax" / "xla-bridge.json"
  assert bridge_env.key(str(copy), jaxlib_so) in cache.read_text()
  assert bridge_env.verdict(str(copy), allow_probe=False)[0] is True


def test_select_names_the_bridge_only_where_wanted(bridge):
  multi = {"OMPI_COMM_WORLD_SIZE": "4"}
  env = dict(multi)
  assert bridge_env.select(bridge, collectives="auto", distributed=True, environ=env) == (True, "")
  assert env[bridge_env.ENV] == bridge
  for kwargs, why in (({"collectives": "gloo", "distributed": True}, "gloo"),
                      ({"collectives": "auto", "distributed": False}, "distributed runtime is off")):
    env = dict(multi)
    ok, reason = bridge_env.select(bridge, environ=env, **kwargs)
    assert not ok and why in reason and bridge_env.ENV not in env
  env = {}
  ok, reason = bridge_env.select(bridge, collectives="auto", distributed=True, environ=env)
  assert not ok and "multi-rank" in reason and bridge_env.ENV not in env
  env = dict(multi, MPITRAMPOLINE_LIB="/opt/other/libmpiwrapper.so")
  ok, reason = bridge_env.select(bridge, collectives="auto", distributed=True, environ=env)
  assert not ok and "another library" in reason
  assert env[bridge_env.ENV] == "/opt/other/libmpiwrapper.so"  # never changed


def test_launcher_size_reads_each_launcher():
  assert bridge_env.launcher_size({}) == 1
  assert bridge_env.launcher_size({"OMPI_COMM_WORLD_SIZE": "4"}) == 4
  assert bridge_env.launcher_size({"PMI_SIZE": "3"}) == 3
  assert bridge_env.launcher_size({"SLURM_STEP_NUM_TASKS": "8"}) == 8


def test_startup_hook_names_the_bridge_before_jax_is_imported(bridge):
  # A fresh interpreter under a (pretended) 2-rank launcher: the .pth hook runs
  # before the program, whose own `import jax` then loads the bridge.
  env = {k: v for k, v in os.environ.items() if k != bridge_env.ENV}
  env["OMPI_COMM_WORLD_SIZE"] = "2"
  code = ("import os, sys; print(os.environ.get('MPITRAMPOLINE_LIB')); import jax; "
          "print(open('/proc/self/maps').read().count('libmpijax_bridge'))")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120, check=True).stdout.split()
  assert os.path.samefile(out[0], bridge)
  assert int(out[1]) > 0
  # Off where mpijax is told not to use XLA's MPI collectives.
  env["MPIJAX_XLA_COLLECTIVES"] = "gloo"
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120, check=True).stdout.split()
  assert out == ["None", "0"]


def test_stubs_cover_every_name_jaxlib_asks_for(tmp_path, jaxlib_so):
  sys.path.insert(0, str(BRIDGE_SRC))
  try:
    import gen_stubs
  finally:
    sys.path.remove(str(BRIDGE_SRC))
  out = tmp_path / "stubs.c"
  assert gen_stubs.main(["--names", str(BRIDGE_SRC / "mpiabi_names.txt"), "--impl",
                         str(BRIDGE_SRC / "bridge.c"), "--jaxlib-so", jaxlib_so,
                         "--out", str(out)]) == 0
  stubs = out.read_text()
  defined = set(re.findall(r"\b(MPIX?ABI_\w+)\s*[(\[=]", stubs)) | set(
      gen_stubs._DEFINED.findall((BRIDGE_SRC / "bridge.c").read_text()))
  assert gen_stubs.jaxlib_names(jaxlib_so) <= defined
  # The calls XLA's MPI collectives make are implemented, not stubbed.
  for name in ("Init_thread", "Is_thread_main", "Comm_split", "Comm_free", "Allreduce",
               "Allgather", "Reduce_scatter", "Isend", "Irecv", "Wait", "Sendrecv",
               "Error_string", "Finalize", "Comm_rank", "Comm_size"):
    assert f"MPIABI_{name}(void)" not in stubs, name


def test_an_unattached_bridge_says_to_call_init(bridge):
  # XLA's MPI collectives selected by hand, without mpijax.init(): a clear stop.
  env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI"))}
  env[bridge_env.ENV] = bridge
  code = ("import jax; from jax._src.lib import _jax; "
          "c = _jax.make_mpi_collectives(); c.Init()")
  r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                     timeout=120)
  assert r.returncode != 0
  assert "mpijax.init() has not attached the bridge" in r.stderr, r.stderr[-2000:]


def test_why_not_loaded_names_the_fix(monkeypatch):
  monkeypatch.delenv(bridge_env.ENV, raising=False)
  monkeypatch.setattr(jax_runtime, "_import_outcome", None)
  text = jax_runtime._why_not_loaded()
  assert "jax was imported before mpijax" in text and "mpijax-run" in text
  monkeypatch.setattr(jax_runtime, "_import_outcome",
                      (False, "jaxlib's MPItrampoline (MPI ABI 2.10.0) refuses the bridge: x"))
  assert "refuses the bridge" in jax_runtime._why_not_loaded()
