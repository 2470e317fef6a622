"""mpijax under MPICH's Hydra `mpiexec` (the `mpich` wheel), in its own venv.

The main environment uses the Open MPI wheel; MPICH's wheel installs its own
`mpicc`/`mpiexec` over the same names, so this test builds a separate virtual
environment with `mpich`, `mpi4py`, `jax` and the build tools, installs this
checkout there (editable, its extension compiled with MPICH's `mpicc`), and
runs 4 ranks: the runtime (init, topology) and collectives through mpijax's
transport (``mpijax.ops.allreduce`` eager and inside ``jax.jit``, a 1 MiB
one, ``mpijax.lax.psum`` under ``mpijax.pmap`` inside ``jax.jit``), each
checked against NumPy. The venv is kept (one per checkout) and the extension
rebuilt when its sources change.

Needs the package registry (pip): when installing the packages fails, the
test is skipped with the reason, except in CI (``CI=true``), where it fails.
A failing build of mpijax itself always fails.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests._launch import REPO
from tests._launch import tail

pytestmark = pytest.mark.mpich

_TAG = hashlib.sha256(str(REPO).encode()).hexdigest()[:10]  # one venv per checkout
VENV = Path(os.environ.get("MPIJAX_TEST_MPICH_VENV",
                           Path(tempfile.gettempdir()) / f"mpijax-venv-mpich-{_TAG}"))
PY = VENV / "bin" / "python"
RANKS = 4


def _unavailable(reason: str):
  """Skips locally; fails in CI, where the install must work."""
  if os.environ.get("CI") == "true":
    pytest.fail(f"{reason} (CI=true: the MPICH test must run in CI)")
  pytest.skip(reason)


def _pip(*args: str, timeout: float, env: dict[str, str] | None = None):
  return subprocess.run([str(PY), "-m", "pip", "--disable-pip-version-check", *args],
                        capture_output=True, text=True, timeout=timeout, env=env)


def _sources_digest() -> str:
  """What the extension is built from: a change means a rebuild."""
  h = hashlib.sha256()
  files = [REPO / "CMakeLists.txt", REPO / "pyproject.toml"]
  files += sorted(p for p in (REPO / "mpijax").rglob("*")
                  if p.suffix in (".cc", ".cpp", ".h", ".hpp", ".in") and p.is_file())
  for p in files:
    h.update(str(p.relative_to(REPO)).encode() + b"\0" + p.read_bytes())
  return h.hexdigest()


@pytest.fixture(scope="module")
def mpich_venv() -> Path:
  """The venv's python, with mpijax built against MPICH."""
  if not (VENV / "bin" / "mpiexec").exists():
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, timeout=120)
    packages = ["mpich", "mpi4py", "jax", "numpy", "optax", "scikit-build-core", "nanobind"]
    packages += [tool for tool in ("cmake", "ninja") if shutil.which(tool) is None]
    r = _pip("install", "-q", *packages, timeout=900)
    if r.returncode != 0 or not (VENV / "bin" / "mpiexec").exists():
      shutil.rmtree(VENV, ignore_errors=True)  # no half-made venv for the next run
      _unavailable(f"could not install {' '.join(packages)} into a venv: {tail(r.stderr, 10)}")
  stamp = VENV / "mpijax-build.sha256"
  digest = _sources_digest()
  if not stamp.exists() or stamp.read_text() != digest:
    env = {**os.environ, "MPICC": str(VENV / "bin" / "mpicc")}
    env.pop("MPIJAX_MPICC", None)
    r = _pip("install", "-q", "--no-deps", "--no-build-isolation",
             f"--config-settings=build-dir={VENV / 'mpijax-build'}", "-e", str(REPO),
             timeout=1200, env=env)
    assert r.returncode == 0, f"building mpijax against MPICH failed:\n{tail(r.stdout + r.stderr, 60)}"
    stamp.write_text(digest)
  return PY


def _mpiexec(code: str, outdir: Path, timeout: float = 240) -> subprocess.CompletedProcess:
  env = dict(os.environ)
  for var in list(env):  # our own mpirun's variables must not leak into Hydra's job
    if var.startswith(("OMPI_", "PMIX_", "PRTE_")):
      del env[var]
  env.pop("PYTHONPATH", None)  # mpijax comes from the venv's (editable) install
  env["MPIJAX_TIMEOUT"] = "60"
  return subprocess.run(["timeout", "--kill-after=10", str(int(timeout)), str(VENV / "bin" / "mpiexec"),
                         "-n", str(RANKS), str(PY), "-c", code, str(outdir)],
                        capture_output=True, text=True, env=env, cwd=str(outdir),
                        timeout=timeout + 30)


def test_init_under_mpich_mpiexec(mpich_venv, tmp_path):
  # Each rank writes its own file: Hydra merges the ranks' stdout without tags.
  code = ("import mpijax, os, sys; rt = mpijax.init(); t = rt.topology; "
          "open(os.path.join(sys.argv[1], f'rank{t.rank}'), 'w').write(' '.join(map(str, ["
          "t.rank, t.size, t.local_rank, t.local_size, t.node_count, t.launcher, "
          "t.coordinator_address])))")
  r = _mpiexec(code, tmp_path)
  assert r.returncode == 0, tail(r.stdout + r.stderr)
  rows = [(tmp_path / f"rank{i}").read_text().split() for i in range(RANKS)]
  for i, row in enumerate(rows):
    assert row[0] == str(i) and row[1] == "4" and row[3] == "4" and row[4] == "1", row
    assert row[5] == "mpich", row
  assert sorted(int(row[2]) for row in rows) == [0, 1, 2, 3]
  assert len({row[6] for row in rows}) == 1  # one coordinator, the same everywhere


