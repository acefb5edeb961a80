#!/usr/bin/env bash
# Compare routing policies on a simulated SGLang cluster.
#
# Starts N simulated workers (target/release/sim-worker), then for each policy starts the
# gateway in front of them, warms it up, flushes the workers' caches, scrapes every worker's
# /metrics, replays one workload with loadgen, scrapes again and stops the gateway. Policies:
# radixgate round_robin, random, power_of_two, cache_aware, cache_aware --insert-response-text,
# cache_aware --affinity-window, cache_aware --kv-events (routing on the workers' own KV-cache
# events: the workers then publish them, --kv-events-config on ephemeral ports, and the gateway
# gets --tokenizer-path when a tokenizer folder is available, see scripts/tokenizer-folder.sh),
# manual with X-SMG-Routing-Key (the sticky-session oracle), and sglang-router 0.3.2 (PyPI, in
# .venv/) with cache_aware on the same cluster and workload.
#
# Writes results/<timestamp>/report.md (hit rate from the workers' counters, TTFT p50/p99,
# throughput, per-worker load spread, acceptance checks) and chart.png (matplotlib in .venv/;
# skipped with a message when it cannot be installed). --write-docs also puts the run's short
# table (docs.md beside the report) into docs/benchmarks.md, section policies-WORKLOAD
# (policies-pd with --pd; --docs-section NAME for another), with the command and the machine.
#
# Time compression: the chat and mrqa workloads run think times and arrivals at --time-scale
# (loadgen) and the simulated GPUs 1/--time-scale faster (sim-worker --time-scale), so the whole
# system is a uniformly compressed replay; latencies in the report are real (compressed) ms.
# The simulated workers use the `approx` tokenizer (4 chars a token, like the generated text)
# unless --tokenizer bpe. KV capacity per worker (--kv-tokens) defaults to 400k tokens (an 8B
# model on an 80 GB GPU) for gsp/trace and to 100k for chat/mrqa, so live conversation history
# is about twice the cluster's KV and eviction matters, as in production (reference §4, P3).
# --api overrides the workload's API; `generate-ids` sends /generate with input_ids tokenized as
# the workers tokenize (loadgen --input-ids), so --kv-events measures prompts in tokens without a
# tokenizer in the gateway. Chat prompts without a tokenizer fall back to the text tree (the
# report counts radixgate_kv_fallback_total).
# Defaults keep a full run under ~10 minutes on 2 cores (gsp ~2 min, chat ~6 min).
#
# --engine vllm: the workers play vLLM servers instead (sim-worker --engine vllm: vLLM's routes,
# metrics and KV-event encoding), so the same comparison runs against a vLLM-shaped fleet. Their
# caches are emptied with /reset_prefix_cache; for +kv_events they publish with
# "enable_kv_cache_events": true and the gateway finds every publisher at the worker's own
# /kv_event_sources, as it does in front of real vLLM servers (no endpoint flags). The hit rate
# comes from vLLM's counters (vllm:prefix_cache_hits_total / vllm:prompt_tokens_total). Not with
# --pd (the simulated disaggregation is SGLang's).
#
# --pd: a prefill/decode disaggregated cluster instead. --prefill-workers N simulated prefill
# servers (sim-worker --disaggregation-mode prefill, each with its own bootstrap port) and
# --decode-workers M decode servers (--disaggregation-mode decode), default 4 + 2, same GPU speed
# and KV size. The policies are then the prefill side's (--prefill-policy; default list
# cache_aware,round_robin,sglang-router); the decode side uses --decode-policy (default
# round_robin) for every gateway, sglang-router 0.3.2 included (its --pd-disaggregation --prefill
# URL PORT --decode URL flags). The hit rate is the prefill servers' own counters (where the
# prompt is computed); requests per prefill and per decode server, TTFT and ok/sent come beside.
# A gateway whose warm-up fails is still measured in --pd mode (the reference's PD failures are
# reported with their error rate and log lines, not skipped). --workers does not apply with --pd.
#
# Usage: scripts/compare-policies.sh [--workload gsp|chat|mrqa|trace] [--workers N]
#          [--duration S] [--policies a,b,...] [--no-sglang-router] [--no-chart] [--skip-build]
#          [--time-scale X] [--rate R] [--tokenizer approx|bpe] [--kv-tokens N] [--out DIR]
#          [--api chat|completions|generate|generate-ids] [--tokenizer-path DIR] [--make-tokenizer CMD]
#          [--sim-args "..."] [--loadgen-args "..."] [--gateway-args "..."]
#          [--pd [--prefill-workers N] [--decode-workers M] [--decode-policy P]]
#          [--engine sglang|vllm]
#          [--write-docs [--docs-section NAME]]
# Policy names: round_robin random power_of_two cache_aware cache_aware+insert_response_text
#               cache_aware+affinity_window cache_aware+kv_events manual+session_header sglang-router
#               (--pd: round_robin random power_of_two cache_aware sglang-router)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
COMMAND="scripts/compare-policies.sh$(printf ' %q' "$@")"

