"""The collective timeline: record (record.py), merge (merge.py), render (render.py)."""
