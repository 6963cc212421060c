#!/usr/bin/env bash
# The prepared GPU check: `edgeflow doctor --role a100` on a lent CUDA machine (no network, the repository checkout plus
# carried files), after the wheels carried for what the machine lacks are installed; then, optionally, llama.cpp built
# with CUDA from a carried source tree and benchmarked on a carried GGUF.
#
#   bash scripts/gpu_check.sh --dry-run                  # print the plan and what is found, run nothing
#   OUT=/tmp/out bash scripts/gpu_check.sh --wheels .edgeflow/gpu-carry/wheels
#
# Steps (each under `timeout`; one failing never stops the next):
#   doctor          edgeflow doctor --role ROLE --profile PROFILE --out $OUT/doctor: versions, the GPU and its dtypes,
#                   20 distillation steps, GPTQ W4A16 on CUDA against the CPU, the gate's torch half on CUDA against
#                   the CPU, the profile's engine built, scored and decoded, on a tiny model made there (edgeflow/ops/
#                   doctor: nothing to carry for it)                                                       (540 s)
#   llama-cpp-cuda  optional: llama.cpp built with -DGGML_CUDA=ON from --llama-cpp-src, llama-bench on --gguf with every
#                   layer on the GPU                                                                      (150 s)
# The budgets add up to 11.5 min. Results: $OUT/doctor/doctor.json and doctor.md, $OUT/llama-cpp-cuda.json; the exit
# status is 1 when a step failed.
#
# What the machine must have: Python 3.11 with torch (CUDA build) and edgeflow's dependencies, importable. Missing ones
# are carried as wheels in --wheels DIR (installed with --no-index --no-deps into $OUT/pydeps, put on PYTHONPATH); a
# doctor check whose runtime is still missing fails naming the package and its install command.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
OUT="${OUT:-./gpu-check-out}"
PYTHON="${PYTHON:-python3}"
DRY_RUN=0
ROLE=a100
PROFILE=configs/test-tiny.yaml
WHEELS=""
LLAMA_SRC=""
GGUF=""
CUDA_ARCH="${CUDA_ARCH:-native}"

usage() { sed -n '2,24p' "$0"; }

while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --out) OUT="$2"; shift ;;
    --python) PYTHON="$2"; shift ;;
    --role) ROLE="$2"; shift ;;
    --profile) PROFILE="$2"; shift ;;
    --wheels) WHEELS="$2"; shift ;;
    --llama-cpp-src) LLAMA_SRC="$2"; shift ;;
    --gguf) GGUF="$2"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

# Carried files found where the defaults put them.
[ -z "$WHEELS" ] && [ -d .edgeflow/gpu-carry/wheels ] && WHEELS=.edgeflow/gpu-carry/wheels
[ -z "$LLAMA_SRC" ] && [ -d .edgeflow/gpu-carry/llama.cpp ] && LLAMA_SRC=.edgeflow/gpu-carry/llama.cpp
[ -z "$GGUF" ] && [ -f .edgeflow/gpu-carry/model.gguf ] && GGUF=.edgeflow/gpu-carry/model.gguf

# name | seconds | what
PLAN=(
  "doctor|540|edgeflow doctor --role $ROLE --profile $PROFILE --out $OUT/doctor"
  "llama-cpp-cuda|150|llama.cpp CUDA build + llama-bench"
)

describe() {
  echo "GPU check plan (results under $OUT):"
  for entry in "${PLAN[@]}"; do
    IFS='|' read -r name secs what <<<"$entry"
    printf '  %-15s timeout %4ss  %s\n' "$name" "$secs" "$what"
  done
  echo "wheels:         ${WHEELS:-none}"
  echo "llama.cpp tree: ${LLAMA_SRC:-none (llama-cpp-cuda will skip)}"
  echo "gguf:           ${GGUF:-none (llama-cpp-cuda will skip)}"
  echo "python:         $PYTHON"
}

if [ "$DRY_RUN" = 1 ]; then
  describe
  exit 0
fi

mkdir -p "$OUT"
describe | tee "$OUT/plan.txt"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [ -n "$WHEELS" ]; then
  "$PYTHON" -m pip install -q --no-index --no-deps --target "$OUT/pydeps" "$WHEELS"/*.whl >"$OUT/pip.log" 2>&1 \
    || echo "wheel install failed (see $OUT/pip.log); the checks needing them will fail, naming them"
  export PYTHONPATH="$OUT/pydeps${PYTHONPATH:+:$PYTHONPATH}"
fi

result() {  # name status reason seconds
  printf '{"step": "%s", "status": "%s", "reason": %s, "seconds": %s}\n' "$1" "$2" "$3" "$4" >"$OUT/$1.json"
}

failed=0
echo "== doctor (timeout 540s)"
start=$(date +%s)
timeout --kill-after=10 540 "$PYTHON" -m edgeflow.cli.doctor --role "$ROLE" --profile "$PROFILE" --out "$OUT/doctor" \
  >"$OUT/doctor.log" 2>&1
rc=$?
tail -n 3 "$OUT/doctor.log"
if [ ! -f "$OUT/doctor/doctor.json" ]; then
  result doctor fail "\"exited $rc without a report (see doctor.log)\"" "$(( $(date +%s) - start ))"
  failed=$((failed + 1))
elif [ "$rc" != 0 ]; then
  failed=$((failed + 1))
fi

echo "== llama-cpp-cuda (timeout 150s)"
start=$(date +%s)
if [ -z "$LLAMA_SRC" ]; then
  result llama-cpp-cuda skip '"no llama.cpp source tree carried (--llama-cpp-src DIR)"' 0
elif [ -z "$GGUF" ]; then
  result llama-cpp-cuda skip '"no GGUF to benchmark (--gguf FILE)"' 0
elif ! command -v nvcc >/dev/null || ! command -v cmake >/dev/null; then
  result llama-cpp-cuda skip '"nvcc or cmake not on PATH"' 0
else
  build="$OUT/work/llama-cuda"
  if timeout --kill-after=10 150 bash -c "cmake -S '$LLAMA_SRC' -B '$build' -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES='$CUDA_ARCH' \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF && cmake --build '$build' --target llama-bench -j $(nproc) \
        && '$build/bin/llama-bench' -m '$GGUF' -ngl 99 -p 128 -n 64 -o json >'$OUT/llama-bench.json'" >"$OUT/llama-cmake.log" 2>&1; then
    result llama-cpp-cuda pass null "$(( $(date +%s) - start ))"
  else
    result llama-cpp-cuda fail '"llama.cpp CUDA build or llama-bench failed (see llama-cmake.log)"' "$(( $(date +%s) - start ))"
    failed=$((failed + 1))
  fi
fi

echo "failed steps: $failed (results: $OUT/doctor/doctor.md, $OUT/llama-cpp-cuda.json)"
[ "$failed" = 0 ]
