"""``python -m mpijax.compat.shim``: prints the shim's directory (for ``PYTHONPATH``)."""

from mpijax.compat.shim import DIR

print(DIR)
