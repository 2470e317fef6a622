"""Unit tests of the launcher detectors (layer 1), no MPI launch needed.

Each detector is fed the variables of a real launch (tests/unit/data/env_*.json;
see each file's "source" field: Open MPI 4, Open MPI 5 and MPICH were captured
from real launches, Slurm is written from its documentation) through
monkeypatch, after every launcher variable of the test's own environment has
been removed.

The plain-MPI fallback `mpi` is present whenever mpi4py is importable, as
mpijax.init() relies on; in-process tests switch it off (so that no test
initializes MPI inside pytest), and `test_mpi_fallback_singleton` runs it for
real in a fresh interpreter.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from mpijax._src import cluster
from mpijax._src.cluster import slurm

DATA = pathlib.Path(__file__).parent / "data"
LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PRTE_", "ORTE_", "SLURM_", "SLURMD_", "PMI_",
                     "MPI_LOCAL", "HYDRA_", "MPIJAX_")


def load(name: str) -> dict[str, str]:
  return json.loads((DATA / name).read_text())["env"]


def apply(monkeypatch, env: dict[str, str]) -> None:
  for key, value in env.items():
    monkeypatch.setenv(key, value)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
  """No launcher variables from the outside (pytest may itself run under
  mpirun or srun) and no in-process MPI initialization."""
  for key in list(os.environ):
    if key.startswith(LAUNCHER_PREFIXES):
      monkeypatch.delenv(key)
  monkeypatch.setattr(cluster.mpi, "mpi4py_available", lambda: False)


def test_registration_order():
  assert [c.name for c in cluster.registered()] == [
      "openmpi4", "prrte", "slurm", "mpich", "mpi", "single"]


# (file, launcher, rank, size, local_rank, local_size, node_index, node_count, hostnames)
CASES = [
    # Open MPI 5.0.11, mpirun -n 3 on one node. Its local ranks really came out
    # as 0, 2, 1 for ranks 0, 1, 2 (slot mapping with --oversubscribe).
    ("env_prrte_rank0.json", "prrte", 0, 3, 0, 3, None, None, None),
    ("env_prrte_rank1.json", "prrte", 1, 3, 2, 3, None, None, None),
    ("env_prrte_rank2.json", "prrte", 2, 3, 1, 3, None, None, None),
    # Open MPI 4.1.4, mpirun -n 3 on one node; ORTE also says the node count.
    ("env_openmpi4_rank0.json", "openmpi4", 0, 3, 0, 3, None, 1, None),
    ("env_openmpi4_rank1.json", "openmpi4", 1, 3, 1, 3, None, 1, None),
    ("env_openmpi4_rank2.json", "openmpi4", 2, 3, 2, 3, None, 1, None),
    # MPICH 5.0 Hydra, mpiexec -n 3 on one node.
    ("env_mpich_rank0.json", "mpich", 0, 3, 0, 3, None, None, None),
    ("env_mpich_rank1.json", "mpich", 1, 3, 1, 3, None, None, None),
    ("env_mpich_rank2.json", "mpich", 2, 3, 2, 3, None, None, None),
    # Slurm srun -N2 -n4 (block distribution) on cn[09-10].
    ("env_slurm_rank0.json", "slurm", 0, 4, 0, 2, 0, 2, ("cn09", "cn10")),
    ("env_slurm_rank1.json", "slurm", 1, 4, 1, 2, 0, 2, ("cn09", "cn10")),
    ("env_slurm_rank2.json", "slurm", 2, 4, 0, 2, 1, 2, ("cn09", "cn10")),
    ("env_slurm_rank3.json", "slurm", 3, 4, 1, 2, 1, 2, ("cn09", "cn10")),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_captured_environment(monkeypatch, case):
  name, *expected = case
  apply(monkeypatch, load(name))
  info = cluster.detect()
  assert dataclasses.astuple(info) == tuple(expected)
  # Forcing the right launcher gives the same answer.
  assert cluster.detect(expected[0]) == info


def test_every_capture_is_tested():
  files = sorted(p.name for p in DATA.glob("env_*.json"))
  assert files == sorted(c[0] for c in CASES)
  for path in DATA.glob("env_*.json"):
    doc = json.loads(path.read_text())
    assert doc["source"] and doc["launcher"] in path.name


def test_openmpi5_is_prrte_not_openmpi4(monkeypatch):
  # Both set OMPI_COMM_WORLD_* and PMIX_*; only ORTE (Open MPI 4) sets
  # OMPI_MCA_orte_*, only PRRTE (Open MPI 5) sets PRTE_LAUNCHED.
  apply(monkeypatch, load("env_prrte_rank1.json"))
  assert not cluster.ompi.OpenMPI4Env.is_env_present()
  assert cluster.prrte.PrrteEnv.is_env_present()
  monkeypatch.setenv("OMPI_MCA_orte_launch", "1")  # even with a stray ORTE variable
  assert cluster.detect().launcher == "prrte"


def test_openmpi4_is_not_prrte(monkeypatch):
  apply(monkeypatch, load("env_openmpi4_rank0.json"))
  assert cluster.ompi.OpenMPI4Env.is_env_present()
  assert not cluster.prrte.PrrteEnv.is_env_present()


@pytest.mark.parametrize("name,launcher", [("env_openmpi4_rank1.json", "openmpi4"),
                                           ("env_prrte_rank1.json", "prrte")])
def test_mpirun_inside_slurm_allocation(monkeypatch, name, launcher):
  # mpirun in an sbatch script: the processes inherit the allocation's SLURM_*
  # (mpirun starts its daemons with srun, so even step variables may be there);
  # the Open MPI detectors come first and win.
  apply(monkeypatch, load("env_slurm_rank0.json"))
  apply(monkeypatch, load(name))
  info = cluster.detect()
  assert (info.launcher, info.rank, info.size) == (launcher, 1, 3)


def test_mpich_inside_slurm_allocation(monkeypatch):
  # mpiexec -n 3 in a batch script: Hydra starts its proxy with srun (a step of
  # 1 task here), the ranks inherit the proxy's SLURM_* and get Hydra's PMI_*.
  apply(monkeypatch, load("env_slurm_rank0.json"))
  apply(monkeypatch, {"SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1",
                      "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NODELIST": "cn09",
                      "SLURM_STEP_TASKS_PER_NODE": "1"})
  apply(monkeypatch, load("env_mpich_rank2.json"))
  assert not slurm.SlurmEnv.is_env_present()
  info = cluster.detect()
  assert (info.launcher, info.rank, info.size) == ("mpich", 2, 3)


def test_srun_with_pmi2_is_slurm(monkeypatch):
  # srun --mpi=pmi2 sets PMI_* itself, agreeing with the step: still Slurm.
  apply(monkeypatch, load("env_slurm_rank3.json"))
  apply(monkeypatch, {"PMI_RANK": "3", "PMI_SIZE": "4", "PMI_FD": "7"})
  info = cluster.detect()
  assert (info.launcher, info.rank, info.size, info.hostnames) == ("slurm", 3, 4, ("cn09", "cn10"))


def test_slurm_allocation_without_step_is_not_a_launch(monkeypatch):
  # An salloc shell / sbatch batch script: job variables, even SLURM_PROCID=0,
  # but no srun step. Running python there is one process, not task 0 of 4.
  env = load("env_slurm_rank0.json")
  for key in [k for k in env if k.startswith("SLURM_STEP")]:
    del env[key]
  apply(monkeypatch, env)
  assert not slurm.SlurmEnv.is_env_present()
  info = cluster.detect()
  assert (info.launcher, info.rank, info.size) == ("single", 0, 1)
  with pytest.raises(ValueError, match="launcher 'slurm' was requested.*SLURM_STEP_NUM_TASKS"):
    cluster.detect("slurm")


def test_slurm_step_narrower_than_job(monkeypatch):
  # srun -N2 -n3 inside a 4-node allocation: step variables win.
  apply(monkeypatch, {
      "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu-[001-004]", "SLURM_JOB_NUM_NODES": "4",
      "SLURM_NNODES": "4", "SLURM_NTASKS": "8", "SLURM_TASKS_PER_NODE": "2(x4)",
      "SLURM_STEP_NODELIST": "gpu-[002-003]", "SLURM_STEP_NUM_NODES": "2",
      "SLURM_STEP_NUM_TASKS": "3", "SLURM_STEP_TASKS_PER_NODE": "2,1",
      "SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
  })
  info = cluster.detect()
  assert info == cluster.LaunchInfo("slurm", 2, 3, 0, 1, 1, 2, ("gpu-002", "gpu-003"))


def test_slurm_uneven_tasks_per_node(monkeypatch):
  base_env = {
      "SLURM_STEP_NUM_TASKS": "7", "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
      "SLURM_STEP_NUM_NODES": "4", "SLURM_STEP_NODELIST": "n[1-4]",
  }
  apply(monkeypatch, base_env)
  apply(monkeypatch, {"SLURM_PROCID": "6", "SLURM_LOCALID": "0", "SLURM_NODEID": "3"})
  assert cluster.detect().local_size == 1
  apply(monkeypatch, {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1"})
  assert cluster.detect().local_size == 2


@pytest.mark.parametrize("text,expected", [
    ("4", (4,)), ("2(x3),1", (2, 2, 2, 1)), ("1,2(x2)", (1, 2, 2)), (" 3(x1) ", (3,)),
])
def test_parse_tasks_per_node(text, expected):
  assert slurm.parse_tasks_per_node(text) == expected


@pytest.mark.parametrize("text", ["", "2(x", "x2", "2(3)", "2,,1", "-1"])
def test_parse_tasks_per_node_malformed(text):
  with pytest.raises(ValueError, match=r"SLURM_STEP_TASKS_PER_NODE=.*tasks-per-node"):
    slurm.parse_tasks_per_node(text)


def test_explicit_arguments_beat_environment(monkeypatch):
  apply(monkeypatch, load("env_slurm_rank3.json"))
  info = cluster.detect(rank=1, size=2, local_rank=0, local_size=1)
  assert dataclasses.astuple(info) == ("slurm", 1, 2, 0, 1, 1, 2, ("cn09", "cn10"))
  # None means "not given": the environment answers.
  assert cluster.detect(rank=None).rank == 3
  assert cluster.detect(hostnames=["a", "b"]).hostnames == ("a", "b")


def test_explicit_argument_replaces_malformed_variable(monkeypatch):
  apply(monkeypatch, load("env_mpich_rank2.json"))
  monkeypatch.setenv("PMI_RANK", "abc")
  assert cluster.detect(rank=2).rank == 2


def test_explicit_arguments_without_launcher():
  info = cluster.detect(rank=3, size=4)
  assert (info.launcher, info.rank, info.size) == ("single", 3, 4)


@pytest.mark.parametrize("name,var,bad", [
    ("env_slurm_rank1.json", "SLURM_PROCID", "abc"),
    ("env_slurm_rank1.json", "SLURM_STEP_NUM_TASKS", "4.0"),
    ("env_slurm_rank1.json", "SLURM_LOCALID", ""),
    ("env_prrte_rank0.json", "OMPI_COMM_WORLD_SIZE", "3x"),
    ("env_openmpi4_rank0.json", "OMPI_COMM_WORLD_LOCAL_RANK", "-1"),
    ("env_mpich_rank0.json", "MPI_LOCALNRANKS", "three"),
])
def test_malformed_variable(monkeypatch, name, var, bad):
  apply(monkeypatch, load(name))
  monkeypatch.setenv(var, bad)
  with pytest.raises(ValueError) as err:
    cluster.detect()
  message = str(err.value)
  assert f"{var}={bad!r}" in message and "unset it" in message


def test_malformed_slurm_lists(monkeypatch):
  apply(monkeypatch, load("env_slurm_rank0.json"))
  monkeypatch.setenv("SLURM_STEP_NODELIST", "cn[09-")
  with pytest.raises(ValueError, match=r"SLURM_STEP_NODELIST.*'cn\[09-'"):
    cluster.detect()
  monkeypatch.setenv("SLURM_STEP_NODELIST", "cn[09-10]")
  monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "2(x2")
  with pytest.raises(ValueError, match=r"SLURM_STEP_TASKS_PER_NODE='2\(x2'"):
    cluster.detect()
  monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "4")  # one node, but SLURM_NODEID=0 ok
  assert cluster.detect().local_size == 4
  monkeypatch.setenv("SLURM_NODEID", "1")
  with pytest.raises(ValueError, match="SLURM_NODEID=1.*lists only 1 node"):
    cluster.detect()


@pytest.mark.parametrize("env,kwargs,match", [
    ({"PMI_RANK": "5", "PMI_SIZE": "3"}, {}, r"rank=5 \(mpich environment\).*size=3"),
    ({"PMI_RANK": "1", "PMI_SIZE": "3"}, {"size": 1}, r"rank=1 .*size=1 \(argument\)"),
    ({"PMI_RANK": "0", "PMI_SIZE": "0"}, {}, r"size=0 .* must be >= 1"),
    ({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "2"}, {},
     r"local_rank=2 .*local_size=2"),
    ({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "3"}, {},
     r"local_size=3 .*cannot exceed size=2"),
])
def test_inconsistent_values(monkeypatch, env, kwargs, match):
  apply(monkeypatch, env)
  with pytest.raises(ValueError, match=match):
    cluster.detect(**kwargs)


def test_explicit_argument_types():
  with pytest.raises(ValueError, match=r"rank='1': expected an int"):
    cluster.detect(rank="1")
  with pytest.raises(TypeError, match="unknown keyword.*'ranks'"):
    cluster.detect(ranks=1)


def test_unknown_launcher():
  with pytest.raises(ValueError, match="unknown launcher 'openmpi'.*'openmpi4', 'prrte', "
                     "'slurm', 'mpich', 'mpi', 'single'"):
    cluster.detect("openmpi")


def test_forced_launcher(monkeypatch):
  apply(monkeypatch, load("env_prrte_rank2.json"))
  assert cluster.detect("single") == cluster.LaunchInfo("single", 0, 1, 0, 1, 0, 1, None)
  with pytest.raises(ValueError, match="launcher 'mpich' was requested.*PMI_RANK"):
    cluster.detect("mpich")


def test_single_process_fallback():
  # Empty environment, mpi4py "not installed": no launcher and no MPI.
  info = cluster.detect()
  assert info == cluster.LaunchInfo("single", 0, 1, 0, 1, 0, 1, None)
  with pytest.raises(dataclasses.FrozenInstanceError):
    info.rank = 1  # type: ignore[misc]


def test_mpi_fallback_present_iff_mpi4py_importable(monkeypatch):
  monkeypatch.setattr(cluster.mpi, "mpi4py_available", lambda: True)
  assert cluster.mpi.MpiEnv.is_env_present()
  assert [c.name for c in cluster.registered() if c.is_env_present()] == ["mpi", "single"]


def test_registration_rejects_bad_subclasses():
  before = cluster.registered()
  with pytest.raises(ValueError, match="'slurm'.*already registered by SlurmEnv"):
    type("OtherSlurm", (cluster.ClusterEnv,), {"name": "slurm"})
  with pytest.raises(TypeError, match="must set a class attribute `name`"):
    type("Nameless", (cluster.ClusterEnv,), {})
  assert cluster.registered() == before


def test_mpi_fallback_singleton():
  """The real `mpi` detector in a fresh interpreter: MPI singleton, rank 0 of 1.

  Also checks that importing the package does not initialize MPI and that the
  detector asks for MPI_THREAD_MULTIPLE.
  """
  code = textwrap.dedent("""
      import sys
      from mpijax._src import cluster
      assert "mpi4py.MPI" not in sys.modules, "importing the detectors imported mpi4py.MPI"
      info = cluster.detect()
      from mpi4py import MPI
      assert MPI.Query_thread() == MPI.THREAD_MULTIPLE, MPI.Query_thread()
      print(tuple(info.__dict__.values()))
  """)
  env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}
  repo = pathlib.Path(__file__).resolve().parents[2]
  proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=repo, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.strip().splitlines()[-1] == "('mpi', 0, 1, 0, 1, 0, 1, None)"