WORKLOAD=chat
WORKERS=""
DURATION=""
POLICIES="round_robin,random,power_of_two,cache_aware,cache_aware+insert_response_text,cache_aware+affinity_window,cache_aware+kv_events,manual+session_header,sglang-router"
CHART=1
BUILD=1
TIME_SCALE=""
RATE=""
TOKENIZER=approx
KV_TOKENS=""
OUT=""
SIM_ARGS=""
LOADGEN_ARGS=""
GATEWAY_ARGS=""
API=""
TOKENIZER_PATH=""
MAKE_TOKENIZER=""
SGLANG_ROUTER_VERSION=0.3.2
PD=0
PREFILL_WORKERS=4
DECODE_WORKERS=2
DECODE_POLICY=round_robin
POLICIES_GIVEN=0
NO_SGLANG_ROUTER=0
WRITE_DOCS=0
DOCS_SECTION=""
ENGINE=sglang

usage() { sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --workload) WORKLOAD="$2"; shift 2 ;;
        --workers) WORKERS="$2"; shift 2 ;;
        --duration) DURATION="$2"; shift 2 ;;
        --policies) POLICIES="$2"; POLICIES_GIVEN=1; shift 2 ;;
        --no-sglang-router) NO_SGLANG_ROUTER=1; shift ;;
        --pd) PD=1; shift ;;
        --prefill-workers) PREFILL_WORKERS="$2"; shift 2 ;;
        --decode-workers) DECODE_WORKERS="$2"; shift 2 ;;
        --decode-policy) DECODE_POLICY="$2"; shift 2 ;;
        --no-chart) CHART=0; shift ;;
        --skip-build) BUILD=0; shift ;;
        --time-scale) TIME_SCALE="$2"; shift 2 ;;
        --rate) RATE="$2"; shift 2 ;;
        --tokenizer) TOKENIZER="$2"; shift 2 ;;
        --kv-tokens) KV_TOKENS="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --sim-args) SIM_ARGS="$2"; shift 2 ;;
        --loadgen-args) LOADGEN_ARGS="$2"; shift 2 ;;
        --gateway-args) GATEWAY_ARGS="$2"; shift 2 ;;
        --api) API="$2"; shift 2 ;;
        --tokenizer-path) TOKENIZER_PATH="$2"; shift 2 ;;
        --make-tokenizer) MAKE_TOKENIZER="$2"; shift 2 ;;
        --write-docs) WRITE_DOCS=1; shift ;;
        --docs-section) DOCS_SECTION="$2"; shift 2 ;;
        --engine) ENGINE="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown option: $1 (see --help)" >&2; exit 2 ;;
    esac
done

case "$ENGINE" in
    sglang|vllm) ;;
    *) echo "--engine: sglang or vllm" >&2; exit 2 ;;
esac
if [[ "$ENGINE" == vllm && "$PD" == 1 ]]; then
    echo "--pd runs SGLang-shaped prefill/decode servers only (not with --engine vllm)" >&2; exit 2
