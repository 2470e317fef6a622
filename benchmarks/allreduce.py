"""float32 sum all-reduce: mpijax inside jax.jit against what a user would pick instead.

Run it as an MPI job (every row, gloo phase included)::

  timeout 900 mpirun --allow-run-as-root --oversubscribe -n 2 python benchmarks/allreduce.py

or from a plain shell, which starts the mpirun jobs itself::

  python benchmarks/allreduce.py --np 2

Rows (median µs per operation, max over ranks):

* ``mpi4py Allreduce`` on NumPy buffers, out of place and in place: the floor.
* ``jax.jit(x + 1)``: the cost of one jitted dispatch, the floor of any
  collective called from jit; and the same op donated (>= 256 KiB), so the
  job shows what a fresh output buffer costs XLA's own op.
* ``mpijax.ops.allreduce`` in jit: one per jitted call; ten chained in one
  call (time per all-reduce); the input donated (in place, >= 256 KiB).
* ``mpi4jax.allreduce`` in jit, one per call and ten chained, if importable,
  in a job of its own that never loads mpijax (its import replaces some of
  JAX's lowering rules), with the raw and ``jax.jit(x + 1)`` rows timed again
  there to show how far the machine drifted between the jobs.
* JAX's own ``psum`` across processes (gloo, ``jax.distributed``), in its own
  phase: ``shard_map`` over a 1-D mesh of the P global CPU devices. That job
  also times the mpijax one-per-call row, interleaved with gloo's trials, and
  the gloo target compares those two: the VM's speed drifts between jobs.
* ``--env-row MPIJAX_TIMEOUT=0`` (repeatable) adds the mpijax rows measured in
  a job with that environment variable set, e.g. stall inspector off.

Writes ``allreduce_np{P}.json``, ``.md`` and ``.png`` to ``--out``
(default ``benchmarks/results/``) and prints the table and its targets.
Every row's result is checked against NumPy before it is timed; the script
exits 1 if any result is wrong.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
from _common import HarnessComm  # noqa: E402
from _common import Row  # noqa: E402
from _common import WrongResult  # noqa: E402

SCRIPT = os.path.abspath(__file__)
CHAIN = 10

# key -> label, in table order.
LABELS = {
    "raw_oop": "mpi4py Allreduce, NumPy, out of place",
    "raw_inplace": "mpi4py Allreduce, NumPy, in place",
    "jit_floor": "jax.jit(x + 1) (dispatch floor)",
    "jit_floor_donated": "jax.jit(x + 1), donated (written over its input)",
    "mpijax_1": "mpijax allreduce in jit, 1 per call",
    "mpijax_10": f"mpijax allreduce in jit, {CHAIN} chained (per op)",
    "mpijax_donated": "mpijax allreduce in jit, donated (in place)",
    "mpi4jax_1": "mpi4jax allreduce in jit, 1 per call",
    "mpi4jax_10": f"mpi4jax allreduce in jit, {CHAIN} chained (per op)",
    "raw_oop_mpi4jaxjob": "mpi4py Allreduce, NumPy, out of place [mpi4jax job]",
    "jit_floor_mpi4jaxjob": "jax.jit(x + 1) (dispatch floor) [mpi4jax job]",
    "gloo_psum": "JAX psum over gloo (jax.distributed)",
    "mpijax_1_gloojob": "mpijax allreduce in jit, 1 per call [gloo job]",
    "jit_floor_gloojob": "jax.jit(x + 1) (dispatch floor) [gloo job]",
}
DONATED_MIN_BYTES = 256 << 10


class Skip(Exception):
  """A row cannot run here; the message says why (printed under the table)."""


# --- step builders: nbytes -> (step, ops per step) ---------------------------------
#
# A builder compiles, checks the result once against NumPy, and returns a step
# that runs one call and blocks on it. Checking first means a wrong answer can
# never be reported as a fast one: it is a WRONG RESULT cell, and the script
# exits non-zero.

def _expect(got, want, what: str) -> None:
  _common.check_close(got, want, what, rtol=1e-5)


def pattern(n: int, rank: int):
  """Rank ``rank``'s input: it differs along the buffer, so a misplaced block shows."""
  import numpy as np
  return (np.arange(n) % 7 + rank + 1).astype(np.float32)


