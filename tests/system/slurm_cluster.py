"""A throwaway one-node Slurm (munged + slurmctld + slurmd) on this machine, for tests.

Everything lives in a temporary directory; the daemons run in the foreground
(-D / -F) as our children, so we own their PIDs and stop exactly them.
Debian's slurm-wlm and munge are installed with apt when missing.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import time

# Debian's mpi/pmix plugin dlopens .../pmix2/lib/libpmix.so, which only libpmix-dev ships.
PACKAGES = ("slurm-wlm", "munge", "libpmix2", "libpmix-dev")
INSTALL_TIMEOUT = 150
# Seconds a job step credential lives, and a requeued job waits (+1 s) before it runs again.
CRED_EXPIRE = 10


def why_unavailable() -> str | None:
  """None when a Slurm can be set up here, else the reason."""
  if os.geteuid() != 0:
    return "starting slurmctld/slurmd/munged needs root"
  if not all(shutil.which(b) for b in ("slurmctld", "slurmd", "munged", "sbatch")) and \
      not shutil.which("apt-get"):
    return "Slurm is not installed and apt-get is not available to install it"
  return None


def ensure_installed() -> None:
  """apt-get installs slurm-wlm and munge if any daemon or client is missing."""
  if all(shutil.which(b) for b in ("slurmctld", "slurmd", "munged", "sbatch", "srun", "mungekey")) and \
      _dpkg_installed("libpmix-dev"):
    return
  env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
  subprocess.run(["apt-get", "update", "-q"], env=env, check=True, timeout=INSTALL_TIMEOUT,
                 stdout=subprocess.DEVNULL)
  subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES],
                 env=env, check=True, timeout=INSTALL_TIMEOUT, stdout=subprocess.DEVNULL)


def _dpkg_installed(package: str) -> bool:
  out = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True)
  return out.returncode == 0 and "install ok installed" in out.stdout


def mpi_plugins() -> list[str]:
  """MPI plugin types this Slurm's srun offers (e.g. ['cray_shasta', 'none', 'pmi2', 'pmix'])."""
  out = subprocess.run(["srun", "--mpi=list"], capture_output=True, text=True, timeout=30)
  text = out.stdout + out.stderr
  names = []
  for line in text.splitlines():
    word = line.strip().split()[-1] if line.strip() else ""
    if word and not word.endswith(":") and word.replace("_", "").replace("x", "").isalnum():
      names.append(word)
  return [n for n in names if n in ("none", "pmi2", "pmix", "cray_shasta") or n.startswith("pmix_")]


