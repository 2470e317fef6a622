"""All-reduce across two hosts joined by a 1 Gbit/s link: raw MPI, mpijax's own, XLA's.

The script builds two hosts on this machine: two network namespaces with
their own hostnames, joined by a veth pair on a private 10.232.N.0/24, each
veth end shaped with ``tc qdisc add dev VETH root tbf rate 1gbit burst 128kb
latency 50ms`` (both ends, so both directions are limited; netem is not
available here). It starts ``mpijax-run -n 2 --hostfile`` inside the first
host, one rank per host; Open MPI reaches the second host through an
rsh-style agent that enters that namespace, as ssh would, and talks TCP only,
over the veth subnet (``btl tcp,self``, ``btl_tcp_if_include`` and
``oob_tcp_if_include`` set to it). The host-building code is
tests/system/netns.py's, shared with the multi-host tests.

One rank per host, because this machine has 2 cores: with 2 ranks per host
4 processes share them, and raw ``MPI_Allreduce`` alone takes about 12 ms at
4 KiB; the scheduler, not the link or the library, would be measured.

Rows, each a blocking call (the result waited for), float32 sums of SIZE
bytes per rank:

* mpi4py ``Allreduce`` on NumPy buffers, out of place and in place;
* ``mpijax.ops.allreduce`` inside ``jax.jit``;
* ``mpijax.shard_map`` + ``mpijax.lax.psum`` inside ``jax.jit``;
* a jitted ``x.sum(0)`` of a global ``jax.Array`` sharded over the ranks
  (``P('x', None)``), for which XLA's partitioner inserts the all-reduce:
  after ``mpijax.init()`` it runs over MPI through mpijax's bridge.

Every row's result is checked against NumPy before it is timed (a wrong one
is never timed, and the script exits 1). Each row is then timed call by
call: after a warm-up, ``--calls`` blocking calls in rounds interleaved with
the other rows, and the table gives p10 / median / p90 per call in µs (each
the max over the ranks). Each timed call starts after a barrier (not timed),
so the ranks start it together with nothing of the previous call in flight.
``--back-to-back`` drops that barrier. Then, from about 1 MiB, every row,
raw MPI included, can take up to twice the link bound, the two directions
taking turns instead of running at once: most likely because a rank leaves
a call once it has received everything, while its own last bytes still wait
in its TCP send buffer and the shaper's queue, and the next call's messages
queue behind them.

The link bound. Each rank holds n bytes, and each needs every byte of the
other's contribution: whatever the algorithm, rank 0's result determines
rank 1's buffer (given rank 0's own), so at least n bytes must cross the link
in each direction. The link is full duplex (each veth end shapes its own
sending direction), so both directions run at once and an ideal 2-rank
all-reduce takes ``T_bound = 8 n / R`` seconds at R bit/s (reduce-scatter plus
all-gather sends n/2 + n/2 each way, a plain exchange n: both meet it).
At 1 Gbit/s: 4 MiB -> 33,554 µs, 4 KiB -> 32.8 µs. The bound counts payload
only: TCP/IP and Ethernet headers add about 4.6 % on the wire at a 1500-byte
MTU. And tbf lets a burst (128 KiB by default) through at the veth's own
speed when the link has idled, so a message below the burst size is not
limited by the rate at all (a 4 KiB row can beat its "bound"),
and a large one gains up to ``8 burst / R`` (1 ms). Each row is reported as
the share of the bound's speed, ``T_bound / median``.

Target: XLA's all-reduce (``jit x.sum(0)``) within 1.15x of mpijax's own
(each of its two rows) at 4 KiB and 4 MiB, medians of the same run.

Run it as root from a plain shell (it starts its own job), under the
machine's MPI lock if others share the machine::

  python benchmarks/multinode.py                     # 4 B, 4 KiB, 256 KiB, 4 MiB
  python benchmarks/multinode.py --sizes 4KiB,4MiB --calls 300
  python benchmarks/multinode.py --quick             # 4 KiB, 20 calls: a smoke test
  python benchmarks/multinode.py --back-to-back --sizes 4KiB,4MiB
  python benchmarks/multinode.py --launcher-args '--mca coll_tuned_use_dynamic_rules 1 \
      --mca coll_tuned_allreduce_algorithm 3'      # Open MPI's allreduce algorithm fixed

The namespaces, the veth pair, the qdiscs, the hosts files under /etc/netns
and the temporary files are removed at the end, also after an error, Ctrl-C
or SIGTERM/SIGHUP. Writes ``multinode.json``, ``.md`` and ``.png``
(``multinode_back_to_back.*`` with ``--back-to-back``) to ``--out``
(default ``benchmarks/results/``) and prints the table and the targets.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "tests", "system"))
import _common  # noqa: E402
import allreduce as ar  # noqa: E402
import netns  # noqa: E402
import partitioner_allreduce as pa  # noqa: E402
from _common import HarnessComm  # noqa: E402
from _common import Row  # noqa: E402

SCRIPT = os.path.abspath(__file__)
DEFAULT_SIZES = (4, 4 << 10, 256 << 10, 4 << 20)
QUICK_SIZES = (4 << 10,)
TARGET_SIZES = (4 << 10, 4 << 20)
TARGET_RATIO = 1.15
# Names and subnet of this script's hosts; tests/system/test_multihost.py uses mjx*, h* and 10.231.
NETNS_PREFIX, HOST_PREFIX, NET = "mjbn", "bn", "10.232"

# key -> label, in table order.
LABELS = {
  "raw_oop": "mpi4py Allreduce, NumPy, out of place",
  "raw_inplace": "mpi4py Allreduce, NumPy, in place",
  "mpijax_ops": "mpijax.ops.allreduce in jit",
  "mpijax_psum": "mpijax.shard_map + mpijax.lax.psum",
  "xla": "jit x.sum(0): XLA's all-reduce over MPI (mpijax bridge)",
}
MPIJAX_ROWS = ("mpijax_ops", "mpijax_psum")


# --- the link ----------------------------------------------------------------------

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


def rate_bits(rate: str) -> float:
  """tc's rate ('1gbit', '100mbit', '500kbit') in bit/s; tc's units are decimal."""
  m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmg]?bit)\s*", rate.lower())
  if not m:
    raise ValueError(f"cannot read rate {rate!r}; write it as tc does, e.g. 1gbit, 100mbit")
  return float(m.group(1)) * _RATE_UNITS[m.group(2)]


def bound_us(nbytes: int, rate: float) -> float:
  """The ideal 2-rank all-reduce time on a full-duplex link of ``rate`` bit/s: 8 n / R."""
  return 8 * nbytes / rate * 1e6


# --- inside the job: one rank per host ---------------------------------------------


def _calls_timer(args):
  def time_fn(steps, hc, nbytes):
    return _common.time_calls(
      steps,
      hc,
      calls=args.calls,
      warmup=args.warmup,
      rounds=min(args.rounds, args.calls),
      aligned=not args.back_to_back,
    )

  return time_fn


def phase_rows(args, sizes: list[int]) -> tuple[list[Row], dict[str, Any]]:
  import mpijax  # before jax: names mpijax's bridge for XLA (see docs/jax-integration.md)

  rt = mpijax.init()
  hc = HarnessComm()
  t = rt.topology
  if t.node_count != t.size:
    raise SystemExit(
      f"multinode.py wants 1 rank per host, got {t.size} ranks on {t.node_count} "
      f"hosts ({', '.join(t.hostnames)})"
    )
  if rt.xla_collectives != "mpi":
    ar._log(hc, f"XLA's collectives run over {rt.xla_collectives or 'nothing'}, not MPI")
  factories = {
    "raw_oop": lambda: ar._raw(hc, False),
    "raw_inplace": lambda: ar._raw(hc, True),
    "mpijax_ops": lambda: ar._jitted_allreduce(hc, ar._mpijax_fn(), LABELS["mpijax_ops"]),
    "mpijax_psum": lambda: pa._mpijax_factory(hc),
    "xla": lambda: pa._xla_factory(hc, "mpi"),
  }
  specs = [(k, LABELS[k], "multinode", factories[k]) for k in LABELS]
  rows = ar._measure(hc, specs, sizes, args, time_fn=_calls_timer(args))
  meta = _common.environment_info()
  meta.update(hostnames=list(t.hostnames), xla_collectives=rt.xla_collectives)
  return rows, meta


# --- outside: build the hosts, run the job, clean up ----------------------------------


class _Interrupted(BaseException):
  pass


_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


# The signal that stopped the run, and the job running then. The handler's
# exception is lost where it fires inside a garbage-collection callback (JAX
# registers one), so it also records the signal and ends the job itself.
_STOPPED_BY: list[int] = []
_JOBS: list[subprocess.Popen] = []


def _on_signal(signum, _frame):
  # Once: a second Ctrl-C must not cut the cleanup short.
  for s in _SIGNALS:
    signal.signal(s, signal.SIG_IGN)
  _STOPPED_BY.append(signum)
  for proc in _JOBS:
    _kill(proc, wait=False)
  raise _Interrupted(_stopped_text())


def _stopped_text() -> str:
  return f"stopped by {signal.Signals(_STOPPED_BY[0]).name}"


def _stream(proc: subprocess.Popen, log: list[str]) -> None:
  for line in proc.stdout:
    line = line.rstrip("\n")
    log.append(line)
    print(f"#   {line}", flush=True)


def run_job(
  args, sizes: list[int], tmp: str, hosts: netns.TwoHosts
) -> tuple[list[Row], dict[str, Any]] | str:
  """Builds the hosts, runs the measuring job across them; the rows, or why there are none."""
  with hosts:
    a, b = hosts.hosts
    print(
      f"# hosts: {a.name} ({a.netns}, {a.addr}) and {b.name} ({b.netns}, {b.addr}), "
      f"veth {' / '.join(dev for _, dev in hosts.veths)}",
      flush=True,
    )
    for cmd in hosts.shape_link(args.rate, args.burst, args.latency):
      print(f"# {cmd}", flush=True)
    for line in hosts.qdiscs():
      print(f"#   {line}", flush=True)
    agent = hosts.rsh_agent(os.path.join(tmp, "agent"))
    hostfile = os.path.join(tmp, "hostfile")
    with open(hostfile, "w") as f:
      f.write(f"{a.name} slots=1\n{b.name} slots=1\n")
    out = os.path.join(tmp, "phase.json")
    subnet = hosts.subnet
    # TCP only, and only on the shaped link: runtime wire-up (oob) and MPI traffic (btl tcp).
    mca = (
      f"--mca plm_ssh_agent {agent} --mca oob_tcp_if_include {subnet} "
      f"--mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include {subnet}"
    )
    if args.launcher_args:
      mca += " " + args.launcher_args
    phase_args = [
      "--sizes",
      ",".join(str(s) for s in sizes),
      "--calls",
      str(args.calls),
      "--warmup",
      str(args.warmup),
      "--rounds",
      str(args.rounds),
    ]
    if args.verbose:
      phase_args.append("--verbose")
    if args.back_to_back:
      phase_args.append("--back-to-back")
    launch = [
      sys.executable,
      "-m",
      "mpijax.launch",
      "-n",
      "2",
      "--hostfile",
      hostfile,
      "--timeout",
      str(int(args.timeout)),
      "--launcher-args",
      mca,
      "--",
      sys.executable,
      SCRIPT,
      "--phase",
      "measure",
      "--phase-out",
      out,
    ] + phase_args
    print(f"# job: {shlex.join(launch)}", flush=True)
    proc = subprocess.Popen(
      hosts.exec_argv(a, launch),
      cwd=REPO,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      start_new_session=True,
      env=_common.launcher_free_env(),
    )
    _JOBS.append(proc)
    if _STOPPED_BY:  # the signal came while the job was starting
      _kill(proc)
    # mpijax-run ends the job at --timeout; this is the guard should that fail.
    guard = threading.Timer(args.timeout + 30, lambda: _kill(proc))
    guard.start()
    log: list[str] = []
    try:
      _stream(proc, log)
      proc.wait()
    finally:
      guard.cancel()
      _kill(proc)
      _JOBS.remove(proc)
    if proc.returncode != 0 or not os.path.exists(out):
      tail = [line for line in log if re.search(r"\w", line)][-1:] or [""]
      return f"the job failed (exit code {proc.returncode}): {tail[0][:200]}"
    with open(out) as f:
      data = json.load(f)
    data["meta"]["link"] = {
      "rate": args.rate,
      "burst": args.burst,
      "latency": args.latency,
      "qdiscs": hosts.qdiscs(),
      "subnet": subnet,
      "mca": mca,
    }
  return [Row.from_json(r) for r in data["rows"]], data["meta"]


def _kill(proc: subprocess.Popen, wait: bool = True) -> None:
  if proc.poll() is None:
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    if wait:
      proc.wait()


def leftovers(tag: str) -> list[str]:
  """What of a run with ``tag`` is still on the machine (namespaces, hosts files)."""
  left = [
    f"network namespace {n}"
    for n in netns.netns_list()
    if n in (f"{NETNS_PREFIX}A{tag}", f"{NETNS_PREFIX}B{tag}")
  ]
  for side in "AB":
    d = os.path.join(netns.NETNS_ETC, f"{NETNS_PREFIX}{side}{tag}")
    if os.path.exists(d):
      left.append(d)
  # A veth end that escaped into this namespace would show here (it lives inside the hosts).
  r = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=20)
  left += [f"link {m}" for m in re.findall(rf"^\d+: ({NETNS_PREFIX}[ab]{tag})[@:]", r.stdout, re.M)]
  return left


# --- the report ------------------------------------------------------------------------


def _cell(r: Row, s: int) -> str:
  c = r.cells.get(s)
  if isinstance(c, str):
    return "WRONG RESULT" if c.startswith(_common.WRONG) else "–"
  if c is None:
    return "–"
  return " / ".join(_common._fmt_us(v) for v in (c.p10_us, c.median_us, c.p90_us))


def percentile_table(rows: list[Row], sizes: list[int], rate: float) -> str:
  head = "| method | " + " | ".join(_common.fmt_size(s) for s in sizes) + " |"
  lines = [head, "|---|" + "---:|" * len(sizes)]
  for r in rows:
    lines.append(f"| {r.label} | " + " | ".join(_cell(r, s) for s in sizes) + " |")
  lines.append(
    "| link bound 8 n / R | " + " | ".join(_common._fmt_us(bound_us(s, rate)) for s in sizes) + " |"
  )
  return "\n".join(lines)


def _pct(v: float) -> str:
  return f"{v:.0f} %" if v >= 10 else f"{v:.2g} %"


def bound_table(rows: list[Row], sizes: list[int], rate: float) -> str:
  head = "| method | " + " | ".join(_common.fmt_size(s) for s in sizes) + " |"
  lines = [head, "|---|" + "---:|" * len(sizes)]
  for r in rows:
    cells = [_pct(100 * bound_us(s, rate) / r.us(s)) if r.us(s) else "–" for s in sizes]
    lines.append(f"| {r.label} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def check_targets(rows: list[Row], sizes: list[int]) -> list[str]:
  t = _common.Targets(rows)
  for s in sizes:
    xla = t.get("xla", s)
    for key in MPIJAX_ROWS:
      ref = t.get(key, s)
      what = f"{_common.fmt_size(s)} XLA's all-reduce <= {TARGET_RATIO}x {LABELS[key]}"
      if s not in TARGET_SIZES:
        if xla is not None and ref is not None:
          t.lines.append(
            f"info  {_common.fmt_size(s)} XLA's all-reduce / {LABELS[key]}: "
            f"{xla:.1f} / {ref:.1f} us = {xla / ref:.2f}x"
          )
      elif xla is None or ref is None:
        t.line(None, f"{what}: missing")
      else:
        t.ratio(what, xla, ref, TARGET_RATIO)
        # Where a row's calls fall into modes (Open MPI's large all-reduce on this link), the
        # median follows whichever mode got more calls; the fast mode's p10 is steadier.
        xp, rp = t.by["xla"].us(s, "p10"), t.by[key].us(s, "p10")
        if xp and rp:
          t.lines.append(
            f"info  {_common.fmt_size(s)} p10: {xp:.1f} / {rp:.1f} us = {xp / rp:.2f}x"
          )
  missing = [s for s in TARGET_SIZES if s not in sizes]
  if missing:
    t.lines.append(
      f"(the targets are at 4 KiB and 4 MiB; this run has no "
      f"{', '.join(_common.fmt_size(s) for s in missing)})"
    )
  return t.lines


def _mode(args) -> str:
  return (
    "back to back (no barrier between calls)"
    if args.back_to_back
    else "each call after a barrier (not timed)"
  )


def report(rows: list[Row], sizes: list[int], args, meta: dict[str, Any]) -> int:
  order = list(LABELS)
  rows = sorted(rows, key=lambda r: order.index(r.key) if r.key in order else len(order))
  rate = rate_bits(args.rate)
  hosts = ", ".join(meta.get("hostnames", [])) or "?"
  title = (
    f"float32 sum all-reduce, 2 hosts x 1 rank ({hosts}), link tc tbf {args.rate} "
    f"burst {args.burst}: p10 / median / p90 µs per blocking call"
    + (", back to back" if args.back_to_back else "")
  )
  parts = [
    f"### {title}",
    "",
    percentile_table(rows, sizes, rate),
    "",
    f"Speed against the link bound (T_bound / median, T_bound = 8 n / R, R = {args.rate}):",
    "",
    bound_table(rows, sizes, rate),
  ]
  by = {r.key: r for r in rows}
  if by.get("mpijax_psum"):
    parts += [
      "",
      "Ratio to mpijax.shard_map + mpijax.lax.psum (medians):",
      "",
      _common.markdown_table(rows, sizes, ratio_to=by["mpijax_psum"]),
    ]
  notes = _common.skip_notes(rows)
  if notes:
    parts += ["", "Not measured:", ""] + notes
  targets = check_targets(rows, sizes)
  calls = next(
    (c.iters * c.trials for r in rows for c in r.cells.values() if isinstance(c, _common.Timing)),
    args.calls,
  )
  parts += (
    ["", "Targets:", "", "```"]
    + targets
    + [
      "```",
      "",
      f"{calls} calls per cell after {args.warmup} warm-up calls, in {args.rounds} rounds "
      f"interleaved across the rows, {_mode(args)}. Open MPI over TCP on the shaped link only "
      f"(pml ob1, btl tcp,self)"
      + (f", with `{args.launcher_args}`" if args.launcher_args else "")
      + ". "
      + _common.load_note(),
    ]
  )
  text = "\n".join(parts)
  print("\n" + text, flush=True)
  _common.write_report(
    args.out,
    "multinode_back_to_back" if args.back_to_back else "multinode",
    text,
    {
      "benchmark": "multinode",
      "nprocs": 2,
      "back_to_back": args.back_to_back,
      "sizes": sizes,
      "meta": meta,
      "bound_us": {str(s): bound_us(s, rate) for s in sizes},
      "targets": targets,
      "rows": [r.to_json() for r in rows],
    },
    rows,
    sizes,
    title,
  )
  return _common.exit_status(rows)


# --- entry -------------------------------------------------------------------------------


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument(
    "--sizes", default=None, help="comma-separated bytes per rank (default 4,4KiB,256KiB,4MiB)"
  )
  p.add_argument(
    "--calls",
    type=int,
    default=None,
    help="timed blocking calls per cell (default 200; 20 with --quick)",
  )
  p.add_argument(
    "--warmup",
    type=int,
    default=None,
    help="untimed calls per cell first (default 10; 3 with --quick)",
  )
  p.add_argument(
    "--rounds",
    type=int,
    default=10,
    help="rounds the calls are split into, interleaved across rows (default 10)",
  )
  p.add_argument(
    "--back-to-back",
    action="store_true",
    help="no barrier before each timed call (default: one, not timed)",
  )
  p.add_argument(
    "--launcher-args",
    default="",
    help="more mpirun arguments, one shell-quoted string, e.g. "
    "'--mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_allreduce_algorithm 3'",
  )
  p.add_argument("--rate", default="1gbit", help="tc tbf rate of each veth end (default 1gbit)")
  p.add_argument("--burst", default="128kb", help="tc tbf burst (default 128kb)")
  p.add_argument("--latency", default="50ms", help="tc tbf latency (default 50ms)")
  p.add_argument("--quick", action="store_true", help="smoke test: 4 KiB, 20 calls")
  p.add_argument("--timeout", type=float, default=900, help="seconds for the job (default 900)")
  p.add_argument("--out", default=_common.default_out_dir(), help="output directory")
  p.add_argument("--verbose", action="store_true")
  p.add_argument("--phase", default=None, help=argparse.SUPPRESS)
  p.add_argument("--phase-out", default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.calls is None:
    args.calls = 20 if args.quick else 200
  if args.warmup is None:
    args.warmup = 3 if args.quick else 10
  if args.calls < 1 or args.warmup < 0 or args.rounds < 1:
    p.error(
      f"--calls >= 1, --warmup >= 0 and --rounds >= 1 please (got {args.calls}, "
      f"{args.warmup}, {args.rounds})"
    )
  try:
    rate_bits(args.rate)
  except ValueError as e:
    p.error(f"--rate: {e}")
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    sizes = (
      _common.parse_sizes(args.sizes)
      if args.sizes
      else list(QUICK_SIZES if args.quick else DEFAULT_SIZES)
    )
  except ValueError as e:
    raise SystemExit(f"--sizes: {e}") from None

  if args.phase is not None:  # the job across the two hosts
    if args.phase != "measure":
      raise SystemExit(f"unknown --phase {args.phase!r}")
    rows, meta = phase_rows(args, sizes)
    return _common.finish_phase(args.phase_out, rows, meta)

  if _common.under_mpi_launcher():
    raise SystemExit(
      "multinode.py starts its own 2-host job: run it from a plain shell, not "
      "under mpirun/mpijax-run"
    )
  why = netns.why_unavailable() or (None if shutil.which("tc") else "tc is not installed")
  if why:
    print(f"multinode.py cannot run here: {why}", file=sys.stderr)
    return 2
  pid = os.getpid()
  tag = str(pid % 100000)
  hosts = netns.TwoHosts(
    tag=tag, subnet_octet=pid % 250 + 1, prefix=NETNS_PREFIX, host_prefix=HOST_PREFIX, net=NET
  )
  old = {s: signal.signal(s, _on_signal) for s in _SIGNALS}
  tmp = tempfile.mkdtemp(prefix="mpijax-multinode-")
  try:
    result = run_job(args, sizes, tmp, hosts)
  except _Interrupted:
    pass
  finally:
    # Again, with signals ignored: a signal may have cut the first cleanup short.
    for s in old:
      signal.signal(s, signal.SIG_IGN)
    hosts.cleanup()
    shutil.rmtree(tmp, ignore_errors=True)
    left = leftovers(tag)
    for s, h in old.items():
      signal.signal(s, h)
    if left:
      print(f"multinode.py: could not remove: {'; '.join(left)}", file=sys.stderr)
  if left:
    return 1
  print(f"# removed the namespaces, veth pair, qdiscs, /etc/netns files and {tmp}", flush=True)
  if _STOPPED_BY:
    print(f"multinode.py: {_stopped_text()}", file=sys.stderr)
    return 130
  if isinstance(result, str):
    print(f"multinode.py: {result}", file=sys.stderr)
    return 1
  rows, meta = result
  return report(rows, sizes, args, meta)


if __name__ == "__main__":
  sys.exit(main())