def pattern_sum(n: int, ranks: int, copies: int = 1):
  """The sum of ``pattern`` over ranks (each held by ``copies`` devices); exact in float32."""
  import numpy as np
  return copies * (ranks * (np.arange(n) % 7) + ranks * (ranks + 1) / 2)


def _raw(hc: HarnessComm, in_place: bool) -> Callable[[int], tuple[Callable[[], Any], int]]:
  import numpy as np
  MPI = hc.MPI

  def build(nbytes: int):
    n = nbytes // 4
    comm = hc.comm.Dup()  # its own communicator, as a user's code would have
    send = pattern(n, hc.rank)
    recv = np.empty(n, np.float32)
    if in_place:
      comm.Allreduce(MPI.IN_PLACE, send, op=MPI.SUM)
      _expect(send, pattern_sum(n, hc.size), "mpi4py in place")
      send[:] = 0  # zeros stay zeros, however often they are summed
      return (lambda: comm.Allreduce(MPI.IN_PLACE, send, op=MPI.SUM)), 1
    comm.Allreduce(send, recv, op=MPI.SUM)
    _expect(recv, pattern_sum(n, hc.size), "mpi4py out of place")
    return (lambda: comm.Allreduce(send, recv, op=MPI.SUM)), 1
  return build


def _jit_floor(hc: HarnessComm, donate: bool = False):
  import jax
  import jax.numpy as jnp

  def build(nbytes: int):
    if not donate:
      f = jax.jit(lambda x: x + 1)
      x = jnp.zeros(nbytes // 4, jnp.float32)
      _expect(f(x), 1.0, "jit(x + 1)")
      return (lambda: f(x).block_until_ready()), 1
    if nbytes < DONATED_MIN_BYTES:
      raise Skip(f"donated variant is measured from {_common.fmt_size(DONATED_MIN_BYTES)} on")
    f = jax.jit(lambda x: x + 1, donate_argnums=0)
    x = jnp.zeros(nbytes // 4, jnp.float32)
    y = f(x)
    _expect(y, 1.0, "jit(x + 1), donated")
    _require_donated(x)
    return _fed_back(f, y), 1
  return build


def _require_donated(x) -> None:
  if not x.is_deleted():
    raise Skip("XLA did not donate the input buffer on this platform")


def _fed_back(f, x):
  """A step that calls the donating ``f`` on its own last output, from ``x`` on."""
  state = [x]

  def step():
    state[0] = f(state[0])
    state[0].block_until_ready()
  return step


def _chain(reduce_fn, k: int):
  def f(x):
    for _ in range(k):
      x = reduce_fn(x)
    return x
  return f


def _jitted_allreduce(hc: HarnessComm, reduce_fn, what: str, *, chained: int = 1,
                      donate: bool = False):
  import jax
  import jax.numpy as jnp

  def build(nbytes: int):
    if donate and nbytes < DONATED_MIN_BYTES:
      raise Skip(f"donated variant is measured from {_common.fmt_size(DONATED_MIN_BYTES)} on")
    n = nbytes // 4
    body = _chain(reduce_fn, chained)
    if donate:
      f = jax.jit(body, donate_argnums=0)
      x = jnp.asarray(pattern(n, hc.rank))
      y = f(x)
      _expect(y, pattern_sum(n, hc.size), what)
      _require_donated(x)
      # Zeros stay zeros, so the output can be fed back in forever.
      return _fed_back(f, f(jnp.zeros(n, jnp.float32))), chained
    f = jax.jit(body)
    if chained > 1:  # the same x everywhere: each all-reduce multiplies it by the ranks
      x = jnp.asarray(pattern(n, 0))
      want = float(hc.size) ** chained * pattern(n, 0)
    else:
      x = jnp.asarray(pattern(n, hc.rank))
      want = pattern_sum(n, hc.size)
    _expect(f(x), want, what)
    return (lambda: f(x).block_until_ready()), chained
  return build


def _mpijax_fn():
  try:
    import mpijax
    import mpijax.ops
  except Exception as e:
    raise Skip(f"mpijax.ops not importable: {type(e).__name__}: {e}") from None
  if not hasattr(mpijax.ops, "allreduce"):
    raise Skip("mpijax.ops.allreduce does not exist yet")
  return lambda x: mpijax.ops.allreduce(x, "sum")


def _mpi4jax_fn(hc: HarnessComm):
  try:
    import mpi4jax
  except Exception as e:
    raise Skip(f"mpi4jax not importable: {type(e).__name__}: {e}") from None
  comm = hc.comm.Dup()
  SUM = hc.MPI.SUM

  def reduce_fn(x):
    out = mpi4jax.allreduce(x, op=SUM, comm=comm)
    return out[0] if isinstance(out, tuple) else out  # mpi4jax < 0.4 returned (x, token)
  return reduce_fn


# --- phases -------------------------------------------------------------------

def _measure(hc: HarnessComm, specs: list[tuple[str, str, str, Any]], sizes: list[int],
             args, time_fn: Callable[..., dict[str, _common.Timing]] | None = None) -> list[Row]:
  """Builds and times rows ``(key, label, phase, factory)`` at every size.

  At each size the rows' trials are interleaved (``_common.time_interleaved``,
  or ``time_fn(steps, hc, nbytes)`` when given) so that every method sees the
  same machine; every rank agrees on skips.
  """
  rows: list[Row] = []
  builds: dict[str, Any] = {}
  for key, label, phase, build_factory in specs:
    row = Row(key, label, phase)
    rows.append(row)
    factory_error = None
    try:
      builds[key] = build_factory()
    except Skip as e:
      factory_error = str(e)
    except Exception as e:
      factory_error = f"{type(e).__name__}: {e}"
    errors = hc.comm.allgather(_one_line(factory_error))
    if any(errors):
      reason = next(e for e in errors if e)
      row.cells = {s: reason for s in sizes}
      builds.pop(key, None)
      _log(hc, f"{label}: skipped: {reason}")
  for s in sizes:
    steps: dict[str, tuple[Any, int]] = {}
    for row in rows:
      if row.key not in builds:
        continue
      err, built = None, None
      try:
        built = builds[row.key](s)
      except Skip as e:
        err = str(e)
      except WrongResult as e:
        err = _common.WRONG + str(e)
      except Exception as e:
        err = f"{type(e).__name__}: {e}"
        if args.verbose:
          traceback.print_exc()
      errs = hc.comm.allgather(_one_line(err))
      if any(errs):
        row.cells[s] = next(e for e in errs if e)
        _log(hc, f"{row.label} @ {_common.fmt_size(s)}: not timed: {row.cells[s]}")
        continue
      steps[row.key] = built
    if time_fn is not None:
      timings = time_fn(steps, hc, s)
    else:
      trials = args.trials or (5 if args.quick else _common.default_trials(s))
      timings = _common.time_interleaved(steps, hc, trials=trials, trial_seconds=args.trial_seconds)
    for row in rows:
      if row.key in timings:
        t = row.cells[s] = timings[row.key]
        _log(hc, f"{row.label} @ {_common.fmt_size(s)}: {t.median_us:.2f} us "
                 f"(ranks {', '.join(f'{v:.2f}' for v in t.rank_medians_us)}; {t.iters} x {t.trials})")
    del steps, timings
  return rows


def _one_line(reason: str | None, limit: int = 300) -> str | None:
  """A skip reason fit for one table note (pybind/nanobind errors span lines)."""
  if reason is None:
    return None
  text = " ".join(reason.split())
  return text if len(text) <= limit else text[:limit - 3] + "..."


def _log(hc: HarnessComm, msg: str) -> None:
  if hc.rank == 0:
    print(msg, flush=True)


def _init_mpijax(**kwargs) -> str | None:
  """mpijax.init() when the runtime exists; the reason otherwise."""
  try:
    import mpijax
    mpijax.init(**kwargs)
    return None
  except Exception as e:
    return f"{type(e).__name__}: {e}"


def phase_main(args, sizes: list[int], *, only_mpijax: bool = False, suffix: str = "") -> list[Row]:
  init_error = _init_mpijax()
  hc = HarnessComm()
  if init_error:
    _log(hc, f"mpijax.init() failed: {init_error}")
  specs = []
  tag = f" [{suffix}]" if suffix else ""
  kt = f"@{suffix}" if suffix else ""

  def add(key, factory):
    specs.append((key + kt, LABELS[key] + tag, "main" + kt, factory))

  if not only_mpijax:
    add("raw_oop", lambda: _raw(hc, in_place=False))
    add("raw_inplace", lambda: _raw(hc, in_place=True))
    add("jit_floor", lambda: _jit_floor(hc))
    add("jit_floor_donated", lambda: _jit_floor(hc, donate=True))

  def mpijax_factory(**kw):
    def factory():
      if init_error:
        raise Skip(f"mpijax.init() failed: {init_error}")
      return _jitted_allreduce(hc, _mpijax_fn(), "mpijax allreduce", **kw)
    return factory

  add("mpijax_1", mpijax_factory())
  add("mpijax_10", mpijax_factory(chained=CHAIN))
  add("mpijax_donated", mpijax_factory(donate=True))
  return _measure(hc, specs, sizes, args)


def phase_mpi4jax(args, sizes: list[int]) -> list[Row]:
  """mpi4jax's rows, in a process that never loads mpijax, as mpi4jax's users run it."""
  hc = HarnessComm(plain=True)
  specs = [
      ("mpi4jax_1", LABELS["mpi4jax_1"], "mpi4jax",
       lambda: _jitted_allreduce(hc, _mpi4jax_fn(hc), "mpi4jax allreduce")),
      ("mpi4jax_10", LABELS["mpi4jax_10"], "mpi4jax",
       lambda: _jitted_allreduce(hc, _mpi4jax_fn(hc), "mpi4jax allreduce", chained=CHAIN)),
      ("raw_oop_mpi4jaxjob", LABELS["raw_oop_mpi4jaxjob"], "mpi4jax",
       lambda: _raw(hc, in_place=False)),
      ("jit_floor_mpi4jaxjob", LABELS["jit_floor_mpi4jaxjob"], "mpi4jax",
       lambda: _jit_floor(hc)),
  ]
  return _common.without_mpijax(_measure(hc, specs, sizes, args))


def start_jax_distributed() -> tuple[HarnessComm, str | None]:
  """jax.distributed over this MPI job with JAX's gloo collectives (the peer
  these rows stand for): mpijax.init(jax_distributed=True), else by hand."""
  try:
    import mpijax
    mpijax.config.update("xla_collectives", "gloo")
  except ImportError:
    pass
  err = _init_mpijax(jax_distributed=True)
  hc = HarnessComm()
  if err is None:
    return hc, None
  import socket

  import jax
  address = None
  if hc.rank == 0:
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      address = f"127.0.0.1:{s.getsockname()[1]}"
  address = hc.bcast(address)
  try:
    jax.distributed.initialize(coordinator_address=address, num_processes=hc.size,
                               process_id=hc.rank)
  except Exception as e:
    return hc, f"jax.distributed.initialize failed: {type(e).__name__}: {e}"
  return hc, None


def gloo_factory(hc: HarnessComm):
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  devices = jax.devices()
  if len(devices) != hc.size * len(jax.local_devices()):
    raise Skip(f"jax.distributed sees {len(devices)} devices, expected one set per rank")
  impl = jax.config.jax_cpu_collectives_implementation
  mesh = jax.sharding.Mesh(np.array(devices), ("i",))
  sharding = NamedSharding(mesh, P("i"))
  f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "i"), mesh=mesh, in_specs=P("i"),
                            out_specs=P("i")))
  L = len(jax.local_devices())

  def global_array(n: int, local):
    shards = [jax.device_put(jnp.asarray(local), d) for d in jax.local_devices()]
    return jax.make_array_from_single_device_arrays((len(devices) * n,), sharding, shards)

  def build(nbytes: int):
    n = nbytes // 4
    x = global_array(n, pattern(n, hc.rank))
    y = f(x)
    want = pattern_sum(n, hc.size, copies=L)
    for shard in y.addressable_shards:
      _expect(shard.data, want, f"gloo psum ({impl})")
    return (lambda: f(x).block_until_ready()), 1
  return build


