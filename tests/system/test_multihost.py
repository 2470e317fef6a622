"""A 4-rank mpijax job across two "hosts" (network namespaces joined by veth), over TCP only.

The test makes two network namespaces with their own hostnames (UTS
namespaces), a veth pair in a private 10.231.N.0/24 that exists only between
them, and name resolution for both names through /etc/netns/<ns>/hosts. It
starts ``mpijax-run -n 4 --hostfile`` (2 slots per host) inside the first
host; Open MPI reaches the second host through an rsh-style agent that enters
that namespace, as ssh would. Every rank must see node count 2, local ranks
0/1 on each host, the coordinator on the first host, and the correct sum of an
mpijax allreduce across hosts. Namespaces, veth and hosts files are removed in
a finalizer, always.
"""

from __future__ import annotations

import os
import sys

import pytest

from conftest import REPO, assert_mpijax_sums, read_reports, run

import netns

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
  agent = two_hosts.rsh_agent(str(tmp_path / "agent"))
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

  result = run(two_hosts.exec_argv(a, launch + program), timeout=150, cwd=REPO,
               env={**os.environ, "MPIJAX_TIMEOUT": "60"})
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
  print(output)
