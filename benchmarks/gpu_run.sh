#!/usr/bin/env bash
# Runs on the GPU machine, from the repo's root, with the bundle benchmarks/gpu_bundle.sh made beside it
# (copied there as .gpu/run.sh): the platform end to end on CUDA (benchmarks/online.py: Kafka from the
# bundle's JRE and jars, the edge, one worker per model, against the raw model and the naive peer), then
# benchmarks/gpu.py. Results and logs go to $OUT (default /tmp/gpuout).
#   ONLINE_ARGS (default --peers naive), ONLINE_S (timeout, 420), GPU_ARGS (--repeats 1), GPU_S (150);
#   SIM=1: a dry run on a machine that has the project's venv (no wheels installed, no nvidia-smi needed).
set -u
export PYTHONUNBUFFERED=1
B=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/gpuout}; mkdir -p "$OUT"
T=${T:-/tmp/sg}; rm -rf "$T"; mkdir -p "$T"
if [ -z "${SIM:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$T/site" \
    "$B"/wheels/*.whl || exit 3
  export PYTHONPATH=$T/site:$PWD:$B/site
else
  export PYTHONPATH=$PWD:$B/site
fi
tar -C "$T" -xJf "$B/jre.tar.xz" && export PATH=$T/jre/bin:$PATH
K=$T/cache/kafka/$(cat "$B/kafka.home"); mkdir -p "$K" && tar -C "$K" -xJf "$B/kafka.tar.xz"
cp -a "$B/cache/models" "$T/cache/"
export SLUICE_CACHE_DIR=$T/cache SLUICE_DATA_DIR=$T/data
{ command -v java python3; java -version; python3 -V; nproc; nvidia-smi -L; uptime; } 2>&1 | tee "$OUT/env.log"
S=$(date +%s)
# shellcheck disable=SC2086  # the arguments are meant to split
timeout "${ONLINE_S:-420}" python3 benchmarks/online.py ${ONLINE_ARGS:---peers naive} --out "$OUT/online.json" 2>&1 \
  | tee "$OUT/online.log"
echo "online.py rc=${PIPESTATUS[0]} in $(( $(date +%s) - S )) s" | tee -a "$OUT/online.log"
S=$(date +%s)
# shellcheck disable=SC2086
timeout "${GPU_S:-150}" python3 benchmarks/gpu.py ${GPU_ARGS:---repeats 1} --out "$OUT/gpu.json" 2>&1 | tee "$OUT/gpu.log"
echo "gpu.py rc=${PIPESTATUS[0]} in $(( $(date +%s) - S )) s" | tee -a "$OUT/gpu.log"