fi
if [[ "$PD" == 1 ]]; then
    [[ -z "$WORKERS" ]] || { echo "--workers does not apply with --pd (use --prefill-workers/--decode-workers)" >&2; exit 2; }
    [[ "$PREFILL_WORKERS" =~ ^[1-9][0-9]*$ && "$DECODE_WORKERS" =~ ^[1-9][0-9]*$ ]] \
        || { echo "--prefill-workers and --decode-workers take positive integers" >&2; exit 2; }
    case "$DECODE_POLICY" in
        round_robin|random|power_of_two|cache_aware) ;;
        *) echo "--decode-policy: round_robin, random, power_of_two or cache_aware" >&2; exit 2 ;;
    esac
    [[ "$POLICIES_GIVEN" == 1 ]] || POLICIES="cache_aware,round_robin,sglang-router"
    for p in ${POLICIES//,/ }; do
        case "$p" in
            round_robin|random|power_of_two|cache_aware|sglang-router) ;;
            *) echo "policy $p is not a --pd prefill policy (round_robin random power_of_two cache_aware sglang-router)" >&2; exit 2 ;;
        esac
    done
    # The prefill servers are the ones whose counters measure the hit rate: they are "the workers"
    # below (URLS, scrape, per-worker spread); the decode servers come beside them.
    WORKERS="$PREFILL_WORKERS"
fi
if [[ "$NO_SGLANG_ROUTER" == 1 ]]; then
    POLICIES="$(tr ',' '\n' <<<"$POLICIES" | grep -v '^sglang-router$' | paste -sd, -)"
fi

# ---- per-workload defaults -------------------------------------------------------------------
# LG: loadgen workload flags. SIM_TS: simulated GPU speed-up (1 / loadgen time scale).
case "$WORKLOAD" in
    gsp)
        # SGLang generated-shared-prefix, v0.4 router blog setup: 64 groups x 16 prompts, burst,
        # 8 workers; real-time GPU (the burst itself is the point).
        WORKERS="${WORKERS:-8}"; DURATION="${DURATION:-60}"; TIME_SCALE="${TIME_SCALE:-1}"; KV_TOKENS="${KV_TOKENS:-400000}"
        LG=(--workload gsp --api generate --arrival schedule)
        ;;
    chat)
        # Reference generator spec, think times x0.05 (median 6 s), 0.5 sessions/s unscaled.
        WORKERS="${WORKERS:-4}"; DURATION="${DURATION:-40}"; TIME_SCALE="${TIME_SCALE:-0.05}"; KV_TOKENS="${KV_TOKENS:-100000}"
        LG=(--workload chat --api chat --rate "${RATE:-0.5}")
        ;;
    mrqa)
        WORKERS="${WORKERS:-4}"; DURATION="${DURATION:-40}"; TIME_SCALE="${TIME_SCALE:-0.1}"; KV_TOKENS="${KV_TOKENS:-100000}"
        LG=(--workload mrqa --api chat --rate "${RATE:-2}")
        ;;
    trace)
        # Mooncake synthetic trace (heavy prefix reuse), first 600 requests, timestamps x0.2.
        WORKERS="${WORKERS:-4}"; DURATION="${DURATION:-40}"; TIME_SCALE="${TIME_SCALE:-0.2}"; KV_TOKENS="${KV_TOKENS:-400000}"
        LG=(--workload trace --api completions --trace synthetic --num-requests 600)
        ;;
    *) echo "unknown workload: $WORKLOAD" >&2; exit 2 ;;
esac
if [[ -n "$API" ]]; then
    keep=()
    skip=0
    for a in "${LG[@]}"; do
        if [[ "$skip" == 1 ]]; then skip=0; continue; fi
        if [[ "$a" == --api ]]; then skip=1; continue; fi
        keep+=("$a")
    done
    case "$API" in
        chat|completions|generate) LG=("${keep[@]}" --api "$API") ;;
        generate-ids) LG=("${keep[@]}" --api generate --input-ids "$TOKENIZER") ;;
        *) echo "unknown api: $API" >&2; exit 2 ;;
    esac
