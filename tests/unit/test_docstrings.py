"""The public API's docstrings: Args and Returns on >= 90 % of it, and no Args that drift.

What counts is written down in CONTRIBUTING.md ("Docstrings"); this file is
that definition as code. ``python tests/unit/test_docstrings.py`` prints the
coverage and every callable that misses it.

The public modules are read as source (their ``from ... import ... as ...``
lines and ``__all__``), and each name taken from the module it comes from:
importing ``mpijax.compat.mpi4jax`` itself would start the runtime.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pathlib
import re
import sys
import textwrap
from typing import Any

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

PUBLIC_MODULES = (
  "mpijax",
  "mpijax.lax",
  "mpijax.ops",
  "mpijax.train",
  "mpijax.timeline",
  "mpijax.compat.mpi4jax",
  "mpijax.launch",
)

MIN_COVERAGE = 0.90

# Google-style section headers (a line of its own, ending in a colon).
SECTIONS = (
  "Args", "Arguments", "Attributes", "Example", "Examples", "Keyword Args", "Note", "Notes",
  "Raises", "References", "Returns", "See Also", "Todo", "Warning", "Warnings", "Yields",
)
_HEADER = re.compile(r"^( *)(" + "|".join(SECTIONS) + r"):\s*$")
# "name: text" or "name (type): text"; ``*args`` and ``**kwargs`` keep their stars.
_ENTRY = re.compile(r"^(\*{0,2}[A-Za-z_]\w*)(?:\s*\((?:[^()]|\([^()]*\))*\))?:(?:\s|$)")


# --- finding the public callables ------------------------------------------------------


def _module_path(name: str) -> pathlib.Path:
  base = REPO / pathlib.Path(*name.split("."))
  return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def public_names(module: str) -> dict[str, Any]:
  """``__all__`` of ``module`` -> the object each name stands for."""
  tree = ast.parse(_module_path(module).read_text())
  sources: dict[str, tuple[str, str]] = {}
  exported: list[str] | None = None
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      for alias in node.names:
        sources[alias.asname or alias.name] = (node.module, alias.name)
    elif isinstance(node, ast.Assign) and any(
      isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
    ):
      exported = list(ast.literal_eval(node.value))
  assert exported is not None, f"{module} has no __all__"
  out = {}
  for name in exported:
    assert name in sources, f"{module}.__all__ names {name!r}, which it does not import"
    source_module, attr = sources[name]
    mod = importlib.import_module(source_module)
    out[name] = getattr(mod, attr) if hasattr(mod, attr) else importlib.import_module(
      f"{source_module}.{attr}"
    )
  return out


@dataclasses.dataclass
class PublicCallable:
  """One public callable: a function, a public method or a constructor."""

  qualname: str  # as the user reaches it, e.g. mpijax.lax.psum
  function: Any  # the plain function (classmethods and staticmethods unwrapped)
  params: list[inspect.Parameter]  # without self / cls
  owner: type | None = None  # the class, for methods and constructors
  constructor: bool = False


def _fields_class(cls: type) -> bool:
  """A dataclass or NamedTuple: its generated constructor takes its fields."""
  return dataclasses.is_dataclass(cls) or (issubclass(cls, tuple) and hasattr(cls, "_fields"))


def _callable(qualname: str, raw: Any, owner: type | None, constructor: bool) -> PublicCallable:
  function = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
  params = list(inspect.signature(function).parameters.values())
  method = owner is not None and not isinstance(raw, staticmethod)
  if (method or function.__name__ == "__new__") and params:
    params = params[1:]  # self, cls
  return PublicCallable(qualname, function, params, owner, constructor)


def public_callables() -> list[PublicCallable]:
  """Every public callable once (a name exported twice counts once)."""
  seen: dict[str, PublicCallable] = {}
  for module in PUBLIC_MODULES:
    for name, obj in public_names(module).items():
      found: list[PublicCallable] = []
      if inspect.isclass(obj):
        body = vars(obj)
        if "__init__" in body and inspect.isfunction(body["__init__"]):
          found.append(_callable(f"{module}.{name}", body["__init__"], obj, True))
        elif "__new__" in body and _fields_class(obj):
          found.append(_callable(f"{module}.{name}", body["__new__"], obj, True))
        for attr, value in body.items():
          if attr.startswith("_"):
            continue
          if inspect.isfunction(value) or isinstance(value, (classmethod, staticmethod)):
            found.append(_callable(f"{module}.{name}.{attr}", value, obj, False))
      elif inspect.isfunction(obj) or inspect.isfunction(inspect.unwrap(obj)):
        found.append(_callable(f"{module}.{name}", obj, None, False))
      elif callable(obj):  # not left out silently: say how such an object counts
        raise AssertionError(f"{module}.{name} is a {type(obj).__name__}, neither a function "
                             "nor a class: extend public_callables() to count it")
      for c in found:
        key = f"{c.function.__module__}.{c.function.__qualname__}"
        if c.constructor:
          key = f"{c.owner.__module__}.{c.owner.__qualname__}()"
        seen.setdefault(key, c)
  return list(seen.values())


# --- reading docstrings ----------------------------------------------------------------


def sections(doc: str) -> dict[str, list[str]]:
  """Section name -> its body lines (indented under the header); the first of each name."""
  lines = inspect.cleandoc(doc).expandtabs().splitlines() if doc else []
  out: dict[str, list[str]] = {}
  i = 0
  while i < len(lines):
    m = _HEADER.match(lines[i])
    if not m:
      i += 1
      continue
    indent, body = len(m.group(1)), []
    i += 1
    while i < len(lines) and (
      not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent
    ):
      body.append(lines[i])
      i += 1
    out.setdefault(m.group(2), body)
  return out


def entry_names(body: list[str]) -> tuple[list[str], list[str]]:
  """(names, malformed lines) of an Args or Attributes section's entries."""
  text = [line for line in body if line.strip()]
  if not text:
    return [], ["(an empty section)"]
  indent = min(len(line) - len(line.lstrip()) for line in text)
  names, bad = [], []
  for line in text:
    if len(line) - len(line.lstrip()) != indent:
      continue  # a continuation line
    m = _ENTRY.match(line.strip())
    if m:
      names.append(m.group(1))
    else:
      bad.append(line.strip())
  return names, bad


