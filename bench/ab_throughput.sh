#!/usr/bin/env bash
# A/B throughput: bench/throughput.py cases at the base commit and at HEAD, alternating base/head,
# one process per run, one thread; prints each run, then per case the medians and the median of the
# per-pair ratios head/base, with the 1-minute load average before each run.
#
#   git worktree add /tmp/base <base commit>
#   BASE_DIR=/tmp/base bash bench/ab_throughput.sh                    # 5 repeats of case_a,case_b
#   BASE_DIR=/tmp/base REPEATS=1 CASES=case_a bash bench/ab_throughput.sh   # a quick try
#
# BASE_DIR (required) and HEAD_DIR (default: this checkout) are trees holding pagedkv/ and
# bench/throughput.py; each runs its own bench/throughput.py with PYTHONPATH=<tree> (so its pagedkv
# wins over the editable install) from HEAD_DIR's venv. HEAD_DIR is the working tree: commit first
# (the script warns when pagedkv/ or bench/ has uncommitted changes). Options per run: --skip-hf
# (pagedkv only) --threads 1 --cases $CASES, the bundled default model (SmolLM2-135M), and
# $EXTRA_ARGS (e.g. EXTRA_ARGS="--quantization none": float32 weights, as the vLLM gate runs).
# Pin the whole comparison to one core with taskset -c 1 bash bench/ab_throughput.sh (runs inherit it).
# Logs and JSON lines go to $LOG_DIR (default $TMPDIR/pagedkv_ab_<time>).
# Time on a quiet 2-core machine: ~60 s a run of case_a,case_b, so 5 repeats x 2 trees ~10-11 min.
# The last line is one JSON object: the median per-pair ratio head/base per case, and the loads.
set -euo pipefail

BASE_DIR=${BASE_DIR:?"give BASE_DIR: a worktree of the base commit, e.g. git worktree add /tmp/base <commit>"}
HEAD_DIR=${HEAD_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
PY=${PY:-$HEAD_DIR/.venv/bin/python}
REPEATS=${REPEATS:-5}
CASES=${CASES:-case_a,case_b}
EXTRA_ARGS=${EXTRA_ARGS:-}
LOG_DIR=${LOG_DIR:-${TMPDIR:-/tmp}/pagedkv_ab_$(date -u +%H%M%S)}
mkdir -p "$LOG_DIR"

if [ -n "$(git -C "$HEAD_DIR" status --porcelain -- pagedkv bench 2>/dev/null)" ]; then
    echo "WARNING: $HEAD_DIR has uncommitted changes in pagedkv/ or bench/: HEAD is measured as the working tree" >&2
fi
echo "base: $BASE_DIR ($(git -C "$BASE_DIR" rev-parse --short HEAD 2>/dev/null || echo '?'))  head: $HEAD_DIR ($(git -C "$HEAD_DIR" rev-parse --short HEAD 2>/dev/null || echo '?'))"
echo "cases $CASES, $REPEATS repeats, alternating base/head, extra args '$EXTRA_ARGS'; logs in $LOG_DIR"

run_one() {  # $1 = base|head, $2 = repeat index
    local which=$1 rep=$2 dir load start end
    if [ "$which" = base ]; then dir=$BASE_DIR; else dir=$HEAD_DIR; fi
    load=$(cut -d' ' -f1 /proc/loadavg)
    start=$(date +%s.%N)
    (cd "$dir" && env PYTHONPATH="$dir" OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 "$PY" bench/throughput.py \
        --skip-hf --threads 1 --cases "$CASES" $EXTRA_ARGS) > "$LOG_DIR/$which.$rep.log" 2>&1 \
        || { echo "run $which $rep failed: see $LOG_DIR/$which.$rep.log" >&2; tail -5 "$LOG_DIR/$which.$rep.log" >&2; exit 1; }
    end=$(date +%s.%N)
    tail -1 "$LOG_DIR/$which.$rep.log" \
        | "$PY" -c "import json,sys; d=json.loads(sys.stdin.read()); d.update(which='$which', rep=$rep, load_before=$load, wall_s=round($end-$start, 1)); print(json.dumps(d))" \
        >> "$LOG_DIR/runs.jsonl"
    tail -1 "$LOG_DIR/runs.jsonl" | "$PY" -c "
import json, sys
d = json.loads(sys.stdin.read())
print(f\"[{d['rep']}] {d['which']:4}  load {d['load_before']:5.2f}  \" + '  '.join(
    f\"{c} {d[c + '_tok_s']:7.1f} tok/s\" for c in '$CASES'.split(',')) + f\"  ({d['wall_s']} s)\")"
}

for rep in $(seq 1 "$REPEATS"); do
    run_one base "$rep"
    run_one head "$rep"
done

"$PY" - "$LOG_DIR/runs.jsonl" "$CASES" <<'EOF'
import json, statistics, sys
runs = [json.loads(line) for line in open(sys.argv[1])]
cases = sys.argv[2].split(",")
base = {r["rep"]: r for r in runs if r["which"] == "base"}
head = {r["rep"]: r for r in runs if r["which"] == "head"}
reps = sorted(set(base) & set(head))
print(f"\n{'case':<8} {'base tok/s':>11} {'head tok/s':>11} {'ratio head/base (median of pairs)':>34}  per-pair ratios")
summary = {}
parts = {}  # median seconds before decoding / decoding per case and tree
for c in cases:
    key = c + "_tok_s"
    b = statistics.median(base[i][key] for i in reps)
    h = statistics.median(head[i][key] for i in reps)
    ratios = [head[i][key] / base[i][key] for i in reps]
    summary[c] = round(statistics.median(ratios), 4)
    print(f"{c:<8} {b:11.1f} {h:11.1f} {summary[c]:34.3f}  {[round(x, 3) for x in ratios]}")
    for part in ("prefill", "decode"):  # seconds before decoding / decoding (bench/throughput.py)
        key = f"{c}_{part}_s"
        if all(key in base[i] and key in head[i] for i in reps):
            bs, hs = [base[i][key] for i in reps], [head[i][key] for i in reps]
            parts[key] = {"base": statistics.median(bs), "head": statistics.median(hs)}
            print(f"  {part + '_s':<6} {statistics.median(bs):11.2f} {statistics.median(hs):11.2f} "
                  f"{statistics.median(h_ / b_ for h_, b_ in zip(hs, bs)):34.3f}  base {bs} head {hs}")
loads = [r["load_before"] for r in runs]
print(f"load average (1 min) before each run: {loads}; median {statistics.median(loads):.2f}")
print(json.dumps({"median_ratio_head_over_base": summary, "repeats": len(reps), "loads": loads,
                  "median_seconds": parts}))
EOF
