#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with what run.sh installs on the GPU machine, which reaches no registry: cp312
# manylinux wheels of kvpool's dependencies that its image lacks (the ranges read from pyproject.toml, with
# their dependencies), and Debian's redis-server for the shared tier under .whl/deb/. Run here, then name
# .whl in the device call's carry. Prints the size: everything that travels must stay under 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .whl && mkdir -p .whl/deb
# The image has torch, triton, numpy, httpx, prometheus-client, uvloop and xxhash (KINDS.md's package list).
mapfile -t specs < <(python3 - <<'PY'
import re, tomllib
have = {"numpy", "torch", "triton", "httpx", "prometheus-client", "uvloop", "xxhash"}
for dep in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    name = re.split(r"[<>=!~; ]", dep, maxsplit=1)[0]
    if name not in have:
        print(dep.split(";")[0].strip())
PY
)
platforms=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_26_x86_64 manylinux_2_28_x86_64 \
    manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux1_x86_64 manylinux_2_5_x86_64; do
    platforms+=(--platform "$p")
done
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d .whl "${specs[@]}"
# redis-server 7 from Debian bookworm (redis-server links to the binary in redis-tools) and the two libraries it needs beyond
# libc/libssl; run.sh unpacks them with dpkg -x.
lists=/tmp/kvpool-apt-amd64
mkdir -p "$lists/partial"
apt_opts=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 "-oDir::State::Lists=$lists")
apt-get "${apt_opts[@]}" update -q >/dev/null
(cd .whl/deb && apt-get "${apt_opts[@]}" download redis-server redis-tools liblzf1 libjemalloc2 2>&1 | grep -v '^W: ' || true)
ls .whl .whl/deb
du -sh .whl
