"""The whole GPU check in one command: `bash benchmarks/gpu/run.sh OUTDIR` (or `python -m benchmarks.gpu OUTDIR`).

Parts, in order (each skipped, and said so, when the time guard has too little left):
  env      the card, torch/triton versions, whether the core runs compiled (run.sh builds it there)
  kernels  every Triton kernel against its torch reference over the sweep of issue 26 (sweep.py)
  figures  decode bandwidth against a device-to-device copy, split-KV, SDPA, prefill, FP8 (figures.py)
  service  a CUDA pool served over HTTP, CUDA IPC from another process, the host tier, the vLLM
           connector's GPU layout, with their figures (service_checks.py)
  probe    variants of the decode launches behind the first GPU run's missed targets, timed (probe.py)
  pytest   `pytest -m gpu`, then the CPU suite's tests that run there (pytest_part.py)

Everything lands in OUTDIR: results.json (every check and figure; rewritten after each part, so a run
cut short keeps what it did) and log.txt. `--dry-run` runs the same flow on the CPU (Triton's
interpreter, tiny shapes, no timings: a figure is null there) and is what CI runs.
"""