def phase_gloo(args, sizes: list[int]) -> list[Row]:
  hc, err = start_jax_distributed()
  import jax
  impl = jax.config.jax_cpu_collectives_implementation
  label = LABELS["gloo_psum"].replace("gloo", impl or "gloo")

  def factory():
    if err:
      raise Skip(err)
    return gloo_factory(hc)

  def mpijax_factory():
    import mpijax
    if not mpijax.is_initialized():
      raise Skip("mpijax.init(jax_distributed=True) failed in this job")
    return _jitted_allreduce(hc, _mpijax_fn(), "mpijax allreduce")
  # mpijax's row in this job too, its trials interleaved with gloo's: the
  # gloo target compares these two, measured under the same machine state.
  # The jit(x + 1) floor in this job: what an element-wise op of the same
  # bytes costs next to gloo (printed with the target).
  return _measure(hc, [("gloo_psum", label, "gloo", factory),
                       ("mpijax_1_gloojob", LABELS["mpijax_1_gloojob"], "gloo",
                        mpijax_factory),
                       ("jit_floor_gloojob", LABELS["jit_floor_gloojob"], "gloo",
                        lambda: _jit_floor(hc))], sizes, args)


# --- orchestration ---------------------------------------------------------------

def _phase_args(args, sizes: list[int]) -> list[str]:
  out = ["--sizes", ",".join(str(s) for s in sizes),
         "--trial-seconds", str(args.trial_seconds)]
  if args.trials:
    out += ["--trials", str(args.trials)]
  if args.quick:
    out += ["--quick"]
  return out