def _star(p: inspect.Parameter) -> str:
  prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
  return prefix + p.name


def args_problems(where: str, body: list[str], params: list[str]) -> list[str]:
  """What is wrong with an Args (or Attributes) section documenting ``params``.

  ``params`` are the parameters' names, ``*args`` and ``**kwargs`` with
  their stars. Every parameter is named once, with or without its stars;
  names starting with ``_`` (private) may be left out; nothing else may be
  named.
  """
  names, bad = entry_names(body)
  problems = [f"{where}: malformed entry {line!r} (one 'name: text' per parameter)"
              for line in bad]
  plain = [n.lstrip("*") for n in names]
  dup = sorted({n for n in plain if plain.count(n) > 1})
  want = [p.lstrip("*") for p in params]
  missing = [p for p, w in zip(params, want) if w not in plain and not w.startswith("_")]
  extra = [n for n, s in zip(names, plain) if s not in want]
  if dup:
    problems.append(f"{where}: names {dup} more than once")
  if missing:
    problems.append(f"{where}: does not name {missing}")
  if extra:
    problems.append(f"{where}: names {extra}, which {'is' if len(extra) == 1 else 'are'} "
                    f"not a parameter (parameters: {params})")
  return problems


def _own_doc(obj: Any) -> str:
  """The object's own docstring (``inspect.getdoc`` would inherit one from a base class)."""
  doc = getattr(obj, "__doc__", None)
  return doc if isinstance(doc, str) else ""


