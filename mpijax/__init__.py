"""mpijax: one JAX program across many MPI ranks.

Each MPI rank is one JAX controller. ``mpijax.init()`` finds out who it is
from the launcher (Open MPI, Slurm, MPICH) and gives JAX code collectives
whose named axis spans every device of every rank.
"""

import sys as _sys

from mpijax._src import config as config
from mpijax._src.run import cpu_bind as _cpu_bind
from mpijax._src.ffi import settings as _ffi_settings
from mpijax._src import heap as _heap
from mpijax._src import log as _log
from mpijax._src.run import common as _launch_common

_as_launcher = _launch_common.started_as_launcher(getattr(_sys, "orig_argv", []))
try:
  # mpijax's warnings and notices show on stderr unless the program configured
  # logging itself (see mpijax/_src/log.py).
  _log.install()

  # Before MPI and JAX start their threads: see mpijax/_src/heap.py and
  # mpijax/_src/run/cpu_bind.py.
  _heap.configure()
  _cpu_bind.configure()
  _ffi_settings.set_oversubscribed(_cpu_bind.oversubscribed())

  from mpijax._src.xla import distributed as _jax_runtime

  # Before JAX is imported: jaxlib reads MPITRAMPOLINE_LIB (which MPI library XLA's
  # collectives use) once, when it loads. See mpijax/_src/ffi/bridge_env.py.
  _jax_runtime.prepare_environment()
except ValueError:
  # A malformed MPIJAX_* value: mpijax-run's own process reports it (and every
  # other) before the launch, without a traceback.
  if not _as_launcher:
    raise

# The process of ``mpijax-run`` itself only starts the job: it leaves JAX and
# the API below unloaded (about 0.7 s of every launch on a 2-core machine).
if not _as_launcher:
  from mpijax._src.guards import arrival as _arrival

  # Tells mpijax-run that this rank started (see mpijax/_src/guards/arrival.py).
  _arrival.hello()

  # Before the modules that lower with JAX internals: a too old JAX fails here
  # (jax_compat checks the version when imported), with the versions, instead of
  # with a TypeError from deep inside them.
  from mpijax._src import jax_compat as _jax_compat  # noqa: E402, F401

  from mpijax._src.sharding.sharded_checkpoint import load as load
  from mpijax._src.sharding.sharded_checkpoint import save as save
  from mpijax._src.sharding.global_array import GlobalArray as GlobalArray
  from mpijax._src.sharding.pmap import pmap as pmap
  from mpijax._src.sharding.shard_map import shard_map as shard_map
  from mpijax._src.sharding.mesh import GlobalMesh as GlobalMesh
  from mpijax._src.sharding.mesh import make_mesh as make_mesh
  from mpijax._src.ops import jax_rules as _jax_rules
  from mpijax._src.sharding.reshard import reshard as reshard
  from mpijax._src.runtime.state import DeviceInfo as DeviceInfo
  from mpijax._src.runtime.state import Runtime as Runtime
  from mpijax._src.runtime.state import Topology as Topology
  from mpijax._src.runtime.state import devices as devices
  from mpijax._src.runtime.state import init as init
  from mpijax._src.runtime.state import is_initialized as is_initialized
  from mpijax._src.runtime.state import local_device_count as local_device_count
  from mpijax._src.runtime.state import local_devices as local_devices
  from mpijax._src.runtime.state import process_count as process_count
  from mpijax._src.runtime.state import process_index as process_index
  from mpijax._src.runtime.state import shutdown as shutdown
  from mpijax._src.sharding.visualize import visualize_sharding as visualize_sharding

  # The public submodules, after the names they use.
  from mpijax import lax as lax
  from mpijax import ops as ops

  # mpijax's lowering rules for jit, shard_map and XLA's collectives, so that the
  # order token reaches every MPI call (see mpijax/_src/ops/jax_rules.py).
  _jax_rules.install()

__version__ = "0.1.0"

__all__ = [
  "DeviceInfo",
  "GlobalArray",
  "GlobalMesh",
  "Runtime",
  "Topology",
  "config",
  "devices",
  "init",
  "is_initialized",
  "load",
  "local_device_count",
  "local_devices",
  "make_mesh",
  "pmap",
  "process_count",
  "process_index",
  "reshard",
  "save",
  "shard_map",
  "shutdown",
  "visualize_sharding",
]
