#!/usr/bin/env bash
# Resident memory of radixgate and of sglang-router 0.3.2 (both cache_aware) replaying the same
# Mooncake trace as text (issue 11, deliverable 5: tree memory).
#
# One sim-worker process serves N simulated workers (--ports, answering at once:
# --token-interval-ms 0, approx tokenizer), so the gateways' trees, not the workers, are what
# grows. For each gateway: start it on the cluster, warm it up with a few tiny requests, read
# VmRSS / VmHWM from /proc/PID/status (summed over the process and its descendants), replay the
# trace with loadgen (--workload trace --api completions: the prompt text is exactly what
# `cargo bench --bench tree_memory` inserts offline), wait for the tree writer, read them again,
# stop the gateway (the workers' caches are flushed before each replay). radixgate's tree gauges
# (radixgate_tree_nodes, radixgate_tree_chars, radixgate_tree_evicted_chars) come from its
# /metrics; sglang-router exports no tree size.
#
# The trace is compressed in time (--time-scale, default 0.04: the hour-long conversation trace in
# ~2.5 minutes per gateway, ~85 requests/s of ~48 KB prompts). Traces are found like loadgen's
# --trace (a path, or a name looked up in $RADIXGATE_TRACES and ../shared/traces).
# Writes results/bench-memory-<stamp>/report.md (a Markdown table, also printed); --write-docs
# also puts it into docs/benchmarks.md (section memory-TRACE, or --docs-section NAME).
# Only 127.0.0.1; every process started here is stopped by its PID on exit.
#
# Usage: scripts/bench-memory.sh [--trace conversation|synthetic|PATH] [--workers N]
#          [--time-scale X] [--num-requests N] [--gateways radixgate,sglang-router]
#          [--skip-build] [--out DIR] [--write-docs [--docs-section NAME]]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
COMMAND="scripts/bench-memory.sh$(printf ' %q' "$@")"

TRACE=conversation
WORKERS=8
TIME_SCALE=0.04
NUM_REQUESTS=""
GATEWAYS="radixgate,sglang-router"
BUILD=1
OUT=""
WRITE_DOCS=0
DOCS_SECTION=""
SGLANG_ROUTER_VERSION=0.3.2

usage() { sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --trace) TRACE="$2"; shift 2 ;;
        --workers) WORKERS="$2"; shift 2 ;;
        --time-scale) TIME_SCALE="$2"; shift 2 ;;
        --num-requests) NUM_REQUESTS="$2"; shift 2 ;;
        --gateways) GATEWAYS="$2"; shift 2 ;;
        --skip-build) BUILD=0; shift ;;
        --out) OUT="$2"; shift 2 ;;
        --write-docs) WRITE_DOCS=1; shift ;;
        --docs-section) DOCS_SECTION="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown option: $1 (see --help)" >&2; exit 2 ;;
    esac
done
[[ "$WORKERS" =~ ^[1-9][0-9]*$ ]] || { echo "--workers takes a positive integer" >&2; exit 2; }
case "$TRACE" in conversation|synthetic) DOCS_SECTION="${DOCS_SECTION:-memory-$TRACE}" ;; esac
[[ "$WRITE_DOCS" == 0 || -n "$DOCS_SECTION" ]] || { echo "--write-docs with a trace path needs --docs-section NAME" >&2; exit 2; }
for g in ${GATEWAYS//,/ }; do
    case "$g" in
        radixgate|sglang-router) ;;
        *) echo "unknown gateway: $g (radixgate, sglang-router)" >&2; exit 2 ;;
    esac
done

OUT="${OUT:-results/bench-memory-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"

log() { printf '[bench-memory %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# ---- process bookkeeping: kill only what we started, by PID ----------------------------------
PIDS=()
stop_pid() {
    local pid="$1"
    kill -0 "$pid" 2>/dev/null || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do
        kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null || true; return 0; }
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    for pid in "${PIDS[@]}"; do stop_pid "$pid"; done
    exit "$rc"
}
trap cleanup EXIT
trap 'echo; echo "interrupted" >&2; exit 130' INT TERM

free_ports() { # free_ports N: the first of N consecutive free loopback ports
    python3 - "$1" <<'PY'
import random, socket, sys
n = int(sys.argv[1])
for _ in range(200):
    base = random.randrange(20000, 32000 - n)
    socks = []
    try:
        for p in range(base, base + n):
            s = socket.socket(); s.bind(("127.0.0.1", p)); socks.append(s)
    except OSError:
        continue
    finally:
        for s in socks: s.close()
    print(base); sys.exit(0)
sys.exit("no free port block found")
PY
}

wait_http() { # wait_http URL SECS PID: 200 within SECS, while PID lives
    local url="$1" secs="$2" pid="$3"
    for _ in $(seq 1 $((secs * 10))); do
        [[ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$url" || true)" == 200 ]] && return 0
        kill -0 "$pid" 2>/dev/null || return 1
        sleep 0.1
    done
    return 1
}