fi
if [[ "$ENGINE" == vllm ]]; then
    # vLLM has no /generate: its workloads go to /v1/completions instead.
    [[ " ${LG[*]} " == *" --input-ids "* ]] \
        && { echo "--api generate-ids sends SGLang's /generate (not with --engine vllm)" >&2; exit 2; }
    for j in "${!LG[@]}"; do
        if [[ "${LG[$j]}" == generate && "${LG[$((j - 1))]}" == --api ]]; then LG[j]=completions; fi
    done
fi
SIM_TS="$(python3 -c "print(f'{1.0 / float($TIME_SCALE):g}')")"
DRAIN=60

STAMP="$(date +%Y%m%d-%H%M%S)"
OUT="${OUT:-results/$STAMP-$WORKLOAD}"
mkdir -p "$OUT/runs"
LOGS="$OUT/logs"
mkdir -p "$LOGS"

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
forget_pid() {
    local keep=() p
    for p in "${PIDS[@]}"; do [[ "$p" == "$1" ]] || keep+=("$p"); done
    PIDS=("${keep[@]}")
}

# Run a command in the background and wait for it: `wait` returns as soon as a trapped signal
# arrives (a foreground command would delay the trap until it exits), and the PID is on the
# cleanup list meanwhile. Returns the command's exit status.
run_fg() {
    local pid rc=0
    "$@" &
    pid=$!
    PIDS+=("$pid")
    wait "$pid" || rc=$?
    forget_pid "$pid"
    return "$rc"
}

