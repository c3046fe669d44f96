#!/usr/bin/env bash
# What slurm/gpu_check.sh needs on a bare GPU machine with no network (python3 with torch, pytest and
# transformers; no .venv, no models, no server stack), packed here where pip works:
#   DIR/repo.tar.gz   the repository at HEAD (for a machine that gets this folder alone)
#   DIR/tokenizer/    SmolLM2's tokenizer files: tiny-llama3 is made from them on the spot
#   DIR/wheels/       the server stack, gguf and ninja, with every dependency but numpy, for PACK_PYTHON
# At most 40 MiB. gpu_check.sh installs the wheels offline (pip --no-index --target) when it finds
# the folder (GPU_CHECK_PACK=DIR, default .gpu-pack in the repository's root).
#   bash slurm/pack_gpu_check.sh [DIR]        PACK_PYTHON=3.12 (the GPU machine's python3) by default
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.gpu-pack}
PY=${PY:-.venv/bin/python}
PACK_PYTHON=${PACK_PYTHON:-3.12}
TOKENIZER_DIR=${TOKENIZER_DIR:-models/smollm2-135m}
[ -x "$PY" ] || { echo "error: $PY not found: run make setup first (the wheels' versions are the venv's)" >&2; exit 1; }
[ -f "$TOKENIZER_DIR/tokenizer.json" ] || { echo "error: no $TOKENIZER_DIR/tokenizer.json: run make models" >&2; exit 1; }

rm -rf "$DIR" && mkdir -p "$DIR/tokenizer" "$DIR/wheels"
git archive --format=tar.gz -o "$DIR/repo.tar.gz" HEAD
cp "$TOKENIZER_DIR"/tokenizer.json "$TOKENIZER_DIR"/tokenizer_config.json "$DIR/tokenizer/"

# The packages the server and GGUF tests import, and everything they need on a Linux PACK_PYTHON,
# at the versions this venv has, and ninja, which torch's extension builder runs and torch's wheel
# does not bring. numpy stays out: torch needs it, so every torch machine has it.
pins=$(PACK_PYTHON=$PACK_PYTHON "$PY" - <<'EOF'
import importlib.metadata as md
import os

from packaging.requirements import Requirement

env = {"python_version": os.environ["PACK_PYTHON"], "sys_platform": "linux", "platform_system": "Linux",
       "implementation_name": "cpython", "os_name": "posix", "extra": ""}
todo, pins = ["fastapi", "uvicorn", "pydantic", "openai", "httpx", "gguf", "ninja"], {}
while todo:
    dist = md.distribution(todo.pop())
    name = dist.metadata["Name"].lower().replace("_", "-")
    if name in pins or name == "numpy":
        continue
    pins[name] = dist.version
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            todo.append(req.name)
print(" ".join(f"{n}=={v}" for n, v in sorted(pins.items())))
EOF
)
platforms=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_28_x86_64 manylinux_2_34_x86_64; do platforms+=(--platform "$p"); done
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PACK_PYTHON" --implementation cp \
  "${platforms[@]}" -d "$DIR/wheels" $pins

size=$(du -sm "$DIR" | cut -f1)
echo "$DIR: $(ls "$DIR/wheels" | wc -l) wheels, tokenizer files, repo at $(git rev-parse --short HEAD); ${size} MiB"
[ "$size" -le 40 ] || { echo "error: $DIR is ${size} MiB, over 40" >&2; exit 1; }
