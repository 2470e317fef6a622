"""mpijax's interpreter-start hook (run by ``mpijax-startup.pth``).

Under a multi-rank launcher (mpirun, srun, mpiexec), names mpijax's MPI
bridge in MPITRAMPOLINE_LIB before anything imports JAX, so that a program
importing ``jax`` before ``mpijax`` still gets XLA's collectives over MPI
(jaxlib reads the variable once, when it loads). Does nothing when the
variable is set, in a single process, or when mpijax is told not to use
XLA's MPI collectives (MPIJAX_XLA_COLLECTIVES=gloo, MPIJAX_JAX_DISTRIBUTED=0);
never raises. The bridge links no library and runs no code until XLA's MPI
collectives are selected, so naming it costs other programs nothing. See
mpijax/_src/ffi/bridge_env.py.
"""

import os
import sys


def _run() -> None:
  if "MPITRAMPOLINE_LIB" in os.environ:
    return
  if not any(os.environ.get(v, "1").isdigit() and int(os.environ.get(v, "1")) > 1
             for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS")):
    return
  import importlib.util
  spec = importlib.util.find_spec("mpijax")  # finds the package without importing it
  if spec is None or not spec.submodule_search_locations:
    return
  # An editable install lists the installed binaries' directory and the sources'.
  src = next((os.path.join(d, "_src") for d in spec.submodule_search_locations
              if os.path.exists(os.path.join(d, "_src", "ffi", "bridge_env.py"))), None)
  if src is None:
    return

  def load(name):
    s = importlib.util.spec_from_file_location(f"_mpijax_startup_{os.path.basename(name)}",
                                               os.path.join(src, f"{name}.py"))
    module = importlib.util.module_from_spec(s)
    sys.modules[s.name] = module  # dataclasses looks its module up
    s.loader.exec_module(module)
    return module

  config, bridge_env = load("config"), load("ffi/bridge_env")
  here = os.path.dirname(os.path.abspath(__file__))
  bridge_env.select(os.path.join(here, "mpijax", "_src", "ffi", bridge_env.LIB_NAME),
                    collectives=config.get("xla_collectives"),
                    distributed=config.get("jax_distributed"))


try:
  _run()
except Exception:  # noqa: BLE001 -- a startup hook must never break Python
  pass