def returns_value(function: Any) -> bool:
  """Whether ``function`` returns something: by its annotation, else by its source."""
  annotation = inspect.signature(function).return_annotation
  if annotation is not inspect.Signature.empty:
    return annotation not in (None, type(None), "None", "NoReturn", "typing.NoReturn")
  source = textwrap.dedent(inspect.getsource(inspect.unwrap(function)))
  node = ast.parse(source).body[0]
  todo = list(ast.iter_child_nodes(node))
  while todo:
    n = todo.pop()
    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
      continue  # a nested function's return is not this one's
    if isinstance(n, (ast.Yield, ast.YieldFrom)):
      return True
    if isinstance(n, ast.Return) and n.value is not None and not (
      isinstance(n.value, ast.Constant) and n.value.value is None
    ):
      return True
    todo.extend(ast.iter_child_nodes(n))
  return False


def check(c: PublicCallable) -> tuple[bool, bool, list[str]]:
  """(Args documented, Returns documented, drift problems) of one public callable."""
  problems: list[str] = []
  own = sections(_own_doc(c.function))
  args_ok = "Args" in own
  if args_ok:
    problems += args_problems(f"{c.qualname} Args", own["Args"], [_star(p) for p in c.params])
  if c.constructor and not args_ok:
    # Google style: a constructor's arguments may be documented on the class,
    # and a dataclass's or NamedTuple's fields are its constructor's.
    cls = sections(_own_doc(c.owner))
    key = "Args" if "Args" in cls else "Attributes" if _fields_class(c.owner) else None
    if key in cls:
      args_ok = True
      problems += args_problems(
        f"{c.qualname} (class docstring) {key}", cls[key], [_star(p) for p in c.params]
      )
  if c.constructor:
    returns_ok = True
  else:
    returns_ok = "Returns" in own or "Yields" in own or not returns_value(c.function)
  return args_ok and not problems, returns_ok, problems


def report() -> tuple[list[PublicCallable], list[tuple[PublicCallable, str]], list[str]]:
  """(callables that count, the undocumented ones with what they miss, drift problems).

  A callable counts when it takes two or more parameters (``self``/``cls``
  not counted). Drift is checked on every public callable with an Args
  section, whatever its parameter count.
  """
  counted, missing, drift = [], [], []
  for c in public_callables():
    args_ok, returns_ok, problems = check(c)
    drift += problems
    if len(c.params) < 2:
      continue
    counted.append(c)
    if not (args_ok and returns_ok):
      what = " and ".join(w for w, ok in (("Args", args_ok), ("Returns", returns_ok)) if not ok)
      missing.append((c, what))
  return counted, missing, drift


