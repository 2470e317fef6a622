"""``mpijax.visualize_sharding``: which process and device holds each block."""

from __future__ import annotations

from mpijax._src.runtime import state as runtime
from mpijax._src.sharding.geometry import device_indices
from mpijax._src.sharding.global_array import GlobalArray


def _labels(array: GlobalArray) -> tuple[list[tuple[int, int]], list[tuple[int, int]], dict]:
  """Row and column block bounds and, per block, its holders' labels."""
  mesh = array.mesh
  idx = device_indices(array.shape, mesh, array.spec)
  L = mesh.local_device_count
  holders: dict[tuple[int, int], list[str]] = {}
  rows, cols = set(), set()
  for g, index in enumerate(idx):
    r = (index[0].start, index[0].stop) if array.ndim == 2 else (0, 1)
    c = (index[-1].start, index[-1].stop)
    rows.add(r)
    cols.add(c)
    holders.setdefault((r, c), []).append(f"P{g // L}:D{g % L}")
  return sorted(rows), sorted(cols), holders


def visualize_sharding(
  array: GlobalArray, *, use_rich: bool | None = None, print_it: bool = True
) -> str:
  """A text picture of which process (P) and local device (D) holds each block.

  Like ``jax.debug.visualize_array_sharding``, for 1-D and 2-D arrays. Rank 0
  prints it (with ``rich`` when importable); every rank gets the string. No
  communication: every rank draws it from the mesh and spec.

  Args:
    array: a 1-D or 2-D :class:`~mpijax.GlobalArray`.
    use_rich: ``False`` draws with plain box-drawing characters; otherwise
      (the default) with ``rich``'s table when it is importable.
    print_it: print the picture on rank 0.

  Returns:
    The picture: one cell per block, labelled ``P<process>:D<local device>``
    for each device holding it.

  Raises:
    TypeError: ``array`` is not a GlobalArray.
    ValueError: ``array`` is not 1-D or 2-D.

  Examples:
    >>> mpijax.visualize_sharding(ga)  # doctest: +SKIP
    ┌───────┬───────┐
    │ P0:D0 │ P0:D1 │
    ├───────┼───────┤
    │ P1:D0 │ P1:D1 │
    └───────┴───────┘
  """
  if not isinstance(array, GlobalArray):
    raise TypeError(f"visualize_sharding needs a GlobalArray, got {type(array).__name__}")
  if array.ndim not in (1, 2):
    raise ValueError(
      f"visualize_sharding draws 1-D and 2-D arrays; this one has shape "
      f"{array.shape}. Visualize a 2-D reshape or slice of it instead."
    )
  rows, cols, holders = _labels(array)
  cells = [[", ".join(holders[(r, c)]) for c in cols] for r in rows]
  text = _draw(cells)
  if use_rich is not False:
    text = _draw_rich(cells) or text  # plain text when rich is not importable
  rt = runtime.get("mpijax.visualize_sharding")
  if print_it and rt.rank == 0:
    print(text, flush=True)
  return text


def _draw(cells: list[list[str]]) -> str:
  width = max(len(s) for row in cells for s in row) + 2
  ncol = len(cells[0])

  def rule(left, mid, right):
    return left + mid.join("─" * width for _ in range(ncol)) + right

  lines = [rule("┌", "┬", "┐")]
  for i, row in enumerate(cells):
    lines.append("│" + "│".join(s.center(width) for s in row) + "│")
    lines.append(rule("├", "┼", "┤") if i + 1 < len(cells) else rule("└", "┴", "┘"))
  return "\n".join(lines)


def _draw_rich(cells: list[list[str]]) -> str | None:
  try:
    import io

    from rich import box
    from rich.console import Console
    from rich.table import Table
  except ImportError:
    return None
  table = Table(show_header=False, show_lines=True, box=box.SQUARE, padding=(0, 1))
  for _ in cells[0]:
    table.add_column(justify="center")
  for row in cells:
    table.add_row(*row)
  console = Console(file=io.StringIO(), width=200, color_system=None)
  console.print(table)
  return console.file.getvalue().rstrip("\n")
