#!/usr/bin/env bash
# Everything this repository can only check on a GPU, in one go (under 8 minutes on an H200):
#   1. build kernels/ with its CUDA half and compile-check every .cu for sm_80 and sm_90
#   2. every CUDA test of chapters 02-06 and kernels/ (DEVICE=cuda; the CPU-only tests are CI's job)
#   3. a short decode benchmark (slurm/gpu_decode_bench.py) and chapter 06's kernel timings on CUDA
# then a summary. Runs from a clone with `make setup` done (uses .venv), or bare on a machine that
# has torch, transformers, tokenizers, safetensors, ninja and pytest (uses python3): models are
# made on the spot. tiny-llama3 needs SmolLM2's tokenizer files: models/smollm2-135m/ from
# `make models`, or TOKENIZER_DIR=a folder with tokenizer.json and tokenizer_config.json.
#   bash slurm/gpu_check.sh            sbatch slurm/test_chapter.sbatch 6 runs it on a Slurm node
set -uo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export DEVICE=cuda PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
# Without `pip install -e .`, the repository root on PYTHONPATH makes `common` and `kernels` importable.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT_DIR=${OUT:-bench/results}
mkdir -p "$OUT_DIR"
declare -a SUMMARY
note() { SUMMARY+=("$1"); echo "== $1"; }
started=$(date +%s)

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || note "nvidia-smi: not available"
$PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available())"

# --- 1. kernels/ ------------------------------------------------------------------------------
if bash kernels/csrc/cuda/check_compile.sh; then note "nvcc sm_80 + sm_90: every .cu compiles"; else note "FAILED: nvcc compile check"; fi
if $PY -m kernels.build; then note "kernels/ built"; else note "FAILED: kernels/ build"; fi

# --- models: tiny-llama3 on the spot ------------------------------------------------------------
export MODELS_DIR=${MODELS_DIR:-$PWD/models}
if [ ! -f "$MODELS_DIR/tiny-llama3/config.json" ]; then
  TOK=${TOKENIZER_DIR:-$MODELS_DIR/smollm2-135m}
  if [ -f "$TOK/tokenizer.json" ]; then
    $PY -c "from pathlib import Path; from common.prepare_models import prepare_tiny_llama3 as p; p(Path('$MODELS_DIR/tiny-llama3'), Path('$TOK'))" \
      && note "tiny-llama3 made on the spot" || note "FAILED: making tiny-llama3"
  else
    note "no tokenizer files at $TOK: tests needing tiny-llama3 will fail (set TOKENIZER_DIR)"
  fi
fi

# --- 2. the CUDA tests ------------------------------------------------------------------------
# -k cuda: the device-parametrised cases ([cuda]) and the tests named for CUDA. A test module that
# needs a package this machine lacks (the server's fastapi/uvicorn/pydantic/openai, gguf) skips
# itself and names the package (common.testing.require): no list of files here.
select="cuda"
[ -f "$MODELS_DIR/smollm2-135m/config.json" ] || select="cuda and not smollm2"
for suite in chapters/0[2-6]_*/tests kernels/tests; do
  log=$(mktemp)
  timeout 300 $PY -m pytest -q -rs -p no:cacheprovider "$suite" -k "$select" >"$log" 2>&1
  rc=$?
  tail -n 25 "$log"
  line=$(grep -E "passed|failed|error|no tests ran" "$log" | tail -1)
  [ $rc -eq 0 ] || [ $rc -eq 5 ] && note "$suite: $line" || note "FAILED $suite (rc $rc): $line"
done

# --- 3. speed ---------------------------------------------------------------------------------
timeout 240 $PY slurm/gpu_decode_bench.py --out "$OUT_DIR/gpu_decode.json" && note "decode bench: $OUT_DIR/gpu_decode.json" \
  || note "FAILED: decode bench"
# --budget-s: no new case after 90 s, inside the 120 s timeout; every case is saved as it is measured.
timeout 120 $PY chapters/06_cuda_kernel/bench.py --parts kernels --device cuda --budget-s 90 --out "$OUT_DIR/ch06_bench_cuda.json" \
  && note "kernel timings: $OUT_DIR/ch06_bench_cuda.json" || note "FAILED: kernel timings"

echo
echo "=== summary ($(( $(date +%s) - started )) s)"
printf '  %s\n' "${SUMMARY[@]}"
printf '%s\n' "${SUMMARY[@]}" | grep -q FAILED && exit 1 || exit 0