log() { printf '[compare %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# A contiguous block of free loopback ports: compare-policies.sh needs N workers + 4.
free_ports() {
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

# Wait until URL answers 200, or fail after $2 seconds (or when process $3 dies).
wait_http() {
    local url="$1" secs="$2" pid="${3:-}" i
    for i in $(seq 1 $((secs * 10))); do
        if [[ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$url" || true)" == "200" ]]; then return 0; fi
        if [[ -n "$pid" ]] && ! kill -0 "$pid" 2>/dev/null; then return 1; fi
        sleep 0.1
    done
    return 1
}

# ---- build -----------------------------------------------------------------------------------
if [[ "$BUILD" == 1 ]]; then
    log "building release (cargo build --release -p radixgate -p loadtest)"
    cargo build --release -p radixgate -p loadtest >"$LOGS/build.log" 2>&1 || { tail -30 "$LOGS/build.log" >&2; exit 1; }
fi
for bin in radixgate sim-worker loadgen; do
    [[ -x "target/release/$bin" ]] || { echo "missing target/release/$bin (build failed?)" >&2; exit 1; }
done
LOADGEN="target/release/loadgen"

# ---- Python venv: chart and sglang-router --------------------------------------------------------
PY=python3
need_router=0
[[ ",$POLICIES," == *",sglang-router,"* ]] && need_router=1
if [[ "$CHART" == 1 || "$need_router" == 1 ]]; then
    if [[ ! -x .venv/bin/python ]]; then
        log "creating .venv/"
        python3 -m venv .venv >"$LOGS/venv.log" 2>&1 || log "could not create .venv (see $LOGS/venv.log)"
    fi
    if [[ -x .venv/bin/python ]]; then
        PY=.venv/bin/python
        if [[ "$CHART" == 1 ]] && ! .venv/bin/python -c 'import matplotlib' 2>/dev/null; then
            log "installing matplotlib into .venv/"
            .venv/bin/pip install -q matplotlib >>"$LOGS/venv.log" 2>&1 || log "matplotlib unavailable: the chart will be skipped"
        fi
        if [[ "$need_router" == 1 ]] && ! .venv/bin/python -c 'import sglang_router' 2>/dev/null; then
            log "installing sglang-router==$SGLANG_ROUTER_VERSION into .venv/"
            .venv/bin/pip install -q "sglang-router==$SGLANG_ROUTER_VERSION" >>"$LOGS/venv.log" 2>&1 \
                || log "sglang-router unavailable: that run will be reported as failed"
        fi
    fi
fi

# ---- cluster ---------------------------------------------------------------------------------
# --pd: the block goes on with the decode servers' ports, then the prefill servers' bootstrap ports.
if [[ "$PD" == 1 ]]; then
    BASE="$(free_ports $((WORKERS + 4 + DECODE_WORKERS + WORKERS)))"
else
    BASE="$(free_ports $((WORKERS + 4)))"
fi
LAST=$((BASE + WORKERS - 1))
GW_PORT=$((BASE + WORKERS))
GW_METRICS_PORT=$((BASE + WORKERS + 1))
URLS=()
for ((i = 0; i < WORKERS; i++)); do URLS+=("http://127.0.0.1:$((BASE + i))"); done
DECODE_URLS=()
BOOT_PORTS=()
if [[ "$PD" == 1 ]]; then
    DEC_BASE=$((BASE + WORKERS + 4))
    DEC_LAST=$((DEC_BASE + DECODE_WORKERS - 1))
    BOOT_BASE=$((DEC_BASE + DECODE_WORKERS))
    for ((i = 0; i < DECODE_WORKERS; i++)); do DECODE_URLS+=("http://127.0.0.1:$((DEC_BASE + i))"); done
    for ((i = 0; i < WORKERS; i++)); do BOOT_PORTS+=($((BOOT_BASE + i))); done
fi

# Event mode: the workers publish KV events (every policy of the run then runs against publishing
# workers, so all see the same cluster), and the gateway gets a tokenizer folder when one exists
# (the workers then tokenize with the same folder, so both count the same tokens).
KV_SIM=()
SIM_TOK=(--tokenizer "$TOKENIZER")
SIM_TOK_DESC="$TOKENIZER"
KV_TOK_NOTE=""
if [[ ",$POLICIES," == *"+kv_events,"* ]]; then
    if [[ "$ENGINE" == vllm ]]; then
        KV_SIM=(--kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:*","replay_endpoint":"tcp://127.0.0.1:*"}')
    else
        KV_SIM=(--kv-events-config '{"publisher":"zmq","endpoint":"tcp://127.0.0.1:*","replay_endpoint":"tcp://127.0.0.1:*"}')
    fi
    if [[ " ${LG[*]} " == *" --input-ids "* ]]; then
        TOKENIZER_PATH=""; KV_TOK_NOTE="not needed (/generate input_ids)"
    else
        given=()
        [[ -n "$TOKENIZER_PATH" ]] && given=(--given "$TOKENIZER_PATH")
        if TOKENIZER_PATH="$(scripts/tokenizer-folder.sh "$OUT/tokenizer" "${given[@]}" --make "$MAKE_TOKENIZER" 2>"$LOGS/tokenizer.log")"; then
            if target/release/sim-worker --help 2>&1 | grep -q -- '--tokenizer-path'; then
                SIM_TOK=(--tokenizer-path "$TOKENIZER_PATH"); SIM_TOK_DESC="--tokenizer-path $TOKENIZER_PATH"
            else
                SIM_TOK=(--tokenizer bpe); SIM_TOK_DESC="bpe"
            fi
            KV_TOK_NOTE="$TOKENIZER_PATH"
        else
            TOKENIZER_PATH=""
            KV_TOK_NOTE="none ($(tr '\n' ' ' <"$LOGS/tokenizer.log")): chat prompts fall back to the text tree"
        fi
    fi
    log "cache_aware+kv_events: workers publish KV events; gateway tokenizer: $KV_TOK_NOTE"
fi

SIM_PIDS=()
start_sims() { # start_sims LOGNAME FIRST_PORT LAST_PORT [sim-worker flags...]: one sim-worker process
    local logf="$LOGS/$1.log" first="$2" last="$3" pid p
    shift 3
    # shellcheck disable=SC2086
    target/release/sim-worker --engine "$ENGINE" --ports "$first-$last" --time-scale "$SIM_TS" "${SIM_TOK[@]}" \
        --max-total-tokens "$KV_TOKENS" "$@" $SIM_ARGS >"$logf" 2>&1 &
    pid=$!
    PIDS+=("$pid")
    SIM_PIDS+=("$pid")
    for ((p = first; p <= last; p++)); do
        wait_http "http://127.0.0.1:$p/health" 30 "$pid" || { echo "sim-worker did not come up; log:" >&2; tail -20 "$logf" >&2; exit 1; }
    done
}
if [[ "$PD" == 1 ]]; then
    log "starting $WORKERS simulated prefill servers on ports $BASE-$LAST (bootstrap ports ${BOOT_PORTS[0]}-${BOOT_PORTS[-1]}) and $DECODE_WORKERS decode servers on $DEC_BASE-$DEC_LAST (GPU time x$SIM_TS, tokenizer $SIM_TOK_DESC, KV $KV_TOKENS tokens each)"
    start_sims sim-worker-prefill "$BASE" "$LAST" --disaggregation-mode prefill --disaggregation-bootstrap-port "$BOOT_BASE"
    start_sims sim-worker-decode "$DEC_BASE" "$DEC_LAST" --disaggregation-mode decode
else
    log "starting $WORKERS simulated $ENGINE workers on ports $BASE-$LAST (GPU time x$SIM_TS, tokenizer $SIM_TOK_DESC, KV $KV_TOKENS tokens each)"
    start_sims sim-worker "$BASE" "$LAST" "${KV_SIM[@]}"
fi

M_TOK="$SIM_TOK_DESC" M_KV_TOK="$KV_TOK_NOTE" python3 - "$OUT/meta.json" <<PY
import json, os, sys
json.dump({"workload": "$WORKLOAD", "workers": $WORKERS, "duration_s": $DURATION,
           "loadgen_time_scale": $TIME_SCALE, "sim_time_scale": $SIM_TS, "tokenizer": os.environ["M_TOK"],
           **({"kv_events_gateway_tokenizer": os.environ["M_KV_TOK"]} if os.environ["M_KV_TOK"] else {}),
           "kv_tokens_per_worker": $KV_TOKENS, "engine": "$ENGINE",
           "loadgen": "${LG[*]} $LOADGEN_ARGS".strip(), "sim_args": "$SIM_ARGS",
           **({"pd": True, "prefill_workers": $WORKERS, "decode_workers": $DECODE_WORKERS,
               "decode_policy": "$DECODE_POLICY"} if $PD else {})}, open(sys.argv[1], "w"), indent=1)
PY

flush_workers() {
    local u
    for u in "${URLS[@]}" "${DECODE_URLS[@]}"; do
        for _ in $(seq 1 50); do
            if [[ "$ENGINE" == vllm ]]; then
                # vLLM answers 200 either way; the body says whether the cache was emptied.
                [[ "$(curl -s --max-time 5 -X POST "$u/reset_prefix_cache" | jq -r '.success' 2>/dev/null || true)" == "true" ]] && break
            else
                [[ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 -X POST "$u/flush_cache" || true)" == "200" ]] && break
            fi
            sleep 0.2
        done
    done
}

scrape() { # scrape DIR PREFIX
    local i
    for ((i = 0; i < WORKERS; i++)); do
        curl -s --max-time 10 "${URLS[$i]}/metrics" >"$1/$2-$i.prom" || true
    done
    for ((i = 0; i < ${#DECODE_URLS[@]}; i++)); do
        curl -s --max-time 10 "${DECODE_URLS[$i]}/metrics" >"$1/decode-$2-$i.prom" || true
    done
}

# The gateway's worker flags: --worker-urls, or in --pd mode the prefill servers (URL and
# bootstrap port), the decode servers and both sides' policies (the same flags for radixgate and
# sglang-router). Sets GW_WORKER_ARGS.
gateway_worker_args() { # gateway_worker_args POLICY
    local i
    if [[ "$PD" == 1 ]]; then
        GW_WORKER_ARGS=(--pd-disaggregation)
        for ((i = 0; i < WORKERS; i++)); do GW_WORKER_ARGS+=(--prefill "${URLS[$i]}" "${BOOT_PORTS[$i]}"); done
        for i in "${DECODE_URLS[@]}"; do GW_WORKER_ARGS+=(--decode "$i"); done
        GW_WORKER_ARGS+=(--prefill-policy "$1" --decode-policy "$DECODE_POLICY")
    else
        GW_WORKER_ARGS=(--worker-urls "${URLS[@]}" --policy "$1")
    fi
}

# --pd: the same ~4k-character prompt sent PROBE_REPEATS times, one after another, before the
# caches are flushed; the prefill servers' request counters around it (probe-before-/probe-after-)
# show whether the prefill policy keeps an exact repeat on one server (prefix affinity at its
# plainest, with no load to balance).
PROBE_REPEATS=12
affinity_probe() { # affinity_probe DIR
    local body n
    body="$(python3 -c 'import json; print(json.dumps({"model": "m", "max_tokens": 4,
        "prompt": "affinity probe: " + "the quick brown fox jumps over the lazy dog " * 100}))')"
    scrape "$1" probe-before
    for ((n = 0; n < PROBE_REPEATS; n++)); do
        curl -s -o /dev/null --max-time 20 -H 'content-type: application/json' -d "$body" \
            "http://127.0.0.1:$GW_PORT/v1/completions" || true
    done
    scrape "$1" probe-after
}

# ---- one policy ------------------------------------------------------------------------------
run_policy() { # run_policy INDEX LABEL
    local idx="$1" label="$2"
    local slug dir gateway policy header=() extra=() gw_pid status=ok w note=""
    slug="$(printf '%02d-%s' "$idx" "$(tr -c 'a-zA-Z0-9_\n-' '_' <<<"$label")")"
    dir="$OUT/runs/$slug"
    mkdir -p "$dir"
    gateway=radixgate
    case "$label" in
        round_robin|random|power_of_two|cache_aware) policy="$label" ;;
        cache_aware+insert_response_text) policy=cache_aware; extra=(--insert-response-text) ;;
        cache_aware+affinity_window) policy=cache_aware; extra=(--affinity-window) ;;
        cache_aware+kv_events)
            policy=cache_aware; extra=(--kv-events)
            [[ -n "$TOKENIZER_PATH" ]] && extra+=(--tokenizer-path "$TOKENIZER_PATH") ;;
        manual+session_header) policy=manual; header=(--session-header) ;;
        sglang-router) policy=cache_aware; gateway=sglang-router; label="sglang-router cache_aware" ;;
        *) echo "unknown policy: $label" >&2; return 1 ;;
    esac
    gateway_worker_args "$policy"
    if [[ "$PD" == 1 ]]; then
        log "[$label] starting $gateway --pd-disaggregation --prefill-policy $policy --decode-policy $DECODE_POLICY"
    else
        log "[$label] starting $gateway --policy $policy ${extra[*]:-}"
    fi
    if [[ "$gateway" == radixgate ]]; then
        # shellcheck disable=SC2086
        target/release/radixgate "${GW_WORKER_ARGS[@]}" "${extra[@]}" \
            --host 127.0.0.1 --port "$GW_PORT" --prometheus-host 127.0.0.1 --prometheus-port "$GW_METRICS_PORT" \
            $GATEWAY_ARGS >"$dir/gateway.log" 2>&1 &
    else
        if [[ -x .venv/bin/python ]] && .venv/bin/python -c 'import sglang_router' 2>/dev/null; then
            .venv/bin/python -m sglang_router.launch_router "${GW_WORKER_ARGS[@]}" \
                --host 127.0.0.1 --port "$GW_PORT" --prometheus-host 127.0.0.1 --prometheus-port "$GW_METRICS_PORT" \
                --log-level warn >"$dir/gateway.log" 2>&1 &
        else
            status="sglang-router not installed"
        fi
    fi
    if [[ "$status" == ok ]]; then
        gw_pid=$!
        PIDS+=("$gw_pid")
        if ! wait_http "http://127.0.0.1:$GW_PORT/readiness" 60 "$gw_pid" && ! wait_http "http://127.0.0.1:$GW_PORT/health" 5 "$gw_pid"; then
            status="gateway did not become ready"
        fi
    fi
    if [[ "$status" == ok ]]; then
        # Warm-up: tiny requests until all succeed (connection pools, health state), then a
        # clean slate on every worker.
        local ok_warm=0 tries=20
        [[ "$PD" == 1 ]] && tries=5
        for _ in $(seq 1 "$tries"); do
            if run_fg "$LOADGEN" --target "http://127.0.0.1:$GW_PORT" --workload rate --rate 20 --duration 1 --drain 5 \
                --quiet --json "$dir/warmup.json" >/dev/null 2>>"$dir/warmup.log" \
                && [[ "$(jq -r '.failed' "$dir/warmup.json")" == 0 ]]; then ok_warm=1; break; fi
            sleep 0.5
        done
        if [[ "$ok_warm" != 1 ]]; then
            if [[ "$PD" == 1 ]]; then
                # Measure it anyway: a gateway that cannot pair PD requests is a result, reported
                # with its error rate and what it printed.
                note="warm-up never ran clean (last try: $(jq -r '"\(.failed) of \(.sent) failed"' "$dir/warmup.json" 2>/dev/null || echo "no report"))"
                log "[$label] $note; measuring anyway"
            else
                status="warm-up failed"
            fi
        fi
    fi
    if [[ "$status" == ok ]]; then
        [[ "$PD" == 1 ]] && affinity_probe "$dir"
        flush_workers
        if [[ " ${extra[*]:-} " == *" --kv-events "* ]]; then
            # Every worker's events complete (subscribed, replayed) before the clock starts.
            for _ in $(seq 1 300); do
                w="$(curl -s --max-time 5 "http://127.0.0.1:$GW_METRICS_PORT/metrics" | awk '$1 == "radixgate_kv_warm_workers" { print int($2) }' || true)"
                [[ -n "$w" && "$w" -ge "$WORKERS" ]] && break
                sleep 0.1
            done
            sleep 0.5
        fi
        scrape "$dir" before
        curl -s --max-time 10 "http://127.0.0.1:$GW_METRICS_PORT/metrics" >"$dir/gateway-before.prom" || true
        log "[$label] running $WORKLOAD for ${DURATION}s"
        # shellcheck disable=SC2086
        run_fg "$LOADGEN" --target "http://127.0.0.1:$GW_PORT" "${LG[@]}" "${header[@]}" --time-scale "$TIME_SCALE" \
            --duration "$DURATION" --drain "$DRAIN" --quiet --json "$dir/loadgen.json" --markdown "$dir/loadgen.md" \
            $LOADGEN_ARGS 2>"$dir/loadgen.log" || status="loadgen failed (see loadgen.log)"
        scrape "$dir" after
        curl -s --max-time 10 "http://127.0.0.1:$GW_METRICS_PORT/metrics" >"$dir/gateway-after.prom" || true
    fi
    if [[ -n "${gw_pid:-}" ]]; then stop_pid "$gw_pid"; forget_pid "$gw_pid"; fi
    python3 - "$dir/run.json" "$label" "$gateway" "$status" "$note" <<'PY'