def _subphases(args) -> list[tuple[str, dict[str, str]]]:
  """(phase name, environment) of every phase that needs its own mpirun job."""
  phases = [("mpi4jax", {})]
  if not args.no_gloo:
    # A gloo job from its start, as a user's: mpijax binds no rank to a core then.
    phases.append(("gloo", {"MPIJAX_XLA_COLLECTIVES": "gloo"}))
  for spec in args.env_row:
    name, _, value = spec.partition("=")
    phases.append((f"mpijax-env:{spec}", {name: value}))
  return phases


def run_sub(args, sizes, nprocs, phase, env) -> list[Row] | str:
  res = _common.run_phase(SCRIPT, nprocs, phase, _phase_args(args, sizes), env=env,
                          timeout=args.phase_timeout)
  return res if isinstance(res, str) else res[0]


def _failed_rows(phase: str, reason: str, sizes) -> list[Row]:
  if phase == "gloo":
    return [Row("gloo_psum", LABELS["gloo_psum"], "gloo", {s: reason for s in sizes})]
  if phase == "mpi4jax":
    return [Row(k, LABELS[k], "mpi4jax", {s: reason for s in sizes})
            for k in ("mpi4jax_1", "mpi4jax_10")]
  spec = phase.split(":", 1)[1]
  return [Row(k + "@" + spec, LABELS[k] + f" [{spec}]", "main@" + spec, {s: reason for s in sizes})
          for k in ("mpijax_1", "mpijax_10", "mpijax_donated")]


