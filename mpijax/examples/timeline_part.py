"""The timeline of part of a run: docs/timeline.md's start/finish, complete.

    mpijax-run -n 4 -- python -m mpijax.examples.timeline_part
    python -m mpijax.timeline render trace.json -o part.png

Ten all-reduces run before the timeline starts, five while it records:
``trace.json`` holds only those five calls per rank and device.
"""

import json

import jax
import jax.numpy as jnp

import mpijax
import mpijax.timeline

mpijax.init()
step = jax.jit(lambda x: mpijax.ops.allreduce(x * 2, "sum"))
x = jnp.ones(4)
for _ in range(10):
  x = step(x) / mpijax.process_count()

mpijax.timeline.start("trace.json")   # collective: every rank
for _ in range(5):                    # the steps to look at
  x = step(x) / mpijax.process_count()
mpijax.timeline.finish()              # collective: rank 0 writes the file

if mpijax.process_index() == 0:
  with open("trace.json") as f:
    calls = [e for e in json.load(f)["traceEvents"] if e.get("name") == "allreduce"]
  print(f"trace.json: {len(calls)} allreduce calls of {mpijax.process_count()} ranks")