# Resident kB of PID and its descendants: "VmRSS VmHWM" (sglang-router is a Python process
# hosting the Rust router; any child it starts counts too).
mem_kb() {
    local pids=("$1") i=0 rss=0 hwm=0 p r h
    while [[ $i -lt ${#pids[@]} ]]; do
        p="${pids[$i]}"
        i=$((i + 1))
        [[ -r "/proc/$p/status" ]] || continue
        r="$(awk '$1 == "VmRSS:" { print $2 }' "/proc/$p/status" 2>/dev/null || true)"
        h="$(awk '$1 == "VmHWM:" { print $2 }' "/proc/$p/status" 2>/dev/null || true)"
        rss=$((rss + ${r:-0}))
        hwm=$((hwm + ${h:-0}))
        for c in $(cat /proc/"$p"/task/*/children 2>/dev/null || true); do pids+=("$c"); done
    done
    echo "$rss $hwm"
}

# ---- build and sglang-router ------------------------------------------------------------------
if [[ "$BUILD" == 1 ]]; then
    log "building release (cargo build --release -p radixgate -p loadtest)"
    cargo build --release -q -p radixgate -p loadtest
fi
for bin in radixgate sim-worker loadgen; do
    [[ -x "target/release/$bin" ]] || { echo "missing target/release/$bin (build first, or drop --skip-build)" >&2; exit 1; }
done
if [[ ",$GATEWAYS," == *",sglang-router,"* ]] && ! .venv/bin/python -c 'import sglang_router' 2>/dev/null; then
    [[ -x .venv/bin/python ]] || python3 -m venv .venv
    log "installing sglang-router==$SGLANG_ROUTER_VERSION into .venv/"
    .venv/bin/pip install -q "sglang-router==$SGLANG_ROUTER_VERSION" >"$OUT/pip.log" 2>&1 \
        || log "sglang-router unavailable (see $OUT/pip.log): its row will say so"
fi

# ---- the cluster -------------------------------------------------------------------------------
BASE="$(free_ports $((WORKERS + 2)))"
LAST=$((BASE + WORKERS - 1))
GW_PORT=$((BASE + WORKERS))
METRICS_PORT=$((BASE + WORKERS + 1))
URLS=()
for ((i = 0; i < WORKERS; i++)); do URLS+=("http://127.0.0.1:$((BASE + i))"); done
log "starting $WORKERS simulated workers on 127.0.0.1:$BASE-$LAST"
target/release/sim-worker --ports "$BASE-$LAST" --tokenizer approx --token-interval-ms 0 >"$OUT/sim-worker.log" 2>&1 &
SIM_PID=$!
PIDS+=("$SIM_PID")
for ((p = BASE; p <= LAST; p++)); do
    wait_http "http://127.0.0.1:$p/health" 30 "$SIM_PID" || { tail -20 "$OUT/sim-worker.log" >&2; exit 1; }
done

# The send window: the whole trace at --time-scale (timestamps are ms) plus a margin.
DURATION=3600
if TRACE_PATH="$(python3 - "$TRACE" <<'PY'
import os, sys
spec = sys.argv[1]
name = spec if spec.endswith(".jsonl") else f"mooncake_{spec}_trace.jsonl"
dirs = [os.environ.get("RADIXGATE_TRACES", ""), "../shared/traces", "../../shared/traces"]
for p in [spec] + [os.path.join(d, name) for d in dirs if d]:
    if os.path.isfile(p):
        print(p); sys.exit(0)
sys.exit(1)
PY
)"; then
    DURATION="$(tail -n 1 "$TRACE_PATH" | python3 -c 'import json, sys; print(json.load(sys.stdin)["timestamp"] / 1000)')"
else
    log "trace $TRACE not found here; loadgen will look it up (send window: one hour of trace)"
fi
WINDOW="$(python3 -c "import math; print(math.ceil($DURATION * $TIME_SCALE) + 5)")"
LG=(--workload trace --trace "$TRACE" --api completions --time-scale "$TIME_SCALE" --duration "$WINDOW" --drain 120)
[[ -n "$NUM_REQUESTS" ]] && LG+=(--num-requests "$NUM_REQUESTS")

metric() { awk -v n="$1" '$1 == n { printf "%d", $2 }' "$2" 2>/dev/null || true; }

mb() { python3 -c "print(f'{$1 / 1024:.1f}')"; } # kB -> MiB

ROWS=()
run_gateway() { # run_gateway NAME
    local name="$1" dir="$OUT/$1" pid status=ok before after nodes="—" chars="—" evicted="—" ok_sent="—" hit="—" secs="—" t0
    mkdir -p "$dir"
    local args=(--worker-urls "${URLS[@]}" --policy cache_aware --host 127.0.0.1 --port "$GW_PORT"
        --prometheus-host 127.0.0.1 --prometheus-port "$METRICS_PORT")
    if [[ "$name" == radixgate ]]; then
        target/release/radixgate "${args[@]}" --log-level warn >"$dir/gateway.log" 2>&1 &
    elif .venv/bin/python -c 'import sglang_router' 2>/dev/null; then
        .venv/bin/python -m sglang_router.launch_router "${args[@]}" --log-level warn >"$dir/gateway.log" 2>&1 &
    else
        ROWS+=("| sglang-router $SGLANG_ROUTER_VERSION cache_aware | not installed | | | | | | | | |")
        return 0
    fi
    pid=$!
    PIDS+=("$pid")
    log "[$name] started (PID $pid) on 127.0.0.1:$GW_PORT"
    if ! wait_http "http://127.0.0.1:$GW_PORT/readiness" 60 "$pid" && ! wait_http "http://127.0.0.1:$GW_PORT/health" 5 "$pid"; then
        status="did not become ready"
    fi
    if [[ "$status" == ok ]]; then
        target/release/loadgen --target "http://127.0.0.1:$GW_PORT" --workload rate --rate 20 --duration 1 --drain 5 \
            --quiet --json "$dir/warmup.json" >/dev/null 2>"$dir/warmup.log" || status="warm-up failed"
    fi
    if [[ "$status" == ok ]]; then
        # Every gateway starts on cold workers (the previous replay's prefixes are flushed).
        for u in "${URLS[@]}"; do curl -s -o /dev/null --max-time 5 -X POST "$u/flush_cache" || true; done
        sleep 1
        before="$(mem_kb "$pid")"
        log "[$name] replaying $TRACE at time scale $TIME_SCALE (send window ${WINDOW}s)"
        t0=$(date +%s)
        target/release/loadgen --target "http://127.0.0.1:$GW_PORT" "${LG[@]}" --quiet \
            --json "$dir/loadgen.json" >/dev/null 2>"$dir/loadgen.log" || status="loadgen failed (see $dir/loadgen.log)"
        secs=$(($(date +%s) - t0))
        # The tree writer publishes within milliseconds; leave it a moment before measuring.
        sleep 2
        after="$(mem_kb "$pid")"
        if [[ "$name" == radixgate ]]; then
            curl -s --max-time 10 "http://127.0.0.1:$METRICS_PORT/metrics" >"$dir/metrics-after.prom" || true
            nodes="$(metric radixgate_tree_nodes "$dir/metrics-after.prom")"
            chars="$(metric radixgate_tree_chars "$dir/metrics-after.prom")"
            evicted="$(metric radixgate_tree_evicted_chars "$dir/metrics-after.prom")"
        fi
        if [[ -s "$dir/loadgen.json" ]]; then
            ok_sent="$(python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print(r["ok"], r["sent"], sep="/")' "$dir/loadgen.json")"
            hit="$(python3 -c 'import json,sys; h=json.load(open(sys.argv[1])).get("hit_rate"); print("—" if h is None else f"{100*h:.1f} %")' "$dir/loadgen.json")"
        fi
    fi
    stop_pid "$pid"
    local label="radixgate cache_aware"
    [[ "$name" == sglang-router ]] && label="sglang-router $SGLANG_ROUTER_VERSION cache_aware"
    if [[ "$status" != ok && -z "${after:-}" ]]; then
        ROWS+=("| $label | FAILED: $status | | | | | | | | |")
        log "[$name] FAILED: $status"
        return 0
    fi
    read -r rb hb <<<"$before"
    read -r ra ha <<<"$after"
    ROWS+=("| $label | $(mb "$rb") | $(mb "$hb") | $(mb "$ra") | $(mb "$ha") | $nodes | $chars | $evicted | $ok_sent | $hit |")
    [[ "$status" == ok ]] || ROWS[-1]="${ROWS[-1]} $status"
    log "[$name] VmRSS $(mb "$rb") -> $(mb "$ra") MiB, VmHWM $(mb "$ha") MiB, replay ${secs}s"
}

for g in ${GATEWAYS//,/ }; do run_gateway "$g"; done

{
    echo "# Gateway resident memory, Mooncake $TRACE trace replayed as text"
    echo
    echo "$(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs, $WORKERS simulated workers (one sim-worker, --token-interval-ms 0),"
    echo "loadgen ${LG[*]}"
    echo
    echo "<!-- docs -->"
    echo "| gateway | VmRSS before (MiB) | VmHWM before (MiB) | VmRSS after (MiB) | VmHWM after (MiB) | tree nodes | tree chars | tree evicted chars | ok/sent | client hit rate |"
    echo "|---|---|---|---|---|---|---|---|---|---|"
    printf '%s\n' "${ROWS[@]}"
    echo
    echo "Before: idle after a 1 s warm-up; after: 2 s after the replay's last answer. Tree gauges are"
    echo "radixgate's radixgate_tree_nodes / radixgate_tree_chars (characters summed over workers) /"
    echo "radixgate_tree_evicted_chars; sglang-router exports no tree size. The client hit rate is the"
    echo "workers' cached tokens over prompt tokens (their KV is far smaller than the trace's text)."
    echo "<!-- /docs -->"
} >"$OUT/report.md"
cat "$OUT/report.md"
log "report: $OUT/report.md"
if [[ "$WRITE_DOCS" == 1 ]]; then
    python3 scripts/bench-docs.py write "$DOCS_SECTION" "$OUT/report.md" --command "$COMMAND"
fi
