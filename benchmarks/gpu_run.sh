#!/bin/bash
# The one device call that measures every GPU figure (benchmarks/gpu.py: ~9 minutes at most, figures saved
# to $OUT/gpu.json as they come; a markdown summary for benchmarks/RESULTS.md at the end of the output and
# in $OUT/gpu-summary.md; the whole log in $OUT/gpu-log.txt).
#
# 1. Here, before the call (the GPU machine gets only the checkout plus the carried folders):
#        bash benchmarks/gpu_run.sh --prepare
#    copies ../shared/anchors (the original PowerInfer's CUDA build, 22 MB) to .anchors/ (ignored by
#    .gitignore) and the gguf package, which the GPU machine's image lacks, to .anchors/site/. gpu.py runs
#    the original's .anchors/powerinfer-cuda/bin/main itself (benchmarks/gpu_pi.py: -c equal to hotcold's
#    context, and a second hybrid run at equal hot bytes), not .anchors/powerinfer-gpu.sh (it passes no -c).
# 2. The call, through the device tool's `run`:
#        command: bash benchmarks/gpu_run.sh      carry: [".anchors"]      timeout_s: 600
#    Extra arguments go to gpu.py (e.g. --deadline-s 500 --layers 8 --n-gen 64). gpu.py stops starting
#    parts at 540 s and hard-stops at 565 s, so timeout_s 600 leaves room for the start.
# 3. After it: copy gpu.json from the call's files to benchmarks/results/gpu.json and paste the summary
#    (gpu-summary.md) into benchmarks/RESULTS.md.
# On the device, hotcold runs from src/ (PYTHONPATH; no pip install: pip there reaches no index, and an
# isolated build would need to download setuptools); its C kernels compile on first use with the
# machine's cc. Check it here first: python benchmarks/gpu.py --cpu-dry-run --out /tmp/gpu.json
set -u
cd "$(dirname "$0")/.." || exit 1
if [ "${1:-}" = "--prepare" ]; then
  src=${ANCHORS:-../shared/anchors}
  [ -d "$src" ] || src=/work/shared/anchors
  rm -rf .anchors && cp -r "$src" .anchors || exit 1
  gguf_dir=$(python3 -c 'import gguf, os; print(os.path.dirname(gguf.__file__))') || exit 1
  mkdir -p .anchors/site && cp -r "$gguf_dir" .anchors/site/ || exit 1
  find .anchors/site -name __pycache__ -prune -exec rm -rf {} +
  git check-ignore -q .anchors || echo "warning: .anchors is not ignored: add .anchors/ to .gitignore"
  du -sh .anchors
  exit 0
fi
OUT=${OUT:-/tmp/hotcold-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD/.anchors/site${PYTHONPATH:+:$PYTHONPATH}
PY=$(command -v python3 || command -v python)
set -o pipefail
"$PY" benchmarks/gpu.py --out "$OUT/gpu.json" "$@" 2>&1 | tee "$OUT/gpu-log.txt"