def _ast_params(node: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> list[str]:
  a = node.args
  names = [p.arg for p in a.posonlyargs + a.args]
  if method and names and not any(
    isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list
  ):
    names = names[1:]  # self, cls
  names += [p.arg for p in a.kwonlyargs]
  if a.vararg:
    names.append("*" + a.vararg.arg)
  if a.kwarg:
    names.append("**" + a.kwarg.arg)
  return names


def package_drift() -> tuple[int, list[str]]:
  """(Args sections seen, drift problems) over every function and class in ``mpijax/``.

  Read from the source, private code included: a class's Args section
  documents its ``__init__``.
  """
  seen, problems = 0, []

  def visit(node: ast.AST, path: str, method: bool) -> None:
    nonlocal seen
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
        doc = sections(ast.get_docstring(child, clean=False) or "")
        if "Args" in doc:
          seen += 1
          where = f"{path}:{child.lineno} {child.name} Args"
          problems.extend(args_problems(where, doc["Args"], _ast_params(child, method)))
        visit(child, path, False)
      elif isinstance(child, ast.ClassDef):
        doc = sections(ast.get_docstring(child, clean=False) or "")
        init = next((f for f in child.body if isinstance(f, ast.FunctionDef)
                     and f.name == "__init__"), None)
        if "Args" in doc and init is not None:
          seen += 1
          where = f"{path}:{child.lineno} {child.name} (class docstring) Args"
          problems.extend(args_problems(where, doc["Args"], _ast_params(init, True)))
        visit(child, path, True)
      else:
        visit(child, path, method)

  for file in sorted((REPO / "mpijax").rglob("*.py")):
    visit(ast.parse(file.read_text()), str(file.relative_to(REPO)), False)
  return seen, problems


# --- the tests -------------------------------------------------------------------------


def test_the_public_modules_export_what_they_import():
  for module in PUBLIC_MODULES:
    assert public_names(module), module
  names = {c.qualname for c in public_callables()}
  for expected in ("mpijax.lax.psum", "mpijax.train.DataParallel", "mpijax.train.DataParallel.step",
                   "mpijax.GlobalArray.from_global", "mpijax.compat.mpi4jax.sendrecv",
                   "mpijax.launch.main", "mpijax.Topology"):
    assert expected in names, expected


def test_args_and_returns_cover_the_public_api():
  counted, missing, _ = report()
  documented = len(counted) - len(missing)
  share = documented / len(counted)
  lines = "\n".join(f"  {c.qualname}: no {what}" for c, what in missing)
  assert share >= MIN_COVERAGE, (
    f"{documented} of {len(counted)} public callables with two or more parameters document "
    f"Args and Returns ({share:.0%}; at least {MIN_COVERAGE:.0%} must):\n{lines}\n"
    "Write them as CONTRIBUTING.md's 'Docstrings' says."
  )


def test_every_args_section_names_exactly_the_parameters():
  _, _, drift = report()
  assert not drift, "docstrings that do not match their signatures:\n  " + "\n  ".join(drift)


def test_no_args_section_in_the_package_drifts():
  seen, drift = package_drift()
  assert seen > 50, f"found only {seen} Args sections in mpijax/: is the parser broken?"
  assert not drift, "docstrings that do not match their signatures:\n  " + "\n  ".join(drift)


# The checker itself, on functions made to be wrong.


def _good(x, axis_name, *, comm=None):
  """Sums.

  Args:
    x: the array.
    axis_name (str): the axis.
    comm: the communicator; a
      continuation line.

  Returns:
    The sum.
  """
  return x


def _stale(x, axis_name):
  """Stale.

  Args:
    x: the array.
    axes: the old name of axis_name.
  """
  return x


def _malformed(x, y, *args, **kwargs):
  """Malformed.

  Args:
    x, y: both at once.
    *args: more.
    **kwargs: options.
  """


def _no_returns(x, y):
  """No Returns section.

  Args:
    x: one.
    y: two.
  """
  return x + y


@pytest.mark.parametrize(
  "fn, args_ok, returns_ok, words",
  [
    (_good, True, True, []),
    (_stale, False, False, ["does not name ['axis_name']", "names ['axes']"]),
    (_malformed, False, True, ["malformed entry 'x, y: both at once.'"]),
    (_no_returns, True, False, []),
  ],
)
def test_the_checker_finds_what_is_wrong(fn, args_ok, returns_ok, words):
  got_args, got_returns, problems = check(_callable(fn.__name__, fn, None, False))
  assert (got_args, got_returns) == (args_ok, returns_ok), problems
  for w in words:
    assert any(w in p for p in problems), (w, problems)
  if args_ok:
    assert not problems


def test_a_dataclass_constructor_is_documented_by_its_attributes():
  @dataclasses.dataclass
  class Point:
    """A point.

    Attributes:
      x: across.
      y: up.
    """

    x: int
    y: int
    _cache: Any = None

  @dataclasses.dataclass
  class Drifted:
    """A point whose docs lag.

    Attributes:
      x: across.
      z: gone.
    """

    x: int
    y: int

  point = _callable("Point", vars(Point)["__init__"], Point, True)
  assert check(point) == (True, True, [])
  drifted = _callable("Drifted", vars(Drifted)["__init__"], Drifted, True)
  ok, _, problems = check(drifted)
  assert not ok and any("does not name ['y']" in p for p in problems), problems


if __name__ == "__main__":
  sys.path.insert(0, str(REPO))
  counted_, missing_, drift_ = report()
  done = len(counted_) - len(missing_)
  print(f"{done} of {len(counted_)} documented ({100 * done / len(counted_):.0f} %)")
  for c_, what_ in missing_:
    print(f"  missing {what_}: {c_.qualname}")
  for p_ in drift_:
    print(f"  drift: {p_}")
