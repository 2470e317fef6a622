"""The tests of mpi4jax's own suite that do not run against mpijax.compat.mpi4jax.

Each entry is a test id of mpi4jax's suite (a file, or file::test, which
also covers its parametrizations) and why it is left out. Everything else in
the suite must pass at 1, 2 and 4 ranks (tests/compat/mpi4jax_suite.py).
docs/mpi4jax.md lists the same entries (checked by tests/unit/test_compat_docs.py).
"""

from __future__ import annotations

# The mpi4jax release whose suite runs; its API is what the compat module matches.
MPI4JAX_VERSION = "0.9.1.post2"
# The sha256 of that release's sdist, as PyPI publishes it: a cached or downloaded
# file with another hash is not run.
MPI4JAX_SDIST_SHA256 = "1089ab81b22edf7273e5c94cfac4dadb4fc4b2d691af87d6eff85479c8f15a0a"

DEVIATIONS: dict[str, str] = {
    "tests/test_validation.py":
        "tests mpi4jax's private argument checker (mpi4jax._src.validation."
        "enforce_types), not its API; the compat module checks the same argument "
        "types with the same TypeError text",
    "tests/test_jax_compat.py":
        "tests mpi4jax's private JAX-version helpers (mpi4jax._src.jax_compat, "
        "its 'latest supported JAX' warning on reloading mpi4jax._src); mpijax "
        "checks its own minimum JAX version at import",
    "tests/test_decorators.py":
        "tests mpi4jax's private CUDA/SYCL extension checks (mpi4jax._src."
        "decorators); mpijax's transport runs on CPU devices, and "
        "has_cuda_support() / has_sycl_support() say so (False)",
    "tests/collective_ops/test_common.py::test_debug_logging":
        "tests mpi4jax's per-call debug log (mpi4jax._src.xla_bridge.set_logging); "
        "mpijax reports stalls and mismatches instead (MPIJAX_TIMEOUT, MPIJAX_CHECK)",
    "tests/collective_ops/test_common.py::test_set_logging_from_envvar":
        "tests mpi4jax's MPI4JAX_DEBUG variable of the same private log",
    "tests/collective_ops/test_common.py::test_mpi_abi_info":
        "tests mpi4jax's C extension (xla_bridge.mpi_xla_bridge_cpu.MPI_ABI_INFO); "
        "mpijax's extension checks its MPI family and version against mpi4py's "
        "when it loads",
    "tests/collective_ops/test_common.py::test_mpi_abi_compatibility_check":
        "tests mpi4jax's private ABI check (xla_bridge._check_mpi_abi_compatibility)",
    "tests/collective_ops/test_common.py::test_mpi_abi_skip_check":
        "tests mpi4jax's MPI4JAX_SKIP_ABI_CHECK variable of the same private check",
    "tests/collective_ops/test_common.py::test_abort_on_error":
        "expects mpi4jax's abort text 'r0 | MPI_Send returned error code' from a "
        "send to rank 100 of a one-rank job; the compat module refuses dest=100 "
        "before anything runs, with a ValueError naming the valid ranks (the "
        "process also exits non-zero)",
    "tests/collective_ops/test_sendrecv.py::test_sendrecv_jacfwd":
        "expects jax.jacfwd through sendrecv to raise RuntimeError; mpijax's "
        "sendrecv is differentiable in forward mode too (the tangent travels the "
        "value's path), so it returns the derivative instead",
}


def deviation(nodeid: str) -> str | None:
  """The reason ``nodeid`` (as pytest names it) is left out, or None."""
  for key, reason in DEVIATIONS.items():
    if nodeid == key or nodeid.startswith((key + "::", key + "[")):
      return reason
  return None
