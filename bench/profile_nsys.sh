#!/usr/bin/env bash
# Profile a short SPD generation with Nsight Systems: CUDA API + kernels + NVTX ranges, CUDA graphs
# traced node by node. Writes OUT_DIR/spd.nsys-rep and a text summary OUT_DIR/spd_nsys_stats.txt.
#
#   bench/profile_nsys.sh [OUT_DIR] [bench/nsys_run.py options, e.g. --random-weights --num-stages 5]
#   (Python: $PYTHON, else the repository's .venv if setup.sh made one, else python3)
#
# Open the report with `nsys-ui OUT_DIR/spd.nsys-rep`. NVTX ranges (spd.pre, spd.draft, spd.stage<s>,
# spd.verify, spd.cycle_graph, spd.readback, ar.step, ar.prefill, ar.readback) are on because SPD_FAST_NVTX=1 is set below.
set -euo pipefail
case ${1:-} in   # OUT_DIR is optional: options alone (e.g. --random-weights) go to nsys_run.py
    ""|-*) OUT_DIR=bench/results/nsys ;;
    *) OUT_DIR=$1; shift ;;
esac
if ! command -v nsys >/dev/null 2>&1; then
    echo "profile_nsys.sh: nsys (Nsight Systems) is not on PATH; install it from" \
         "https://developer.nvidia.com/nsight-systems or add its bin/ folder to PATH" >&2
    exit 2
fi
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)   # absolute: relative to where it was called from, not the repository root
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=${PYTHON:-python3}; fi  # setup.sh's
SPD_FAST_NVTX=1 nsys profile --trace=cuda,nvtx --cuda-graph-trace=node --force-overwrite=true \
    -o "$OUT_DIR/spd" "$PY" bench/nsys_run.py "$@"
nsys stats --force-export=true --report nvtx_sum,cuda_gpu_kern_sum "$OUT_DIR/spd.nsys-rep" \
    > "$OUT_DIR/spd_nsys_stats.txt"
echo "report: $OUT_DIR/spd.nsys-rep; summary: $OUT_DIR/spd_nsys_stats.txt"