def check_targets(rows: list[Row], sizes: list[int], nprocs: int) -> list[str]:
  """The targets as PASS / FAIL / N/A lines."""
  t = _common.Targets(rows)
  get, line, out = t.get, t.line, t.lines

  if 4 in sizes:
    m1, m4j, m10 = get("mpijax_1", 4), get("mpi4jax_1", 4), get("mpijax_10", 4)
    t.at_most("4 B, 1 per call <= 20 us", m1, 20)
    t.ratio("4 B, 1 per call <= 0.1x mpi4jax (its own job)", m1, m4j, 0.1)
    # The jobs ran one after the other: how far the machine drifted between them.
    for key, what in (("raw_oop", "mpi4py out of place"), ("jit_floor", "jax.jit(x + 1)")):
      a, b = get(f"{key}_mpi4jaxjob", 4), get(key, 4)
      if a is not None and b is not None:
        out.append(f"info  4 B {what}, mpi4jax job / main job: {a:.2f} / {b:.2f} us = "
                   f"{a / b:.3f}x")
    t.at_most(f"4 B, {CHAIN} chained <= 6 us per op", m10, 6)
  for s in sizes:
    if s < 256 << 10:
      continue
    for key, base, name in (("mpijax_1", "raw_oop", "out of place"),
                            ("mpijax_donated", "raw_inplace", "in place (donated)")):
      t.ratio(f"{_common.fmt_size(s)} {name} <= 1.2x raw", get(key, s), get(base, s), 1.2)
  # Without donation XLA gives the all-reduce a fresh output buffer on every
  # call; a NumPy user reduces one hot buffer in place. The target holds the
  # out-of-place jitted call to that in-place floor at 4 MiB (64 MiB: info),
  # on medians; the fastest trials are shown too, since Open MPI's in-place
  # figure can differ several-fold between jobs.
  for s in sizes:
    if s not in (4 << 20, 64 << 20):
      continue
    v, b = get("mpijax_1", s), get("raw_inplace", s)
    name = f"{_common.fmt_size(s)} out of place (no donation) <= 1.1x raw in place"
    if v is None or b is None:
      line(None, f"{name}: missing")
      continue
    vb, bb = t.by["mpijax_1"].us(s, "best"), t.by["raw_inplace"].us(s, "best")
    fastest = f" (fastest trials {vb:.1f} / {bb:.1f} us = {vb / bb:.3f}x)" if vb and bb else ""
    if s == 4 << 20:
      t.ratio(name, v, b, 1.1, extra=fastest)
    else:
      out.append(f"info  {name}: {v:.1f} / {b:.1f} us = {v / b:.3f}x{fastest}")
    # The floor of any out-of-place jitted op on these bytes: it reads the
    # input and writes a fresh output, as jit(x + 1) does.
    floor = get("jit_floor", s)
    if floor is not None:
      out.append(f"info  {_common.fmt_size(s)} jax.jit(x + 1) / raw in place, same job: "
                 f"{floor:.1f} / {b:.1f} us = {floor / b:.2f}x")
    # What the fresh output alone costs, against the 10 % margin: XLA's own
    # x + 1 against the same op written over its input, and the all-reduce
    # against its donated call.
    fd, d = get("jit_floor_donated", s), get("mpijax_donated", s)
    if floor is not None and fd is not None and d is not None:
      out.append(f"info  {_common.fmt_size(s)} a fresh output's cost, same job: jax.jit(x + 1) "
                 f"{floor:.1f} against {fd:.1f} us donated (+{floor - fd:.1f} us = "
                 f"{(floor - fd) / b:.2f}x raw in place); the all-reduce {v:.1f} against "
                 f"{d:.1f} us donated (+{v - d:.1f} us = {(v - d) / b:.2f}x)")
  for s in sizes:
    if s > 4 << 20:
      continue
    # Against mpijax timed in the gloo job itself, interleaved with gloo;
    # the main job's row is the fallback (and is shown for information).
    v, g, main = get("mpijax_1_gloojob", s), get("gloo_psum", s), get("mpijax_1", s)
    where = "same job"
    if v is None:
      v, where = main, "main job"
    if t.ratio(f"{_common.fmt_size(s)} >= 10x faster than gloo psum", g, v, 10, at_least=True,
               extra=f" ({where})") is None:
      continue
    if where == "same job" and main is not None:
      out.append(f"info  {_common.fmt_size(s)} gloo psum / mpijax of the main job: "
                 f"{g:.1f} / {main:.1f} us = {g / main:.1f}x")
    # From 1 MiB a jitted all-reduce costs mostly memory traffic: it reads its
    # input and writes a fresh output, as jit(x + 1) does. When the VM's memory
    # is slow, gloo (latency-bound TCP) slows less, and this ratio shows how far
    # even an element-wise op of the same bytes is from gloo in this job.
    floor = get("jit_floor_gloojob", s)
    if floor is not None and s >= 1 << 20:
      out.append(f"info  {_common.fmt_size(s)} gloo psum / jax.jit(x + 1) of the same bytes, same job: "
                 f"{g:.1f} / {floor:.1f} us = {g / floor:.1f}x")
  if nprocs != 2:
    out.append(f"(targets are stated for 2 ranks; this run has {nprocs})")
  return out


