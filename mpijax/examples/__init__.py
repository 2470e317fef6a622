"""Runnable examples: ``mpijax-run -n 4 -- python -m mpijax.examples.digits``."""
