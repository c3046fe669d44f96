#!/usr/bin/env bash
# Compiles every C++ source of the kernel library's host half, csrc/cpu/*.cpp and the torch glue
# csrc/*.cpp, as kernels/build.py does (torch's include directories and defines, -O3 -std=c++20
# -fopenmp, for baseline x86-64), with -Wall -Wextra -Werror: the CPU twin of
# ../cuda/check_compile.sh. Prints one line per file; exits nonzero if a file fails or warns. Run by
# `make kernels-check`. Needs the compiler and the Python with torch that build the kernels, not a
# GPU. Where torch is a CUDA build and nvcc is found, the torch glue is compiled a second time with
# -DWITH_CUDA, as the build does.
#
#   bash kernels/csrc/cpu/check_compile.sh                         with python3 and c++ from PATH
#   PYTHON=.venv/bin/python CXX=g++-13 bash kernels/csrc/cpu/check_compile.sh
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
csrc="$(dirname "$here")"
python="${PYTHON:-python3}"
cxx="${CXX:-c++}"
if ! command -v "$cxx" >/dev/null 2>&1; then
    echo "check_compile: $cxx not found (set CXX=/path/to/c++)" >&2
    exit 2
fi

# Line 1: "cuda" when build.py would build the CUDA half here, else "cpu"; then the include
# directories, one a line: torch's (for that variant) and Python's.
if ! paths="$(cd "$csrc/../.." && "$python" -c '
import sysconfig
from torch.utils.cpp_extension import include_paths
from kernels.build import cuda_build_possible
variant = "cuda" if cuda_build_possible() is None else "cpu"
print(variant, *include_paths(variant), sysconfig.get_paths()["include"], sep="\n")')"; then
    echo "check_compile: $python cannot import torch and kernels (set PYTHON=.venv/bin/python)" >&2
    exit 2
fi
mapfile -t paths <<<"$paths"
variant="${paths[0]}"

# -isystem: torch's and Python's headers are not ours to fix, so their warnings are not reported.
flags=(-DTORCH_EXTENSION_NAME=llm_kernels_check -DTORCH_API_INCLUDE_EXTENSION_H -fPIC -O3 -std=c++20 -fopenmp
       -Wall -Wextra -Werror -c)
for dir in "${paths[@]:1}"; do flags+=(-isystem "$dir"); done

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# One compile per file, side by side (the torch glue, with all of ATen, takes longest), then a report in order.
glue=("$csrc"/*.cpp)
jobs=("$here"/*.cpp "${glue[@]}")
compile() {
    local src="$1" stem="$2"
    shift 2
    local start end
    start=$(date +%s.%N)
    if "$cxx" "${flags[@]}" "$@" -o "$stem.o" "$src" >"$stem.log" 2>&1; then echo 0 >"$stem.rc"; else echo 1 >"$stem.rc"; fi
    end=$(date +%s.%N)
    awk -v s="$start" -v e="$end" 'BEGIN { printf "%.1f", e - s }' >"$stem.seconds"
}
names=()
for src in "${jobs[@]}"; do
    name="$(basename "$src")"
    names+=("$name")
    compile "$src" "$tmp/$name" &
done
if [ "$variant" = cuda ]; then
    for src in "${glue[@]}"; do
        name="$(basename "$src") -DWITH_CUDA"
        names+=("$name")
        compile "$src" "$tmp/$name" -DWITH_CUDA &
    done
fi
wait

status=0
for name in "${names[@]}"; do
    stem="$tmp/$name"
    if [ "$(cat "$stem.rc")" = 0 ] && [ ! -s "$stem.log" ]; then
        printf "ok    %-28s %ss\n" "$name" "$(cat "$stem.seconds")"
    else
        printf "FAIL  %-28s the compiler's errors and warnings:\n" "$name"
        sed 's/^/      /' "$stem.log"
        status=1
    fi
done
exit "$status"
