"""Slurm hostlist expressions: ``node[001-004,007],gpu-[1-2]a`` -> host names.

Grammar (as Slurm's ``scontrol show hostnames`` reads it): hosts separated by
commas outside brackets; in a host, each ``[...]`` holds comma-separated
numbers or ``lo-hi`` ranges. Numbers keep the zero padding of the range's low
end (``[08-10]`` -> ``08 09 10``). Several bracket groups in one host expand as
a cartesian product, the leftmost group varying slowest.
"""

from __future__ import annotations

import itertools

# No real node list is this long; a typo like [1-100000000] should not eat the
# memory of every rank.
_MAX_RANGE = 1 << 20


def _fail(text: str, why: str) -> ValueError:
  return ValueError(f"malformed Slurm hostlist {text!r}: {why}. Expected host names "
                    "like 'node[001-004,007],gpu-[1-2]a' (what SLURM_JOB_NODELIST holds)")


def _split_outside_brackets(text: str) -> list[str]:
  parts, depth, start = [], 0, 0
  for i, ch in enumerate(text):
    if ch == "[":
      if depth:
        raise _fail(text, f"nested '[' at position {i}")
      depth = 1
    elif ch == "]":
      if not depth:
        raise _fail(text, f"']' without '[' at position {i}")
      depth = 0
    elif ch == "," and not depth:
      parts.append(text[start:i])
      start = i + 1
  if depth:
    raise _fail(text, "'[' without ']'")
  parts.append(text[start:])
  return parts


def _expand_range_list(body: str, text: str) -> list[str]:
  """``001-004,007`` -> ``['001', '002', '003', '004', '007']``."""
  out = []
  for item in body.split(","):
    item = item.strip()
    lo, sep, hi = item.partition("-")
    if not lo.isdecimal() or (sep and not hi.isdecimal()):
      raise _fail(text, f"[{body}] holds {item!r}, which is not a number or a lo-hi range")
    if not sep:
      out.append(lo)
      continue
    if int(hi) < int(lo):
      raise _fail(text, f"range {item!r} in [{body}] runs backwards")
    if int(hi) - int(lo) >= _MAX_RANGE:
      raise _fail(text, f"range {item!r} in [{body}] has more than {_MAX_RANGE} hosts")
    width = len(lo)
    out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
  return out


def _expand_host(host: str, text: str) -> list[str]:
  # Alternate literal text and bracket bodies: "rack[1-2]-n[01-02]" ->
  # ["rack", "1-2", "-n", "01-02", ""].
  pieces: list[list[str]] = []
  rest = host
  while "[" in rest:
    prefix, _, rest = rest.partition("[")
    body, _, rest = rest.partition("]")
    pieces.append([prefix])
    pieces.append(_expand_range_list(body, text))
  pieces.append([rest])
  return ["".join(combo) for combo in itertools.product(*pieces)]


def expand_hostlist(text: str) -> tuple[str, ...]:
  """Expands a Slurm hostlist expression into host names, in Slurm's order.

  Args:
    text: e.g. the value of ``SLURM_JOB_NODELIST``.

  Returns:
    The host names; ``()`` for an empty string.

  Raises:
    ValueError: naming `text`, for unbalanced or nested brackets, empty host
      names or bracket items, non-numeric items and backwards ranges.

  Examples:
    >>> expand_hostlist("node[001-004,007],gpu-[1-2]a")
    ('node001', 'node002', 'node003', 'node004', 'node007', 'gpu-1a', 'gpu-2a')
    >>> expand_hostlist("rack[1-2]-n[1-2]")
    ('rack1-n1', 'rack1-n2', 'rack2-n1', 'rack2-n2')
  """
  if not text.strip():
    return ()
  hosts: list[str] = []
  for host in _split_outside_brackets(text):
    host = host.strip()
    if not host:
      raise _fail(text, "it has an empty host name (two commas in a row, or a leading "
                  "or trailing comma)")
    if any(c.isspace() for c in host):
      raise _fail(text, f"host {host!r} contains white space")
    hosts.extend(_expand_host(host, text))
  return tuple(hosts)
