"""Two fake hosts on one machine: network namespaces joined by a veth pair.

Each "host" is a network namespace with loopback and one veth end in a
private /24 that exists only between the two namespaces. Hostnames come from
a UTS namespace entered per process (``unshare --uts`` + ``hostname``), and
name resolution from /etc/netns/<ns>/hosts, which ``ip netns exec``
bind-mounts over /etc/hosts for processes in that namespace only -- the
machine's own /etc/hosts is never touched.

``rsh_agent()`` writes an rsh-style agent (``agent HOST CMD...``) that enters
HOST's namespace and hostname and runs CMD there, as ``ssh HOST CMD`` would.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import signal
import subprocess
import time

NETNS_ETC = "/etc/netns"


def why_unavailable() -> str | None:
  if os.geteuid() != 0:
    return "creating network namespaces needs root"
  for tool in ("ip", "unshare", "hostname"):
    if not shutil.which(tool):
      return f"{tool} is not installed"
  probe = f"mjxprobe{os.getpid()}"
  r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=20)
  if r.returncode != 0:
    return f"'ip netns add' fails here: {r.stderr.strip()}"
  subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=20)
  return None


def _ip(*args: str) -> None:
  subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


@dataclasses.dataclass
class Host:
  name: str  # hostname inside the fake host
  netns: str
  addr: str


@dataclasses.dataclass
class TwoHosts:
  """hA and hB: namespaces, veth pair, addresses, /etc/netns hosts files. Use as a context manager."""
  tag: str
  subnet_octet: int
  hosts: list[Host] = dataclasses.field(default_factory=list)
  _created_netns: list[str] = dataclasses.field(default_factory=list)
  _created_dirs: list[str] = dataclasses.field(default_factory=list)
  _made_netns_etc: bool = False

  @property
  def subnet(self) -> str:
    return f"10.231.{self.subnet_octet}.0/24"

  def __enter__(self) -> TwoHosts:
    try:
      self._setup()
    except BaseException:
      self.cleanup()
      raise
    return self

  def __exit__(self, *exc) -> None:
    self.cleanup()

  def _setup(self) -> None:
    a = Host(f"ha{self.tag}", f"mjxA{self.tag}", f"10.231.{self.subnet_octet}.1")
    b = Host(f"hb{self.tag}", f"mjxB{self.tag}", f"10.231.{self.subnet_octet}.2")
    self.hosts = [a, b]
    for h in self.hosts:
      _ip("netns", "add", h.netns)
      self._created_netns.append(h.netns)
      _ip("-n", h.netns, "link", "set", "lo", "up")
    va, vb = f"mjxa{self.tag}"[:15], f"mjxb{self.tag}"[:15]
    # Created inside namespace A so no veth end ever appears in the host's namespace by name.
    _ip("-n", a.netns, "link", "add", va, "type", "veth", "peer", "name", vb, "netns", b.netns)
    for h, dev in ((a, va), (b, vb)):
      _ip("-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", dev)
      _ip("-n", h.netns, "link", "set", dev, "up")
    if not os.path.isdir(NETNS_ETC):
      os.makedirs(NETNS_ETC)
      self._made_netns_etc = True
    hosts_text = "127.0.0.1 localhost\n" + "".join(f"{h.addr} {h.name}\n" for h in self.hosts)
    for h in self.hosts:
      d = os.path.join(NETNS_ETC, h.netns)
      os.makedirs(d)
      self._created_dirs.append(d)
      with open(os.path.join(d, "hosts"), "w") as f:
        f.write(hosts_text)
    # The veth link needs a moment before the first packet gets through.
    end = time.monotonic() + 10
    while subprocess.run(["ip", "netns", "exec", a.netns, "ping", "-c", "1", "-W", "1", b.addr],
                         capture_output=True, timeout=20).returncode != 0:
      if not shutil.which("ping") or time.monotonic() > end:
        break
      time.sleep(0.2)

  def exec_argv(self, host: Host, argv: list[str]) -> list[str]:
    """argv run on ``host``: in its network namespace, with its hostname."""
    script = 'hostname "$0" && exec "$@"'
    return ["ip", "netns", "exec", host.netns, "unshare", "--uts", "sh", "-c", script, host.name, *argv]

  def rsh_agent(self, path: str) -> str:
    """Writes an rsh-style agent ``path HOST CMD...`` (CMD is a shell command line, as for ssh)."""
    cases = "\n".join(f"  {h.name}) ns={h.netns} ;;" for h in self.hosts)
    with open(path, "w") as f:
      f.write(f"""#!/bin/sh
# rsh-style agent for the test's fake hosts: enter HOST's netns and hostname, run CMD.
host=$1; shift
case $host in
{cases}
  *) echo "agent: unknown host $host" >&2; exit 255 ;;
esac
exec ip netns exec "$ns" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$host" "$*"
""")
    os.chmod(path, 0o755)
    return path

  def pids(self) -> list[int]:
    out = []
    for ns in self._created_netns:
      r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=20)
      out += [int(p) for p in r.stdout.split()]
    return out

  def cleanup(self) -> None:
    """Kills what still runs in the namespaces, deletes them (and the veth) and the hosts files."""
    for _ in range(3):
      pids = self.pids()
      if not pids:
        break
      for pid in pids:
        try:
          os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
      time.sleep(0.3)
    for ns in self._created_netns:
      subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
    self._created_netns.clear()
    for d in self._created_dirs:
      shutil.rmtree(d, ignore_errors=True)
    self._created_dirs.clear()
    if self._made_netns_etc:
      try:
        os.rmdir(NETNS_ETC)
      except OSError:
        pass
      self._made_netns_etc = False


def netns_list() -> list[str]:
  r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20)
  return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def quote(argv: list[str]) -> str:
  return shlex.join(argv)
