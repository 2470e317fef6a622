"""A 4-rank mpijax job across two "hosts" (network namespaces joined by veth), over TCP only.

The test makes two network namespaces with their own hostnames (UTS
namespaces), a veth pair in a private 10.231.N.0/24 that exists only between
them, and name resolution for both names through /etc/netns/<ns>/hosts. It
starts ``mpijax-run -n 4 --hostfile`` (2 slots per host) inside the first
host; Open MPI reaches the second host through an rsh-style agent that enters
that namespace, as ssh would. Every rank must see node count 2, local ranks
0/1 on each host, the coordinator on the first host, and the correct sum of an
mpijax allreduce across hosts; the ranks on the second host, started through an
agent that passes on no variable ssh would not, see the JAX_* and XLA_FLAGS
settings of the launching shell (mpijax-run exports them). A second test loses the second host in the
middle of a job (its processes killed, the rsh agent refusing it from then on)
and checks that ``mpijax-run --max-restarts --min-ranks`` finishes the job on
the first host. Namespaces, veth and hosts files are removed in a finalizer,
always.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import netns
import pytest
from conftest import REPO
from conftest import assert_mpijax_sums
from conftest import read_reports
from conftest import run

from mpijax._src.xla import compile_cache

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(180)]


@pytest.fixture
def two_hosts():
  reason = netns.why_unavailable()
  if reason:
    pytest.skip(reason)
  tag = str(os.getpid() % 100000)
  with netns.TwoHosts(tag=tag, subnet_octet=os.getpid() % 250 + 1) as hosts:
    yield hosts
  # Nothing of ours is left: no namespace, no hosts file (the veth dies with its namespaces).
  assert not [n for n in netns.netns_list() if n.endswith(tag) and n.startswith("mjx")]
  assert not any(os.path.exists(os.path.join(netns.NETNS_ETC, h.netns)) for h in hosts.hosts)


def test_four_ranks_on_two_hosts(two_hosts, report_dir, tmp_path):
  a, b = two_hosts.hosts
  agent = two_hosts.rsh_agent(str(tmp_path / "agent"), login_env=True)
  hostfile = tmp_path / "hostfile"
  hostfile.write_text(f"{a.name} slots=2\n{b.name} slots=2\n")
  subnet = two_hosts.subnet
  # TCP only, and only on the test subnet: runtime wire-up (oob) and MPI traffic (btl tcp).
  mca = (f"--mca plm_ssh_agent {agent} --mca oob_tcp_if_include {subnet} "
         f"--mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include {subnet}")
  launch = [sys.executable, "-m", "mpijax.launch", "-n", "4", "--hostfile", str(hostfile),
            "--timeout", "120", "--launcher-args", mca]
  program = ["--", sys.executable, str(REPO / "tests" / "system" / "rank_report.py"), str(report_dir)]

  dry = run(two_hosts.exec_argv(a, launch + ["--dry-run"] + program), timeout=60, cwd=REPO)
  assert dry.returncode == 0, dry.stderr
  assert "--oversubscribe" not in dry.stdout  # 4 ranks fit the hostfile's 2+2 slots

  settings = {"JAX_TRACEBACK_FILTERING": "off", "XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") and k != "XLA_FLAGS"}
  result = run(two_hosts.exec_argv(a, launch + program), timeout=150, cwd=REPO,
               env={**env, "MPIJAX_TIMEOUT": "60", **settings})
  output = result.stdout + result.stderr
  assert result.returncode == 0, output
  reports = read_reports(report_dir)
  assert len(reports) == 4, output
  assert [r["gethostname"] for r in reports] == [a.name, a.name, b.name, b.name], output
  coordinator_host = reports[0]["coordinator_address"].rsplit(":", 1)[0]
  for i, r in enumerate(reports):
    assert (r["rank"], r["size"]) == (i, 4), r
    assert r["node_count"] == 2 and r["node_index"] == i // 2, r
    assert (r["local_rank"], r["local_size"]) == (i % 2, 2), r
    assert r["hostnames"] == [a.name, a.name, b.name, b.name], r
    # One coordinator, on the first host (by address on the test subnet, or by name).
    assert r["coordinator_address"] == reports[0]["coordinator_address"], r
    assert coordinator_host in (a.addr, a.name), r
    # Crossed the veth (ranks 2, 3 live in the other namespace), by mpijax's transport.
    assert_mpijax_sums(r, 4)
    # JAX's and XLA's settings reached every host (Open MPI's -x, by mpijax-run).
    # mpijax-run adds the job's compile cache directory (under the launching user's home).
    expected = {**settings, compile_cache.JAX_ENV: compile_cache.job_directory("auto", env)}
    assert r["jax_env"] == expected, r["jax_env"]
  # The straggler report paired every rank's collectives: rank 0 measured the other
  # host's clock (a ping-pong with its first rank, rank 2) at the end of the job.
  compared = re.search(r"stragglers over the job: none; (\d+) collectives compared across 4 ranks",
                       output)
  assert compared and int(compared.group(1)) >= 3, output
  print(output)


def _refuse(agent: str, host) -> None:
  """Makes the rsh agent fail for ``host`` the way ssh fails for a dead machine (exit 255)."""
  with open(agent) as f:
    lines = f.read().splitlines()
  lines = [f'  {host.name}) echo "ssh: connect to host {host.name} port 22: No route to host" >&2; exit 255 ;;'
           if line.strip().startswith(f"{host.name})") else line for line in lines]
  tmp = agent + ".new"
  with open(tmp, "w") as f:
    f.write("\n".join(lines) + "\n")
  os.chmod(tmp, 0o755)
  os.replace(tmp, agent)


@pytest.mark.timeout(300)
def test_lost_host_job_completes_on_the_remaining_ranks(two_hosts, tmp_path):
  """4 ranks on two hosts; the second host's processes are killed and it cannot be reached
  any more: mpijax-run drops it (--min-ranks 2) and the job finishes on the first host's 2
  ranks, continuing from its last saved step."""
  a, b = two_hosts.hosts
  agent = two_hosts.rsh_agent(str(tmp_path / "agent"))
  hostfile = tmp_path / "hostfile"
  hostfile.write_text(f"{a.name} slots=2\n{b.name} slots=2\n")
  state, logs = tmp_path / "state", tmp_path / "logs"
  state.mkdir()
  subnet = two_hosts.subnet
  mca = (f"--mca plm_ssh_agent {agent} --mca oob_tcp_if_include {subnet} "
         f"--mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include {subnet}")
  steps = 30
  launch = [sys.executable, "-m", "mpijax.launch", "-n", "4", "--hostfile", str(hostfile),
            "--timeout", "240", "--max-restarts", "2", "--restart-backoff", "0.5", "--min-ranks", "2",
            "--log-dir", str(logs), "--launcher-args", mca, "--",
            sys.executable, str(REPO / "tests" / "system" / "resumable_job.py"), str(state), str(steps), "0.3"]
  proc = subprocess.Popen(two_hosts.exec_argv(a, launch), cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env={**os.environ, "MPIJAX_TIMEOUT": "60"},
                          start_new_session=True)
  try:
    killed_at = None
    end = time.monotonic() + 180
    while time.monotonic() < end and proc.poll() is None:
      saved = _read_json(state / "state.json")
      if saved and saved["step"] >= 3:
        killed_at = saved["step"]
        break
      time.sleep(0.2)
    assert killed_at is not None, _output(proc, logs)
    # The host dies: its processes go, and nothing can be started there again.
    _refuse(agent, b)
    for pid in _netns_pids(b.netns):
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    out, err = proc.communicate(timeout=240)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
  text = out + err
  assert proc.returncode == 0, text + _logs(logs)
  attempts = [json.loads(line) for line in (logs / "attempts.jsonl").read_text().splitlines()]
  assert [a_["verdict"] for a_ in attempts] == ["failed", "ok"], attempts
  assert attempts[0]["ranks"] == 4 and attempts[1]["ranks"] == 2 and attempts[1]["hosts"] == [a.name]
  assert f"dropping host {b.name}" in err and f"going on with 2 ranks on {a.name}:2" in err, err
  done = _read_json(state / "done.json")
  # Every step ran once, summed over all ranks of its attempt: 4 before the loss, 2 after.
  assert done["step"] == steps and done["total"] == steps * (steps + 1) // 2, done
  assert done["attempt"] == 1 and done["resumed_from"] >= killed_at, done
  assert set(done["ranks"][:killed_at]) == {4} and set(done["ranks"][done["resumed_from"]:]) == {2}, done
  print(text)


def _read_json(path):
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def _netns_pids(ns: str) -> list[int]:
  r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=20)
  return [int(p) for p in r.stdout.split()]


def _logs(logs) -> str:
  return "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(logs.glob("*.log")))


def _output(proc, logs) -> str:
  if proc.poll() is None:
    os.killpg(proc.pid, signal.SIGKILL)
  out, err = proc.communicate()
  return out + err + _logs(logs)


def test_ranks_on_two_hosts_sharing_a_cache_compile_each_program_once(two_hosts, tmp_path):
  """A cache directory both hosts see (as a shared filesystem would show it): one rank of the
  job compiles each program, the other host's ranks wait for its claim (judged by its time, not
  its process: another host) and load its entry."""
  a, b = two_hosts.hosts
  agent = two_hosts.rsh_agent(str(tmp_path / "agent"))
  hostfile = tmp_path / "hostfile"
  hostfile.write_text(f"{a.name} slots=2\n{b.name} slots=2\n")
  subnet = two_hosts.subnet
  mca = (f"--mca plm_ssh_agent {agent} --mca oob_tcp_if_include {subnet} "
         f"--mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include {subnet}")
  launch = [sys.executable, "-m", "mpijax.launch", "-n", "4", "--hostfile", str(hostfile),
            "--timeout", "120", "--launcher-args", mca, "--", sys.executable,
            str(REPO / "tests" / "scripts" / "compile_cache_job.py"), "share"]
  env = {**os.environ, "MPIJAX_TIMEOUT": "60", "MPIJAX_COMPILE_CACHE": str(tmp_path / "cache")}
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  result = run(two_hosts.exec_argv(a, launch), timeout=150, cwd=REPO, env=env)
  output = result.stdout + result.stderr
  assert result.returncode == 0, output
  rows = [json.loads(line.split("RESULT ", 1)[1]) for line in output.splitlines() if "RESULT " in line]
  assert len(rows) == 4, output
  for program in ("jit_rank_program", "jit_global_program"):
    hows = {r["rank"]: how for r in rows for name, how, _ in r["outcomes"] if name == program}
    assert sorted(hows.values()).count("compiled") == 1, (program, hows)  # once per job
    compiler = next(rank for rank, how in hows.items() if how == "compiled")
    other_host = [rank for rank in hows if rank // 2 != compiler // 2]
    assert all(hows[rank] in ("waited", "loaded") for rank in other_host), (program, hows)
  assert {tuple(r["glob"]) for r in rows} == {tuple(rows[0]["glob"])}
