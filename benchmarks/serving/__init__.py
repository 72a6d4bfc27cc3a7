"""kvpool in a fleet: `python -m benchmarks.serving` (see __main__.py)."""