def report(rows: list[Row], sizes: list[int], nprocs: int, args, meta: dict[str, Any]) -> None:
  order = list(LABELS)
  rows = sorted(rows, key=lambda r: (order.index(r.key.split("@")[0]), r.key))
  by = {r.key: r for r in rows}
  title = f"float32 sum allreduce, {nprocs} ranks: median µs per op (max over ranks)"
  parts = [f"### {title}", "", _common.markdown_table(rows, sizes)]
  if by.get("raw_oop"):
    parts += ["", "Ratio to raw mpi4py out of place:", "",
              _common.markdown_table(rows, sizes, ratio_to=by["raw_oop"])]
  m4j = by.get("mpi4jax_1")
  if m4j and any(m4j.us(s) is not None for s in sizes):
    parts += ["", "Ratio to mpi4jax (1 per call):", "",
              _common.markdown_table(rows, sizes, ratio_to=m4j)]
  parts += ["", "Fastest trial instead of the median (µs, max over ranks; less sensitive to "
             "other load on the machine, not used for the targets):", "",
             _common.markdown_table(rows, sizes, stat="best")]
  notes = _common.skip_notes(rows)
  if notes:
    parts += ["", "Not measured:", ""] + notes
  targets = check_targets(rows, sizes, nprocs)
  parts += ["", "Targets:", "", "```"] + targets + ["```"]
  parts += ["", _common.load_note()]
  text = "\n".join(parts)
  print("\n" + text, flush=True)

  _common.write_report(args.out, f"allreduce_np{nprocs}", text,
                       {"benchmark": "allreduce", "nprocs": nprocs, "sizes": sizes, "meta": meta,
                        "targets": targets, "rows": [r.to_json() for r in rows]}, rows, sizes, title)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--sizes", default=None,
                 help="comma-separated sizes per rank, e.g. 4,4KiB,256KiB,4MiB,64MiB (default)")
  p.add_argument("--trials", type=int, default=None,
                 help="trials per cell (default 30 below 1 MiB, 10 from 1 MiB; 5 with --quick)")
  p.add_argument("--trial-seconds", type=float, default=0.005,
                 help="target length of one trial; sets the steps per trial (default 0.005)")
  p.add_argument("--quick", action="store_true", help="smoke test: 4 B, 4 KiB, 256 KiB; 5 trials")
  p.add_argument("--out", default=_common.default_out_dir(), help="output directory")
  p.add_argument("--np", type=int, default=2,
                 help="ranks when started from a plain shell (under mpirun: the job's size)")
  p.add_argument("--no-gloo", action="store_true", help="skip the jax.distributed gloo phase")
  p.add_argument("--env-row", action="append", default=[], metavar="NAME=VALUE",
                 help="also measure the mpijax rows in a job with this environment variable "
                      "(repeatable), e.g. MPIJAX_TIMEOUT=0")
  p.add_argument("--phase-timeout", type=float, default=600, help="seconds per sub-job")
  p.add_argument("--verbose", action="store_true")
  p.add_argument("--phase", default=None, help=argparse.SUPPRESS)
  p.add_argument("--phase-out", default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  for spec in args.env_row:
    if "=" not in spec or not spec.split("=", 1)[0]:
      p.error(f"--env-row wants NAME=VALUE, got {spec!r}")
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  sizes = (_common.parse_sizes(args.sizes) if args.sizes
           else list(_common.QUICK_SIZES if args.quick else _common.DEFAULT_SIZES))

  if args.phase is not None:  # one sub-job of an orchestrated run
    if args.phase == "main":
      rows = phase_main(args, sizes)
    elif args.phase == "gloo":
      rows = phase_gloo(args, sizes)
    elif args.phase == "mpi4jax":
      rows = phase_mpi4jax(args, sizes)
    elif args.phase.startswith("mpijax-env:"):
      rows = phase_main(args, sizes, only_mpijax=True, suffix=args.phase.split(":", 1)[1])
    else:
      raise SystemExit(f"unknown --phase {args.phase!r}")
    return _common.finish_phase(args.phase_out, rows)

  if _common.under_mpi_launcher():
    # The user's mpirun job measures the main rows itself; rank 0 then runs each
    # extra phase as a fresh mpirun job of the same size while the others sleep.
    rows = phase_main(args, sizes)
    hc = HarnessComm()
    meta = _common.environment_info()
    if hc.rank == 0:
      for phase, env in _subphases(args):
        res = run_sub(args, sizes, hc.size, phase, env)
        rows += _failed_rows(phase, res, sizes) if isinstance(res, str) else res
      report(rows, sizes, hc.size, args, meta)
    hc.idle_barrier()
    return hc.bcast(_common.exit_status(rows) if hc.rank == 0 else None)

  # Plain shell: every phase is its own mpirun job.
  rows: list[Row] = []
  meta: dict[str, Any] = {}
  for phase, env in [("main", {})] + _subphases(args):
    res = _common.run_phase(SCRIPT, args.np, phase, _phase_args(args, sizes), env=env,
                            timeout=args.phase_timeout)
    if isinstance(res, str):
      if phase == "main":
        print(res, file=sys.stderr)
        return 1
      rows += _failed_rows(phase, res, sizes)
    else:
      rows += res[0]
      meta = meta or res[1]
  report(rows, sizes, args.np, args, meta)
  return _common.exit_status(rows)


if __name__ == "__main__":
  sys.exit(main())
