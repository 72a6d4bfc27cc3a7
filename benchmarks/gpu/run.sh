#!/usr/bin/env bash
# The whole GPU check, one call (docs/KERNELS.md, "On a lent GPU", gives the device tool's call):
#   bash benchmarks/gpu/run.sh OUTDIR [--dry-run] [more python -m benchmarks.gpu options]
# Installs the wheels benchmarks/gpu/wheels.sh put in .whl/ (the GPU machine has no registry), unpacks the
# carried redis-server, builds the compiled core in place, then runs python -m benchmarks.gpu under a time
# guard: the Python side stops starting parts 390 s in (--budget-s), and `timeout` ends everything at 7 minutes.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:?usage: run.sh OUTDIR [--dry-run] ...}"
shift
mkdir -p "$out"
log="$out/log.txt"
began=$(date +%s)
# (Only where kvpool's dependencies are missing: here, or in CI, they are installed and .whl/ is not for this Python.)
if ls .whl/*.whl >/dev/null 2>&1 && ! python3 -c 'import fastapi, uvicorn, pydantic_settings' 2>/dev/null; then
    site=/tmp/kvpool-gpu-site
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
        >>"$log" 2>&1 || { echo "run.sh: the carried wheels did not install (see $log)"; exit 3; }
    export PYTHONPATH="$PWD:$site" KVPOOL_GPU_SITE="$site"
    # Subprocesses that set PYTHONPATH themselves (the tests' `kvpool serve`) find the wheels too: a .pth in the
    # interpreter's site-packages puts them first on sys.path, as PYTHONPATH would.
    purelib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "import sys; sys.path.insert(0, '$site')" >"$purelib/kvpool_gpu_site.pth" 2>>"$log" ||
        echo "run.sh: $purelib is read-only: servers started with their own PYTHONPATH will lack the wheels" | tee -a "$log"
else
    export PYTHONPATH="$PWD"
fi
if ls .whl/deb/*.deb >/dev/null 2>&1 && ! command -v redis-server >/dev/null; then
    root=/tmp/kvpool-gpu-redis
    for f in .whl/deb/*.deb; do dpkg -x "$f" "$root"; done
    export PATH="$root/usr/bin:$PATH" LD_LIBRARY_PATH="$root/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
fi
# The compiled core (Cython + OpenSSL's libcrypto); where it cannot build, the core runs from its .py files and
# results.json's env.core says "python source".
python3 -c 'import service.core as c; assert c.is_compiled()' 2>/dev/null ||
    python3 setup.py build_ext --inplace -q -j 8 >>"$log" 2>&1 || echo "run.sh: build_ext failed: the core runs from its Python source" | tee -a "$log"
echo "run.sh: set up in $(( $(date +%s) - began )) s" | tee -a "$log"
export PYTHONUNBUFFERED=1
# The budget counts from the start of this script: parts stop starting 390 s in, everything ends at 420 s.
spent=$(( $(date +%s) - began ))
timeout -k 10 $(( 420 - spent )) python3 -m benchmarks.gpu "$out" --budget-s $(( 390 - spent )) "$@"
