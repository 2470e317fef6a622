"""``mpijax-run --doctor`` across two "hosts" (network namespaces joined by veth).

The same two fake hosts as test_multihost.py (netns.py: namespaces with
their own hostnames, a veth pair on a private subnet, an rsh-style agent),
4 ranks, 2 per host, Open MPI's shared memory within a host and TCP between
them on the veth subnet only. First the link as it is: every check passes,
the sweep runs within each host and across them, and the link carries at
least half of what it should. Then the link is shaped with ``tc tbf`` on
both veth ends (netns.TwoHosts.shape_link, as benchmarks/multinode.py does):
the doctor names the slow link, in both directions, and exits non-zero.
"""

from __future__ import annotations

import os
import re
import sys

import netns
import pytest
from conftest import REPO
from conftest import run

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(400)]

RATE = "100mbit"  # 12.5 MB/s: far below what the veth pair carries


@pytest.fixture
def two_hosts():
  reason = netns.why_unavailable()
  if reason:
    pytest.skip(reason)
  tag = str(os.getpid() % 100000)
  with netns.TwoHosts(
    tag=tag, subnet_octet=(os.getpid() + 7) % 250 + 1, prefix="mjd", host_prefix="d", net="10.233"
  ) as hosts:
    yield hosts
  assert not [n for n in netns.netns_list() if n.endswith(tag) and n.startswith("mjd")]


def _doctor(two_hosts, tmp_path) -> tuple[int, str]:
  a, b = two_hosts.hosts
  agent = two_hosts.rsh_agent(str(tmp_path / "agent"), login_env=True)
  hostfile = tmp_path / "hostfile"
  hostfile.write_text(f"{a.name} slots=2\n{b.name} slots=2\n")
  subnet = two_hosts.subnet
  mca = (
    f"--mca plm_ssh_agent {agent} --mca oob_tcp_if_include {subnet} "
    f"--mca pml ob1 --mca btl sm,tcp,self --mca btl_tcp_if_include {subnet}"
  )
  launch = [
    sys.executable,
    "-m",
    "mpijax.launch",
    "-n",
    "4",
    "--hostfile",
    str(hostfile),
    "--timeout",
    "150",
    "--launcher-args",
    mca,
    "--doctor",
  ]
  env = {k: v for k, v in os.environ.items() if not k.startswith("MPIJAX_")}
  result = run(two_hosts.exec_argv(a, launch), timeout=200, cwd=REPO, env=env)
  return result.returncode, result.stdout + result.stderr


def test_the_doctor_measures_both_paths_and_names_a_shaped_link(two_hosts, tmp_path):
  a, b = two_hosts.hosts
  code, out = _doctor(two_hosts, tmp_path)
  assert code == 0, out
  assert f"mpijax doctor: 4 ranks on 2 nodes ({a.name}, {b.name})" in out, out
  assert "FAIL" not in out, out
  assert re.search(r"ok    launcher: prrte, under mpijax-run; 4 ranks on 2 nodes", out), out
  for host in (a.name, b.name):
    assert f"ok    all-reduce within {host}: latency" in out, out
  assert re.search(r"ok    all-reduce across nodes: latency .* of raw MPI's", out), out
  for src, dst in ((a, b), (b, a)):
    assert re.search(
      rf"ok    link {src.name} -> {dst.name}: [\d.]+ [GMk]B/s over TCP, \d+% of "
      r"the [\d.]+ [GMk]B/s expected",
      out,
    ), out
  print(out)

  two_hosts.shape_link(RATE, "32kb", "50ms")
  code, out = _doctor(two_hosts, tmp_path)
  assert code == 3, out
  for src, dst in ((a, b), (b, a)):
    m = re.search(
      rf"FAIL  link {src.name} -> {dst.name}: ([\d.]+) ([GMk])B/s over TCP, (\d+)% "
      r"of the [\d.]+ [GMk]B/s expected \([^)]*\): below half; fix: a slow or shaped "
      r"link \(tc qdisc show dev \S+\)",
      out,
    )
    assert m, out
    rate = float(m[1]) * {"G": 1e9, "M": 1e6, "k": 1e3}[m[2]]
    assert rate < 20e6, out  # the shaper's 12.5 MB/s, give or take its burst
  # Nothing else failed: one line per failure.
  assert len(re.findall(r"^\[rank0\]:   FAIL ", out, re.M)) == 2, out
  print(out)
