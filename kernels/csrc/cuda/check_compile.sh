#!/usr/bin/env bash
# Compiles every CUDA source of the kernel library for sm_80 (A100) and sm_90 (H100/H200) (ARCHS=), without
# a GPU and without torch, and prints one line per file: the kernels it holds, their largest
# register count and any spills (registers that did not fit and went to local memory, which is
# slow). Run by `make kernels-cuda-check`; exits nonzero if a file fails or warns.
#
#   bash kernels/csrc/cuda/check_compile.sh            one line per file
#   VERBOSE=1 bash kernels/csrc/cuda/check_compile.sh  and every kernel's registers, per architecture
#   NVCC=/path/to/nvcc ...                             another compiler
#   ARCHS="80" ...                                     only these architectures (make test: sm_80,
#                                                      the one a lent H200's own build never compiles)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
nvcc="${NVCC:-nvcc}"
if ! command -v "$nvcc" >/dev/null 2>&1; then
    echo "check_compile: $nvcc not found (set NVCC=/path/to/nvcc)" >&2
    exit 2
fi

# -Werror all-warnings: every warning fails the check: the host compiler's (-Wall -Wextra), the
#   CUDA front end's, and ptxas's, which with -warn-spills / -warn-lmem-usage warns when a kernel
#   spills registers or uses local memory (a performance bug here: the kernels keep their arrays
#   in registers by design). To see a spilling kernel's numbers anyway, drop -Werror and use VERBOSE=1.
# -Xptxas -v: registers, shared memory and spills of every kernel, parsed below.
# The -D__CUDA_NO_*: what torch's extension build passes nvcc (kernels/build.py), so this checks
#   the code users compile.
flags=(-std=c++20 -O3 -c
       -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__
       -D__CUDA_NO_HALF2_OPERATORS__
       $(for a in ${ARCHS:-80 90}; do printf -- '-gencode arch=compute_%s,code=sm_%s ' "$a" "$a"; done)
       -Xcompiler -fPIC -Xcompiler -Wall -Xcompiler -Wextra
       -Werror all-warnings
       -Xptxas -v -Xptxas -warn-spills -Xptxas -warn-lmem-usage)

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

demangle() { if command -v c++filt >/dev/null 2>&1; then c++filt; else cat; fi; }

shopt -s nullglob
sources=("$here"/*.cu)
if [ ${#sources[@]} -eq 0 ]; then
    echo "check_compile: no .cu file in $here" >&2
    exit 2
fi

# Compile the files side by side (each is one nvcc process), then report in order.
compile() {
    local src="$1" stem="$tmp/$(basename "${1%.cu}")"
    local start end
    start=$(date +%s.%N)
    if "$nvcc" "${flags[@]}" -o "$stem.o" "$src" >"$stem.log" 2>&1; then echo 0 >"$stem.rc"; else echo 1 >"$stem.rc"; fi
    end=$(date +%s.%N)
    awk -v s="$start" -v e="$end" 'BEGIN { printf "%.1f", e - s }' >"$stem.seconds"
}
for src in "${sources[@]}"; do compile "$src" & done
wait

status=0
for src in "${sources[@]}"; do
    name="$(basename "$src")"
    stem="$tmp/${name%.cu}"
    log="$stem.log"
    # ptxas -v prints, per kernel and architecture:
    #   Compiling entry function '<mangled>' for 'sm_90'
    #   Function properties for <mangled>
    #       0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
    #   Used 168 registers, used 1 barriers, 16640 bytes smem, ...
    summary=$(awk -v archs="$(printf 'sm_%s + ' ${ARCHS:-80 90} | sed 's/ + $//')" '
        /Compiling entry function/ { kernels++ }
        /bytes spill stores/ { for (i = 1; i <= NF; i++) if ($i == "spill" && $(i + 1) ~ /^(stores|loads),?$/) spills += $(i - 2) }
        /Used [0-9]+ registers/ { for (i = 1; i <= NF; i++) if ($i == "Used") { r = $(i + 1) + 0; if (r > maxr) maxr = r } }
        END { printf "%d kernels (%s), max %d registers, %d bytes spilled", kernels, archs, maxr, spills }' "$log")
    warnings=$(grep -ciE "warning" "$log" || true)
    if [ "$(cat "$stem.rc")" = 0 ] && [ "$warnings" -eq 0 ]; then
        printf "ok    %-22s %s, %ss\n" "$name" "$summary" "$(cat "$stem.seconds")"
    else
        printf "FAIL  %-22s the compiler's errors and warnings:\n" "$name"
        grep -vE "^ptxas info|^ +[0-9]+ bytes stack frame" "$log" | sed 's/^/      /' || true
        status=1
    fi
    if [ "${VERBOSE:-0}" != "0" ]; then
        awk '
            /Compiling entry function/ { match($0, /\x27[^\x27]+\x27/); k = substr($0, RSTART + 1, RLENGTH - 2);
                                         match($0, /for \x27sm_[0-9]+\x27/); arch = substr($0, RSTART + 5, RLENGTH - 6) }
            /Used [0-9]+ registers/ { line = $0; sub(/^.*Used/, "Used", line); printf "        %s  %s  | %s\n", arch, k, line }' "$log" | demangle
    fi
done
exit "$status"