import json, sys
run = {"label": sys.argv[2], "gateway": sys.argv[3], "status": sys.argv[4]}
if sys.argv[5]:
    run["note"] = sys.argv[5]
json.dump(run, open(sys.argv[1], "w"))
PY
    if [[ "$status" == ok ]]; then
        log "[$label] done: $(jq -r '"ok \(.ok)/\(.sent), client hit \((.hit_rate // 0) * 100 | floor) %, TTFT p99 \(.ttft.p99_ms | floor) ms"' "$dir/loadgen.json")"
    else
        log "[$label] FAILED: $status"
    fi
}

IFS=',' read -r -a POLICY_LIST <<<"$POLICIES"
i=0
for p in "${POLICY_LIST[@]}"; do
    i=$((i + 1))
    run_policy "$i" "$p"
done

for pid in "${SIM_PIDS[@]}"; do
    stop_pid "$pid"
    forget_pid "$pid"
done

REPORT_PY="$PY"
[[ "$CHART" == 1 ]] || REPORT_PY=python3
if [[ "$CHART" == 0 ]]; then export RADIXGATE_NO_CHART=1; fi
"$REPORT_PY" scripts/report.py "$OUT"
log "report: $OUT/report.md"
if [[ "$WRITE_DOCS" == 1 ]]; then
    [[ "$PD" == 1 ]] && section=policies-pd || section="policies-$WORKLOAD"
    python3 scripts/bench-docs.py write "${DOCS_SECTION:-$section}" "$OUT/docs.md" --command "$COMMAND"
fi
