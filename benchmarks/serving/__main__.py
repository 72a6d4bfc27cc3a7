"""`python -m benchmarks.serving` (the same as `kvpool bench serving`): see run.py."""

from benchmarks.serving.run import main

raise SystemExit(main())
