"""The extension's stub (_mpijax_ffi.pyi) matches the built module.

Compares every function's parameters (names, kinds, defaults) as nanobind
reports them (``__nb_signature__``) with the stub's, both ways. The module is
imported in a child process with MPI loaded but not initialized: importing
it makes no MPI call.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

STUB = Path(__file__).resolve().parents[2] / "mpijax" / "_src" / "ffi" / "_mpijax_ffi.pyi"

_DUMP = r"""
import json
import mpi4py
mpi4py.rc.initialize = False  # load libmpi for the extension; no MPI_Init
from mpi4py import MPI
from mpijax._src.ffi import _mpijax_ffi as ext
out = {}
for name in dir(ext):
  fn = getattr(ext, name)
  if name.startswith("_") or not callable(fn):
    continue
  sigs = getattr(fn, "__nb_signature__", None)
  out[name] = None if sigs is None else [[s[0], list(s[2] or ())] for s in sigs]
print(json.dumps({"initialized": MPI.Is_initialized(), "functions": out}))
"""


def _split_top_level(text: str) -> list[str]:
  """Splits a parameter list at the commas outside brackets and quotes."""
  parts, depth, quote, start = [], 0, "", 0
  for i, ch in enumerate(text):
    if quote:
      quote = "" if ch == quote else quote
    elif ch in "'\"":
      quote = ch
    elif ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif ch == "," and depth == 0:
      parts.append(text[start:i].strip())
      start = i + 1
  parts.append(text[start:].strip())
  return [p for p in parts if p]


def _module_params(signature: str, defaults: list) -> list[tuple]:
  """(name, kind, default) per parameter of a nanobind signature
  'def f(a: int, *, b: str = \\0) -> None'; kind is 'positional' or 'keyword';
  default is the value, or the string '<required>'."""
  inner = signature[signature.index("(") + 1:signature.rindex(")")]
  params, kind = [], "positional"
  for part in _split_top_level(inner):
    if part == "*":
      kind = "keyword"
      continue
    assert part != "/" and not part.startswith("*"), f"unexpected parameter {part!r}"
    name = re.match(r"\w+", part).group()
    slot = re.search(r"=\s*\\(\d+)$", part)  # nanobind prints defaults as \0, \1, ...
    params.append((name, kind, "<required>" if slot is None else defaults[int(slot.group(1))]))
  return params


def _stub_params(fn: ast.FunctionDef) -> list[tuple]:
  a = fn.args
  assert not a.posonlyargs and not a.vararg and not a.kwarg, fn.name
  positional = [(p.arg, "positional") for p in a.args]
  pos_defaults = ["<required>"] * (len(a.args) - len(a.defaults)) + [
      ast.literal_eval(d) for d in a.defaults]
  keyword = [(p.arg, "keyword") for p in a.kwonlyargs]
  kw_defaults = ["<required>" if d is None else ast.literal_eval(d) for d in a.kw_defaults]
  return ([(n, k, d) for (n, k), d in zip(positional, pos_defaults)] +
          [(n, k, d) for (n, k), d in zip(keyword, kw_defaults)])


def _module_functions() -> dict:
  proc = subprocess.run([sys.executable, "-c", _DUMP], capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  dump = json.loads(proc.stdout.strip().splitlines()[-1])
  assert dump["initialized"] is False  # signatures need no MPI job
  return dump["functions"]


def test_stub_and_module_have_the_same_functions_and_parameters():
  module = _module_functions()
  stub = {node.name: node for node in ast.parse(STUB.read_text()).body
          if isinstance(node, ast.FunctionDef)}
  assert sorted(module) == sorted(stub), (
      f"only in the module: {sorted(set(module) - set(stub))}; "
      f"only in {STUB.name}: {sorted(set(stub) - set(module))}")
  for name, sigs in module.items():
    assert sigs is not None, f"{name} is not a nanobind function"
    assert len(sigs) == 1, f"{name} is overloaded; the stub needs @overload"
    signature, defaults = sigs[0]
    assert _module_params(signature, defaults) == _stub_params(stub[name]), (
        f"{name}: the module has {signature!r}; fix {STUB.name}")


def test_parameter_parser_reads_kinds_and_defaults():
  # The comparison above is only as good as this parser: check it on a
  # signature with every feature nanobind prints for this module.
  sig = ("def f(a: collections.abc.Sequence[int], b: ndarray[order='C', device='cpu'], "
         "*, c: str = \\0, d: int = \\1) -> list[int]")
  assert _module_params(sig, ["x,y", 3]) == [
      ("a", "positional", "<required>"), ("b", "positional", "<required>"),
      ("c", "keyword", "x,y"), ("d", "keyword", 3)]
  fn = ast.parse("def f(a, b=2, *, c, d='x'): ...").body[0]
  assert _stub_params(fn) == [("a", "positional", "<required>"), ("b", "positional", 2),
                              ("c", "keyword", "<required>"), ("d", "keyword", "x")]