@dataclasses.dataclass
class SlurmCluster:
  root: str
  host: str
  cpus: int
  procs: list[subprocess.Popen] = dataclasses.field(default_factory=list)
  env: dict[str, str] = dataclasses.field(default_factory=dict)

  @property
  def conf(self) -> str:
    return os.path.join(self.root, "etc", "slurm.conf")

  def write_config(self, mpi_default: str) -> None:
    for d in ("etc", "ctld", "spool", "log", "run", "munge", "jobs"):
      os.makedirs(os.path.join(self.root, d), exist_ok=True)
    conf = f"""\
ClusterName=mpijaxtest
SlurmctldHost={self.host}
SlurmctldPort={self.port}
SlurmdPort={self.port + 1}
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={self.root}/ctld
SlurmdSpoolDir={self.root}/spool
SlurmctldPidFile={self.root}/run/slurmctld.pid
SlurmdPidFile={self.root}/run/slurmd.pid
SlurmctldLogFile={self.root}/log/slurmctld.log
SlurmdLogFile={self.root}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
# A requeued job becomes eligible after cred_expire; the main loop looks at it every 60 s by default.
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault={mpi_default}
ReturnToService=2
# Register the node with the CPUs written here, not the cores found: 4 task slots on a 2-core machine.
SlurmdParameters=config_overrides
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
MinJobAge=300
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} Sockets=1 CoresPerSocket={self.cpus} ThreadsPerCore=1 RealMemory=1000 State=UNKNOWN
PartitionName=test Nodes={self.host} Default=YES MaxTime=10 State=UP OverSubscribe=YES
"""  # noqa: E501
    with open(self.conf, "w") as f:
      f.write(conf)

  port: int = 0

  def _spawn(self, argv: list[str], log: str) -> subprocess.Popen:
    out = open(os.path.join(self.root, "log", log), "ab")
    p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                         start_new_session=True)
    self.procs.append(p)
    return p

  def start(self, mpi_default: str) -> None:
    self.port = _free_port_pair()
    self.write_config(mpi_default)
    key = os.path.join(self.root, "munge", "munge.key")
    sock = os.path.join(self.root, "munge", "munge.socket")
    subprocess.run(["mungekey", "--create", "--keyfile", key, "--force"], check=True, timeout=30)
    os.chmod(key, 0o400)
    os.chmod(os.path.join(self.root, "munge"), 0o700)
    self.env = {**os.environ, "SLURM_CONF": self.conf}
    for k in list(self.env):
      if k.startswith("SLURM_") and k != "SLURM_CONF":
        del self.env[k]
    self._spawn(["munged", "-F", "--force", "--key-file", key, "--socket", sock,
                 "--pid-file", os.path.join(self.root, "munge", "munged.pid"),
                 "--log-file", os.path.join(self.root, "log", "munged.log"),
                 "--seed-file", os.path.join(self.root, "munge", "seed")], "munged.out")
    _wait(lambda: os.path.exists(sock), 20, "munged did not create its socket")
    # Slurm's auth/munge plugin finds munged through this option. cred_expire also sets
    # how long a requeued job waits before it may start again (default 120 s).
    with open(self.conf, "a") as f:
      f.write(f"AuthInfo=socket={sock},cred_expire={CRED_EXPIRE}\n")
    self._spawn(["slurmctld", "-D", "-i", "-f", self.conf], "slurmctld.out")
    self._spawn(["slurmd", "-D", "-f", self.conf, "-N", self.host], "slurmd.out")
    _wait(self.node_idle, 60, "the node did not become idle:\n" + self.logs())

  def node_idle(self) -> bool:
    for p in self.procs:
      if p.poll() is not None:
        raise RuntimeError(f"{p.args[0]} exited with {p.returncode}:\n" + self.logs())
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=self.env, capture_output=True,
                         text=True, timeout=20)
    return out.returncode == 0 and out.stdout.strip().rstrip("*") in ("idle",)

  def run(self, argv: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env={**self.env, **kw.pop("env", {})}, capture_output=True,
                          text=True, timeout=timeout, **kw)

  def logs(self, tail: int = 30) -> str:
    out = []
    for name in ("munged.log", "slurmctld.log", "slurmd.log", "slurmctld.out", "slurmd.out"):
      path = os.path.join(self.root, "log", name)
      if os.path.exists(path):
        with open(path, errors="replace") as f:
          lines = f.read().splitlines()[-tail:]
        out.append(f"--- {name}\n" + "\n".join(lines))
    return "\n".join(out)

  def stop(self) -> None:
    """Cancels jobs, then stops exactly the daemons we started (TERM, then KILL)."""
    try:
      subprocess.run(["scancel", "--full", "-u", "root"], env=self.env, capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
      pass
    for p in reversed(self.procs):  # slurmd, slurmctld, then munged
      if p.poll() is None:
        try:
          os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
          pass
        try:
          p.wait(timeout=10)
        except subprocess.TimeoutExpired:
          os.killpg(p.pid, signal.SIGKILL)
          p.wait(timeout=10)
    self.procs.clear()


def _free_port_pair() -> int:
  for _ in range(50):
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      port = s.getsockname()[1]
    if port < 65000:
      try:
        with socket.socket() as s2:
          s2.bind(("127.0.0.1", port + 1))
        return port
      except OSError:
        continue
  raise RuntimeError("no two consecutive free ports for slurmctld/slurmd")


def _wait(pred, timeout: float, message: str) -> None:
  end = time.monotonic() + timeout
  while time.monotonic() < end:
    if pred():
      return
    time.sleep(0.3)
  raise TimeoutError(message)


def short_hostname() -> str:
  return socket.gethostname().split(".")[0]
