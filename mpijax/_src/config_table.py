"""``python -m mpijax._src.config_table``: prints the table of docs/configuration.md.

Its own module: ``import mpijax`` imports ``config`` itself, so running
``config`` as ``__main__`` would make runpy warn that the module was already
imported.
"""

from __future__ import annotations

from mpijax._src import config

if __name__ == "__main__":
  print(config.markdown_table())
