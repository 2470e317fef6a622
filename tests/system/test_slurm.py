"""A real one-node Slurm on this machine runs slurm/cpu.sbatch with 4 mpijax ranks.

Installs Debian's slurm-wlm and munge when missing, starts munged, slurmctld
and slurmd from a generated config in a temp dir (we own their PIDs), submits
the batch script with sbatch --wait, and checks what every rank saw. Two ways
of starting the ranks are checked:

* direct launch: ``srun --mpi=pmix`` (Slurm's PMIx server starts the ranks;
  mpijax's Topology says launcher "slurm"). Works with the Open MPI wheel here:
  Open MPI 5 is a PMIx client, and Debian's mpi/pmix plugin (PMIx 4.2) serves it.
* mpirun inside the allocation (the fallback for MPIs Slurm cannot start):
  the ranks see the job's SLURM_* variables; mpijax reports launcher "prrte".

Preemption: a job of slurm/cpu.sbatch gets USR1 (as ``--signal=B:USR1@120``
sends it), the script passes it on through mpijax-run to every rank, the
program saves its state and exits 75, the script requeues the job, and the
requeued job resumes from the saved step and finishes.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import pytest
import slurm_cluster
from conftest import REPO
from conftest import assert_mpijax_sums
from conftest import read_reports

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(240)]

ENV_CAPTURE = "/tmp/slurm-env-capture.json"
NTASKS = 4


def _has_pmix_plugin() -> bool:
  return bool(glob.glob("/usr/lib/*/slurm-wlm/mpi_pmix*.so") + glob.glob("/usr/lib*/slurm/mpi_pmix*.so"))


def _daemon_pids(cluster) -> list[int]:
  return [p.pid for p in cluster.procs]


@pytest.fixture(scope="module")
def slurm():
  reason = slurm_cluster.why_unavailable()
  if reason:
    pytest.skip(reason)
  slurm_cluster.ensure_installed()
  root = tempfile.mkdtemp(prefix="mpijax-slurm-")
  os.chmod(root, 0o755)
  cluster = slurm_cluster.SlurmCluster(root=root, host=slurm_cluster.short_hostname(), cpus=NTASKS)
  started: list[int] = []
  try:
    cluster.start("pmix" if _has_pmix_plugin() else "none")
    started = _daemon_pids(cluster)
    yield cluster
  finally:
    logs = cluster.logs()
    cluster.stop()
    # Every daemon we started is gone, and no job step daemon outlives them.
    for pid in started:
      assert not _alive(pid), f"daemon pid {pid} survived stop()"
    end = time.monotonic() + 15
    while _stepds(root) and time.monotonic() < end:
      time.sleep(0.2)
    assert not _stepds(root), f"slurmstepd left behind: {_stepds(root)}\n{logs}"


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


def _stepds(root: str) -> list[int]:
  """Live slurmstepd processes of our cluster (they keep our config path in their environment)."""
  out = []
  for pid in subprocess.run(["pgrep", "-x", "slurmstepd"], capture_output=True, text=True).stdout.split():
    if _alive(int(pid)):
      try:
        with open(f"/proc/{pid}/environ", "rb") as f:
          env = f.read()
      except OSError:
        continue
      if root.encode() in env or b"SLURM_CONF" not in env:
        out.append(int(pid))
  return out


def _sbatch(cluster, launcher: str, out_file, program: list[str], ntasks: int = NTASKS) -> str:
  """Submits slurm/cpu.sbatch running ``program``; returns the job id."""
  argv = ["sbatch", "--parsable", f"--ntasks={ntasks}", "--nodes=1", "--time=5",
          f"--output={out_file}", f"--chdir={REPO}",
          f"--export=ALL,LAUNCHER={launcher},PYTHON={sys.executable},MPIJAX_TIMEOUT=60",
          str(REPO / "slurm" / "cpu.sbatch"), *program]
  r = cluster.run(argv, timeout=30)
  assert r.returncode == 0, f"sbatch failed: {r.stderr}\n{cluster.logs()}"
  return r.stdout.strip().split(";")[0]


def _job(cluster, job_id: str) -> dict[str, str]:
  info = cluster.run(["scontrol", "-o", "show", "job", job_id], timeout=20).stdout
  return dict(w.split("=", 1) for w in info.split() if "=" in w)


def _wait_finished(cluster, job_id: str, out_file, timeout: float) -> tuple[dict[str, str], str]:
  """Polls until the job left the queue for good; returns its fields and its output.

  (sbatch --wait backs off to tens of seconds between checks.) A requeued job
  passes through REQUEUED and PENDING again.
  """
  end = time.monotonic() + timeout
  fields: dict[str, str] = {}
  while time.monotonic() < end:
    fields = _job(cluster, job_id)
    if fields.get("JobState", "?") not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING",
                                            "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "?"):
      return fields, _read(out_file)
    time.sleep(0.5)
  cluster.run(["scancel", job_id], timeout=10)
  raise AssertionError(f"job {job_id} still {fields.get('JobState')} after {timeout} s:\n"
                       f"{_read(out_file)}\n{cluster.logs()}")


def _submit(cluster, launcher: str, outdir, timeout: float = 150) -> tuple[str, str]:
  """Submits slurm/cpu.sbatch running rank_report.py and waits for it; returns (job id, output)."""
  out_file = outdir.parent / f"job-{launcher}.out"
  job_id = _sbatch(cluster, launcher, out_file,
                   [sys.executable, str(REPO / "tests" / "system" / "rank_report.py"), str(outdir)])
  fields, job_output = _wait_finished(cluster, job_id, out_file, timeout)
  assert (fields.get("JobState"), fields.get("ExitCode")) == ("COMPLETED", "0:0"), \
      f"job {job_id}: {fields}\n{job_output}\n{cluster.logs()}"
  return job_id, job_output


def _read(path) -> str:
  try:
    with open(path, errors="replace") as f:
      return f.read()
  except OSError:
    return "(no job output)"


def _check_common(reports, job_id, job_output):
  assert len(reports) == NTASKS, f"{len(reports)} of {NTASKS} ranks reported:\n{job_output}"
  coordinators = {r["coordinator_address"] for r in reports}
  assert len(coordinators) == 1 and ":" in coordinators.pop(), reports
  for i, r in enumerate(reports):
    assert (r["rank"], r["size"]) == (i, NTASKS), r
    assert (r["local_rank"], r["local_size"], r["node_count"]) == (i, NTASKS, 1), r
    assert_mpijax_sums(r, NTASKS)  # collectives across all ranks, by mpijax's transport
    assert r["slurm_env"]["SLURM_JOB_ID"] == job_id, r["slurm_env"]


def test_cpu_sbatch_direct_srun_launch(slurm, report_dir):
  """mpijax-run picks srun inside the allocation; every rank learns rank/size/coordinator from Slurm."""
  job_id, job_output = _submit(slurm, "auto", report_dir)
  reports = read_reports(report_dir)
  _check_common(reports, job_id, job_output)
  for i, r in enumerate(reports):
    assert r["launcher"] == "slurm", (r, job_output)
    env = r["slurm_env"]
    # It ran as a job step with these tasks, and Slurm's variables say who it is.
    assert env["SLURM_PROCID"] == str(i) and env["SLURM_NTASKS"] == str(NTASKS), env
    assert env.get("SLURM_STEP_ID", env.get("SLURM_STEPID")) == "0", env
    assert env.get("SLURM_MPI_TYPE", "pmix").startswith("pmix"), env
  # srun --label tags the lines; mpijax-run shows each with one prefix, [rankN]: .
  assert "[rank0]: rank 0/" in job_output and "\n 0: " not in job_output, job_output
  # srun passes the ranks' output on line by line: rank 0's bar comes as lines.
  bars = re.findall(r"^\[rank(\d+)\]: (rank report: +\d+%\|.*\| \d/5 .*)$", job_output, flags=re.M)
  assert bars and {rank for rank, _ in bars} == {"0"}, job_output
  assert any("100%|" in bar and "5/5" in bar for _, bar in bars), bars
  # A real SLURM_* step environment for the cluster detector's unit-test fixture.
  with open(ENV_CAPTURE, "w") as f:
    json.dump(reports[1]["slurm_env"], f, indent=1, sort_keys=True)


def test_cpu_sbatch_mpirun_inside_allocation(slurm, report_dir):
  """The fallback: mpirun in the batch step starts the ranks; they still see the allocation."""
  job_id, job_output = _submit(slurm, "mpirun", report_dir)
  reports = read_reports(report_dir)
  _check_common(reports, job_id, job_output)
  for r in reports:
    assert r["launcher"] in ("prrte", "openmpi"), (r, job_output)
    assert r["slurm_env"]["SLURM_NTASKS"] == str(NTASKS), r["slurm_env"]


@pytest.mark.timeout(300)
def test_preempted_job_is_requeued_and_finishes(slurm, tmp_path):
  """USR1 to the batch script (what --signal=B:USR1@120 does before the time limit): the ranks
  save their state and exit 75, slurm/cpu.sbatch requeues the job, and the requeued job
  resumes from the saved step and completes."""
  state = tmp_path / "state"
  state.mkdir()
  os.chmod(tmp_path, 0o755)
  out_file = tmp_path / "job.out"
  steps = 16
  # 2 ranks: every rank is started twice, on 2 cores.
  job_id = _sbatch(slurm, "auto", out_file,
                   [sys.executable, str(REPO / "tests" / "system" / "resumable_job.py"), str(state),
                    str(steps), "0.2"], ntasks=2)
  end = time.monotonic() + 150
  saved = None
  while time.monotonic() < end:
    saved = _read_json(state / "state.json")
    if saved and saved["step"] >= 3:
      break
    assert _job(slurm, job_id).get("JobState") in ("PENDING", "CONFIGURING", "RUNNING"), _read(out_file)
    time.sleep(0.3)
  assert saved and saved["step"] >= 3, f"the job made no progress:\n{_read(out_file)}\n{slurm.logs()}"
  # To the batch shell only, as Slurm's --signal=B:USR1 does.
  r = slurm.run(["scancel", "--batch", "--signal=USR1", job_id], timeout=20)
  assert r.returncode == 0, r.stderr
  fields, output = _wait_finished(slurm, job_id, out_file, timeout=200)
  assert (fields.get("JobState"), fields.get("ExitCode")) == ("COMPLETED", "0:0"), \
      f"{fields}\n{output}\n{slurm.logs()}"
  assert fields.get("Restarts") == "1", fields
  assert "mpijax-cpu: got USR1, passing it on to the ranks" in output, output
  assert "got SIGUSR1; passing it on to every rank" in output, output
  preempted = [int(line.split("preempted after step ")[1].split(":")[0])
               for line in output.splitlines() if "preempted after step " in line]
  assert preempted and len(set(preempted)) == 1, output  # every rank stopped after the same step
  assert f"requeueing job {job_id}" in output, output
  assert "SLURM_RESTART_COUNT=1" in output and f"starting at step {preempted[0]}" in output, output
  done = _read_json(state / "done.json")
  assert done["step"] == steps and done["total"] == steps * (steps + 1) // 2, done
  assert done["resumed_from"] == preempted[0] and len(done["ranks"]) == steps, done
  print(output)


def _read_json(path):
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None
