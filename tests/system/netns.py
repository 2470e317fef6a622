"""Two fake hosts on one machine: network namespaces joined by a veth pair.

Each "host" is a network namespace with loopback and one veth end in a
private /24 that exists only between the two namespaces. Hostnames come from
a UTS namespace entered per process (``unshare --uts`` + ``hostname``), and
name resolution from /etc/netns/<ns>/hosts, which ``ip netns exec``
bind-mounts over /etc/hosts for processes in that namespace only -- the
machine's own /etc/hosts is never touched.

``rsh_agent()`` writes an rsh-style agent (``agent HOST CMD...``) that enters
HOST's namespace and hostname and runs CMD there, as ``ssh HOST CMD`` would.
``shape_link()`` limits both veth ends with a token-bucket qdisc (tc tbf), so
the pair behaves like a link of a given rate. benchmarks/multinode.py uses
this module too, with its own name prefix and subnet.
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
  """hA and hB: namespaces, veth pair, addresses, /etc/netns hosts files. Use as a context manager.

  Names are ``{prefix}A{tag}`` (namespaces), ``{prefix}a{tag}`` (veth ends) and
  ``{host_prefix}a{tag}`` (hostnames); the subnet is ``{net}.{subnet_octet}.0/24``.
  Users that may run at the same time need distinct prefixes and nets.
  """
  tag: str
  subnet_octet: int
  prefix: str = "mjx"
  host_prefix: str = "h"
  net: str = "10.231"
  hosts: list[Host] = dataclasses.field(default_factory=list)
  veths: list[tuple[Host, str]] = dataclasses.field(default_factory=list)
  _created_netns: list[str] = dataclasses.field(default_factory=list)
  _created_dirs: list[str] = dataclasses.field(default_factory=list)
  _made_netns_etc: bool = False
  _qdiscs: list[tuple[str, str]] = dataclasses.field(default_factory=list)

  @property
  def subnet(self) -> str:
    return f"{self.net}.{self.subnet_octet}.0/24"

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
    hp, p, net = self.host_prefix, self.prefix, f"{self.net}.{self.subnet_octet}"
    a = Host(f"{hp}a{self.tag}", f"{p}A{self.tag}", f"{net}.1")
    b = Host(f"{hp}b{self.tag}", f"{p}B{self.tag}", f"{net}.2")
    self.hosts = [a, b]
    for h in self.hosts:
      _ip("netns", "add", h.netns)
      self._created_netns.append(h.netns)
      _ip("-n", h.netns, "link", "set", "lo", "up")
    va, vb = f"{p}a{self.tag}"[:15], f"{p}b{self.tag}"[:15]
    # Created inside namespace A so no veth end ever appears in the host's namespace by name.
    _ip("-n", a.netns, "link", "add", va, "type", "veth", "peer", "name", vb, "netns", b.netns)
    self.veths = [(a, va), (b, vb)]
    for h, dev in self.veths:
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

  def rsh_agent(self, path: str, login_env: bool = False) -> str:
    """Writes an rsh-style agent ``path HOST CMD...`` (CMD is a shell command line, as for ssh).

    ``login_env``: CMD gets only ``PATH`` and ``HOME`` of the caller's
    environment, as ssh gives a login (the rest reaches it only if the
    launcher passes it on); else all of it.
    """
    cases = "\n".join(f"  {h.name}) ns={h.netns} ;;" for h in self.hosts)
    env = 'env -i PATH="$PATH" HOME="$HOME" ' if login_env else ""
    with open(path, "w") as f:
      f.write(f"""#!/bin/sh
# rsh-style agent for the test's fake hosts: enter HOST's netns and hostname, run CMD.
host=$1; shift
case $host in
{cases}
  *) echo "agent: unknown host $host" >&2; exit 255 ;;
esac
exec ip netns exec "$ns" {env}unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$host" "$*"
""")
    os.chmod(path, 0o755)
    return path

  def shape_link(self, rate: str, burst: str, latency: str) -> list[str]:
    """Puts ``tc qdisc ... root tbf`` on both veth ends (both directions); returns the commands.

    The qdiscs go with the veth when the namespaces are deleted; ``cleanup()``
    also removes them first, explicitly.
    """
    cmds = []
    for h, dev in self.veths:
      argv = ["tc", "-n", h.netns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst",
              burst, "latency", latency]
      r = subprocess.run(argv, capture_output=True, text=True, timeout=20)
      if r.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} failed: {r.stderr.strip()}")
      self._qdiscs.append((h.netns, dev))
      cmds.append(shlex.join(argv))
    return cmds

  def qdiscs(self) -> list[str]:
    """``tc qdisc show`` of each veth end, one line per qdisc."""
    out = []
    for h, dev in self.veths:
      r = subprocess.run(["tc", "-n", h.netns, "qdisc", "show", "dev", dev], capture_output=True,
                         text=True, timeout=20)
      out += [f"{h.netns}/{dev}: {line}" for line in r.stdout.splitlines() if line.strip()]
    return out

  def pids(self) -> list[int]:
    out = []
    for ns in self._created_netns:
      r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=20)
      out += [int(p) for p in r.stdout.split()]
    return out

  def cleanup(self) -> None:
    """Kills what still runs in the namespaces, deletes their qdiscs, them (and the veth) and the
    hosts files."""
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
    for ns, dev in self._qdiscs:
      subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True,
                     timeout=20)
    self._qdiscs.clear()
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