_COLLECTIVES = """
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
from mpi4py import MPI
import mpijax, mpijax.lax, mpijax.ops

rt = mpijax.init()
r, n = rt.rank, rt.size
out = {"rank": r, "size": n, "mpi": MPI.Get_library_version().splitlines()[0]}
x = jnp.arange(5, dtype=jnp.float32) + r
out["allreduce"] = np.asarray(mpijax.ops.allreduce(x)).tolist()
out["jit_allreduce"] = np.asarray(jax.jit(lambda v: mpijax.ops.allreduce(v * 2))(x)).tolist()
out["jit_psum"] = np.asarray(jax.jit(mpijax.pmap(lambda v: mpijax.lax.psum(v, "i"),
                                                 axis_name="i"))(x[None]))[0].tolist()
big = jnp.arange(1 << 18, dtype=jnp.float32) % 977 + r  # 1 MiB: mpijax's node-local paths
want = n * (np.arange(1 << 18, dtype=np.float32) % 977) + n * (n - 1) / 2
got = np.asarray(jax.jit(lambda v: mpijax.ops.allreduce(v))(big))
out["large_equal"] = bool(np.array_equal(got, want))
# Plain JAX over the ranks: XLA's partitioner all-reduce, 4 B and 1 MiB per rank.
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((jax.device_count(),), ("x",))
out["process_count"] = jax.process_count()
out["xla_collectives"] = rt.xla_collectives
for key, cols in (("xla_small", 1), ("xla_large", 1 << 18)):
  rows = (np.arange(cols, dtype=np.float32) % 977 + r)[None]
  g = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), rows)
  s = jax.jit(lambda a: a.sum(0), out_shardings=NamedSharding(mesh, P()))(g)
  want_s = n * (np.arange(cols, dtype=np.float32) % 977) + n * (n - 1) / 2
  out[key] = bool(np.array_equal(np.asarray(s.addressable_data(0)), want_s))
from mpijax._src.ffi import _build_info  # what the extension that ran was built against
out["extension_mpi"] = _build_info.MPI_FAMILY
with open(os.path.join(sys.argv[1], f"rank{r}.json"), "w") as f:
  json.dump(out, f)
"""


def test_collectives_under_mpich_mpiexec(mpich_venv, tmp_path):
  r = _mpiexec(_COLLECTIVES, tmp_path)
  assert r.returncode == 0, tail(r.stdout + r.stderr)
  k = range(5)
  base = [RANKS * i + RANKS * (RANKS - 1) / 2 for i in k]  # sum over ranks of i + rank
  for i in range(RANKS):
    got = json.loads((tmp_path / f"rank{i}.json").read_text())
    assert (got["rank"], got["size"]) == (i, RANKS), got
    assert "MPICH" in got["mpi"] and got["extension_mpi"] == "MPICH", got
    assert got["allreduce"] == base, got
    assert got["jit_allreduce"] == [2 * v for v in base], got
    assert got["jit_psum"] == base, got
    assert got["large_equal"] is True, got
    # JAX spans the ranks; its collectives over MPICH through mpijax's bridge.
    assert got["process_count"] == RANKS, got
    assert got["xla_collectives"] == "mpi", got
    assert got["xla_small"] is True and got["xla_large"] is True, got
KILLED_ONCE = """
import os, signal
import mpijax
rt = mpijax.init()
attempt = mpijax.config.get("restart_attempt")
print("RANK", os.environ["RANK"], "LOCAL_RANK", os.environ["LOCAL_RANK"], "WORLD_SIZE",
      os.environ["WORLD_SIZE"], "attempt", attempt, "launcher", rt.topology.launcher, flush=True)
rt.comm.Barrier()
if attempt == 0 and rt.rank == 1:
  os.kill(os.getpid(), signal.SIGKILL)
rt.comm.Barrier()
"""


def test_mpijax_run_under_hydra_logs_per_rank_and_restarts(mpich_venv, tmp_path):
  """mpijax-run with MPICH's mpiexec: Hydra's rank tags sort the per-rank logs, the ranks see
  their torchrun-style variables, and a SIGKILLed rank is restarted."""
  env = dict(os.environ)
  for var in list(env):
    if var.startswith(("OMPI_", "PMIX_", "PRTE_")):
      del env[var]
  env.pop("PYTHONPATH", None)  # mpijax comes from the venv's (editable) install
  logs = tmp_path / "logs"
  before = set(glob.glob("/dev/shm/mpich_shm_*"))
  r = subprocess.run([str(mpich_venv), "-m", "mpijax.launch", "--mpirun", str(VENV / "bin" / "mpiexec"),
                      "-n", "2", "--timeout", "150", "--max-restarts", "1", "--restart-backoff", "0",
                      "--log-dir", str(logs), "--", str(mpich_venv), "-c", KILLED_ONCE],
                     capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=180)
  assert r.returncode == 0, tail(r.stdout + r.stderr)
  assert "attempt 0: 2 ranks" in r.stderr and "exit code: 9" in r.stderr, r.stderr
  # The killed attempt's MPICH segment file is removed with it.
  assert set(glob.glob("/dev/shm/mpich_shm_*")) <= before, r.stderr
  for rank in (0, 1):
    lines = (logs / f"rank_{rank}.log").read_text().splitlines()
    for attempt in (0, 1):
      assert f"RANK {rank} LOCAL_RANK {rank} WORLD_SIZE 2 attempt {attempt} launcher mpich" in lines, lines
