"""Build step: does the jaxlib this build sees accept the bridge just built?

Runs MPItrampoline's own checks (mpijax/_src/ffi/bridge_env.py, probe) and
writes the answer beside the library, keyed by the (bridge, jaxlib) pair, so
mpijax need not check again at run time for that jaxlib. A refusal is a
warning, not a build error: mpijax then uses gloo for XLA's collectives and
says why.

Usage: python check_bridge.py LIBRARY OUT.json
"""

import importlib.util
import json
import os
import sys


def main() -> int:
  library, out = sys.argv[1], sys.argv[2]
  here = os.path.dirname(os.path.abspath(__file__))
  path = os.path.join(here, "..", "bridge_env.py")
  spec = importlib.util.spec_from_file_location("_mpijax_bridge_env", path)
  bridge_env = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bridge_env)
  verdicts = {}
  jaxlib_so = bridge_env.jaxlib_library()
  if jaxlib_so is None:
    print("mpijax: warning: no jaxlib to check the MPI bridge against", file=sys.stderr)
  else:
    ok, detail = bridge_env.probe(library, jaxlib_so)
    verdicts[bridge_env.key(library, jaxlib_so)] = {"ok": ok, "detail": detail}
    print(f"mpijax: MPI bridge vs {jaxlib_so}: {detail}", file=sys.stderr)
    if not ok:
      print("mpijax: warning: XLA's collectives will use gloo with this jaxlib", file=sys.stderr)
  with open(out, "w") as f:
    json.dump(verdicts, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
