#!/usr/bin/env bash
# The GPU checks of pagedkv, in one run on a machine with an NVIDIA GPU, as that machine is: its own
# python3 with torch, triton and transformers; our setup script does not run there and nothing is
# downloaded (packages it lacks travel as wheels: --wheels DIR). Within about 10 minutes:
#
#   1. environment: versions, the GPU, and every package pagedkv imports (a clear list of what is missing)
#   2. kernels: the Triton kernel tests (decode, prefill, cache write and block copy) on CUDA tensors
#   3. engine: greedy equality against transformers and the CPU path on tiny random models, device cuda
#   4. throughput: cases a, b, c at bfloat16 on random weights of the benchmark shape and a larger one
#   5. tensor parallelism: with two GPUs or more, the engine's TP = 2 equality tests (TP = 1's tokens and
#      logprobs) with the ranks on cuda:0 and cuda:1 joined by NCCL; with fewer it says why it skipped
#
# The last line is one JSON object: each stage's status, test counts and the throughput figures.
#
#   scripts/gpu_check.sh [--dry-run] [--python PYTHON] [--wheels DIR] [--out DIR] [--skip-bench]
#                        [--shapes smollm2-135m,llama-1b] [--stage-timeout SECONDS]
#
# --dry-run prints what it would run (and checks the arguments and the imports it can check here).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

python=python3
wheels=""
out="${OUT:-/tmp/pagedkv-gpu-check}"
dry_run=0
skip_bench=0
shapes="smollm2-135m,llama-1b"
stage_timeout=240

usage() { sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry_run=1 ;;
        --python) python="${2:?--python needs a value}"; shift ;;
        --wheels) wheels="${2:?--wheels needs a directory}"; shift ;;
        --out) out="${2:?--out needs a directory}"; shift ;;
        --skip-bench) skip_bench=1 ;;
        --shapes) shapes="${2:?--shapes needs a value}"; shift ;;
        --stage-timeout) stage_timeout="${2:?--stage-timeout needs seconds}"; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
case "$stage_timeout" in ''|*[!0-9]*) echo "gpu_check: --stage-timeout must be whole seconds" >&2; exit 2 ;; esac
if [ -n "$wheels" ] && [ ! -d "$wheels" ]; then echo "gpu_check: --wheels $wheels is not a directory" >&2; exit 2; fi
command -v "$python" >/dev/null 2>&1 || { echo "gpu_check: no $python" >&2; exit 2; }

kernel_tests="tests/ops/triton/test_triton_decode.py tests/ops/triton/test_triton_prefill.py tests/ops/triton/test_triton_cache_ops.py"
engine_tests="tests/runner/test_device.py"
tp_tests="tests/distributed/test_tp_engine.py"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PAGEDKV_TEST_DEVICE=cuda
unset TRITON_INTERPRET

steps=(
    "install wheels: ${wheels:-(none given)}"
    "environment: $python -c 'import torch, triton, transformers, ...' (versions, GPU, missing packages)"
    "kernels: timeout $stage_timeout $python -m pytest -q -p no:cacheprovider $kernel_tests"
    "engine: timeout $stage_timeout $python -m pytest -q -p no:cacheprovider $engine_tests"
)
[ "$skip_bench" = 1 ] || steps+=("throughput: timeout $stage_timeout $python bench/gpu_throughput.py --device cuda --dtype bfloat16 --shapes $shapes")
steps+=("tensor parallelism (2+ GPUs, else skipped with the reason): timeout $stage_timeout $python -m pytest -q -p no:cacheprovider $tp_tests")
if [ "$dry_run" = 1 ]; then
    echo "gpu_check (dry run): PAGEDKV_TEST_DEVICE=cuda, results under $out"
    for s in "${steps[@]}"; do echo "  - $s"; done
    # What can be checked without a GPU: the scripts and test files exist and parse.
    for f in $kernel_tests $engine_tests $tp_tests bench/gpu_throughput.py; do
        [ -f "$f" ] || { echo "gpu_check: missing $f" >&2; exit 1; }
    done
    "$python" -c "import ast, sys; [ast.parse(open(f).read(), f) for f in sys.argv[1:]]" $kernel_tests $engine_tests $tp_tests \
        bench/gpu_throughput.py pagedkv/ops/triton/*.py
    echo "gpu_check (dry run): files present and parse"
    exit 0
fi

mkdir -p "$out"
if [ -n "$wheels" ]; then
    "$python" -m pip install --quiet --no-index --find-links "$wheels" "$wheels"/*.whl 2>&1 | tail -3 || true
fi

"$python" - <<'EOF' | tee "$out/environment.json"
import importlib.util, json
need = ["torch", "triton", "transformers", "numpy", "safetensors", "tokenizers", "jinja2", "gguf", "tqdm",
        "pytest", "hypothesis", "fastapi", "prometheus_client"]
missing = [m for m in need if importlib.util.find_spec(m) is None]
info = {"missing": missing}
if importlib.util.find_spec("torch"):
    import torch
    info |= {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
             "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
if importlib.util.find_spec("triton"):
    import triton
    info["triton"] = triton.__version__
print(json.dumps(info))
EOF

run_stage() {  # name, command...: runs it under the stage timeout, keeps its log, prints its summary line
    local name="$1"; shift
    local status=0
    timeout "$stage_timeout" "$@" >"$out/$name.log" 2>&1 || status=$?
    tail -3 "$out/$name.log" | sed "s/^/[$name] /" >&2
    echo "$status"
}
summary() {  # the pytest summary line of a log ("12 passed, 1 skipped in 3.2s")
    grep -E "(passed|failed|error|skipped)" "$1" | tail -1 | tr -d '=' | sed 's/^ *//;s/ *$//'
}

kernels=$(run_stage kernels "$python" -m pytest -q -p no:cacheprovider $kernel_tests)
engine=$(run_stage engine "$python" -m pytest -q -p no:cacheprovider $engine_tests)
bench="null"
bench_status="skipped"
if [ "$skip_bench" = 0 ]; then
    bench_status=$(run_stage throughput "$python" bench/gpu_throughput.py --device cuda --dtype bfloat16 --shapes "$shapes")
    bench=$(tail -1 "$out/throughput.log" | grep -E '^\{' || echo null)
fi
gpus=$("$python" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null \
    || echo 0)
if [ "$gpus" -ge 2 ]; then
    tp_status=$(run_stage tp "$python" -m pytest -q -p no:cacheprovider $tp_tests)
    tp_summary=$(summary "$out/tp.log")
else
    tp_status="skipped"
    tp_summary="skipped: torch sees $gpus GPU(s); the tensor-parallel stage needs 2 (one rank per GPU, NCCL)"
    echo "[tp] $tp_summary" >&2
fi
"$python" - "$kernels" "$engine" "$bench_status" "$(summary "$out/kernels.log")" "$(summary "$out/engine.log")" \
    "$bench" "$(cat "$out/environment.json")" "$tp_status" "$tp_summary" <<'EOF'
import json, sys
k, e, b, ks, es, bench, env, t, ts = sys.argv[1:]
print(json.dumps({"kernels_status": int(k), "kernels": ks, "engine_status": int(e), "engine": es,
                  "throughput_status": b if b == "skipped" else int(b), "throughput": json.loads(bench),
                  "tp_status": t if t == "skipped" else int(t), "tp": ts,
                  "environment": json.loads(env)}))
EOF
