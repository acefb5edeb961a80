#!/usr/bin/env bash
# Several radixgate copies behind a round-robin load balancer, measured on the servers.
#
# Starts simulated SGLang workers that publish KV-cache events (sim-worker --kv-events-config,
# one ZeroMQ publisher and replay socket per worker on ephemeral ports, found by the gateway via
# /get_server_info), then for each mode (text: the text tree; events: --kv-events) and each
# fleet size (1 copy, N copies) starts the copies (cache_aware, each pinned to one CPU with
# --cpu-list, its own --port and --prometheus-port), a front load balancer doing round robin over
# them (nginx with configs/nginx-front.conf, or haproxy with configs/haproxy-front.cfg, health
# checks on /readiness; installed with apt-get when missing, run as the current user with pid,
# logs and temp files under the run directory), warms up, flushes the workers' caches, replays
# compare-policies' chat workload through the front with loadgen, and reads the hit rate from
# the workers' own counters (Δ sglang:cached_tokens_total / Δ sglang:prompt_tokens_total).
#
# New copy mid-run: one more event-mode run with N copies; a third of the way into the replay a
# few probe conversations run two turns through the front (scripts/gateway-probe.py), then one
# more copy starts — replay of the publishers' buffers only, and, when radixgate has
# --kv-bootstrap-peer, a second one bootstrapped from copy 0 — and the next turn of each is sent
# straight to it as soon as it answers /readiness; once it reports every worker warm, fresh
# probe conversations check it again. Which worker answered (x-worker-port) and the server's
# cached tokens show whether it routes right from its first turns. The probes' own tokens are
# subtracted from that run's hit rate.
#
# Prompts in tokens: chat prompts need a tokenizer in the gateway (--tokenizer-path). The folder
# comes from scripts/tokenizer-folder.sh: --tokenizer-path DIR if given, else one written by
# --make-tokenizer CMD (`{}` = the folder) or by the build's own writer (sim-worker
# --write-tokenizer); the workers then tokenize with the same folder. Without one, event mode on chat traffic falls back to the text tree
# (radixgate_kv_fallback_total{reason="no_tokenizer"}, shown in the report).
# --api generate-ids replays the same conversations as /generate with input_ids (tokenized as
# the workers tokenize), which event mode measures in tokens with no tokenizer at all.
#
# Writes results/<timestamp>-multi-gateway/multi-gateway.md (the table, acceptance lines, the
# probe tables and the exact command) and docs.md (the short table and acceptance lines;
# --write-docs puts them into docs/benchmarks.md, section multi-gateway, or --docs-section NAME).
# Every process started here is stopped by its PID on exit,
# failure or Ctrl-C; only 127.0.0.1 is used.
#
# Usage: scripts/multi-gateway.sh N [--mode text|events|both] [--front nginx|haproxy]
#          [--duration S] [--workers W] [--kv-tokens T] [--time-scale X] [--rate R]
#          [--api chat|generate-ids] [--tokenizer approx|bpe] [--tokenizer-path DIR]
#          [--make-tokenizer CMD] [--no-new-copy] [--probes K] [--skip-build] [--out DIR]
#          [--sim-args "..."] [--loadgen-args "..."] [--gateway-args "..."]
#          [--write-docs [--docs-section NAME]]
# Defaults: --mode both, --front nginx, compare-policies' chat workload (4 workers, 100k KV tokens
# each so the servers evict, 40 s at --time-scale 0.05, 0.5 sessions/s unscaled, approx tokenizer).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
COMMAND="scripts/multi-gateway.sh$(printf ' %q' "$@")"

usage() { sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; }

[[ $# -ge 1 && "$1" != -* ]] || { usage >&2; exit 2; }
[[ "$1" =~ ^[0-9]+$ && "$1" -ge 1 && "$1" -le 16 ]] || { echo "N must be 1..16, got $1" >&2; exit 2; }
COPIES="$1"
shift

MODE=both
FRONT=nginx
DURATION=40
WORKERS=4
KV_TOKENS=100000
TIME_SCALE=0.05
RATE=0.5
API=chat
TOKENIZER=approx
TOKENIZER_PATH=""
MAKE_TOKENIZER=""
NEW_COPY=1
PROBES=4
BUILD=1
OUT=""
SIM_ARGS=""
LOADGEN_ARGS=""
GATEWAY_ARGS=""
DRAIN=60
WRITE_DOCS=0
DOCS_SECTION=multi-gateway

while [[ $# -gt 0 ]]; do
    case "$1" in
        --mode) MODE="$2"; shift 2 ;;
        --front) FRONT="$2"; shift 2 ;;
        --duration) DURATION="$2"; shift 2 ;;
        --workers) WORKERS="$2"; shift 2 ;;
        --kv-tokens) KV_TOKENS="$2"; shift 2 ;;
        --time-scale) TIME_SCALE="$2"; shift 2 ;;
        --rate) RATE="$2"; shift 2 ;;
        --api) API="$2"; shift 2 ;;
        --tokenizer) TOKENIZER="$2"; shift 2 ;;
        --tokenizer-path) TOKENIZER_PATH="$2"; shift 2 ;;
        --make-tokenizer) MAKE_TOKENIZER="$2"; shift 2 ;;
        --no-new-copy) NEW_COPY=0; shift ;;
        --probes) PROBES="$2"; shift 2 ;;
        --skip-build) BUILD=0; shift ;;
        --out) OUT="$2"; shift 2 ;;
        --sim-args) SIM_ARGS="$2"; shift 2 ;;
        --loadgen-args) LOADGEN_ARGS="$2"; shift 2 ;;
        --gateway-args) GATEWAY_ARGS="$2"; shift 2 ;;
        --write-docs) WRITE_DOCS=1; shift ;;
        --docs-section) DOCS_SECTION="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown option: $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$MODE" in text) MODES=(text) ;; events) MODES=(events) ;; both) MODES=(text events) ;;
    *) echo "--mode text|events|both, not $MODE" >&2; exit 2 ;; esac
case "$FRONT" in nginx|haproxy) ;; *) echo "--front nginx|haproxy, not $FRONT" >&2; exit 2 ;; esac
case "$API" in chat|generate-ids) ;; *) echo "--api chat|generate-ids, not $API" >&2; exit 2 ;; esac
case "$TOKENIZER" in approx|bpe) ;; *) echo "--tokenizer approx|bpe, not $TOKENIZER" >&2; exit 2 ;; esac
[[ "$PROBES" =~ ^[1-9][0-9]*$ ]] || { echo "--probes must be >= 1" >&2; exit 2; }

STAMP="$(date +%Y%m%d-%H%M%S)"
OUT="${OUT:-results/$STAMP-multi-gateway}"
mkdir -p "$OUT/runs" "$OUT/logs"
OUT="$(cd "$OUT" && pwd)"
LOGS="$OUT/logs"

log() { printf '[multi %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# ---- process bookkeeping: stop only what we started, by PID ----------------------------------
PIDS=()
stop_pid() {
    local pid="$1"
    kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null || true; return 0; }
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do
        kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null || true; return 0; }
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}
forget_pid() {
    local keep=() p
    for p in "${PIDS[@]}"; do [[ "$p" == "$1" ]] || keep+=("$p"); done
    PIDS=("${keep[@]}")
}
stop_and_forget() { stop_pid "$1"; forget_pid "$1"; }
cleanup() {
    local rc=$? pid
    trap - EXIT INT TERM
    for pid in "${PIDS[@]}"; do stop_pid "$pid"; done
    exit "$rc"
}
trap cleanup EXIT
trap 'echo; echo "interrupted" >&2; exit 130' INT TERM

# Wait until URL answers 200, or fail after $2 seconds (or as soon as process $3 dies).
wait_http() {
    local url="$1" secs="$2" pid="${3:-}"
    for _ in $(seq 1 $((secs * 10))); do
        [[ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$url" || true)" == 200 ]] && return 0
        if [[ -n "$pid" ]] && ! kill -0 "$pid" 2>/dev/null; then return 1; fi
        sleep 0.1
    done
    return 1
}

# A contiguous block of $1 free loopback ports; prints the first.
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

# ---- binaries and front --------------------------------------------------------------------------
if [[ "$BUILD" == 1 ]]; then
    log "building release (cargo build --release -p radixgate -p loadtest)"
    command -v c++ >/dev/null 2>&1 || { apt-get update -q && apt-get install -y -q g++; } >"$LOGS/apt.log" 2>&1
    cargo build --release -p radixgate -p loadtest >"$LOGS/build.log" 2>&1 || { tail -30 "$LOGS/build.log" >&2; exit 1; }
fi
for bin in radixgate sim-worker loadgen; do
    [[ -x "target/release/$bin" ]] || { echo "missing target/release/$bin (build it, or drop --skip-build)" >&2; exit 1; }
done
GW_BIN="$ROOT/target/release/radixgate"
SIM_BIN="$ROOT/target/release/sim-worker"
LOADGEN="$ROOT/target/release/loadgen"
FRONT_BIN="$(command -v "$FRONT" || true)"
[[ -n "$FRONT_BIN" ]] || FRONT_BIN="$(ls "/usr/sbin/$FRONT" 2>/dev/null || true)"
if [[ -z "$FRONT_BIN" ]]; then
    log "installing $FRONT (apt-get; the system service is not used)"
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$FRONT"; } >>"$LOGS/apt.log" 2>&1 \
        || { echo "could not install $FRONT (see $LOGS/apt.log)" >&2; exit 1; }
    FRONT_BIN="$(command -v "$FRONT" || echo "/usr/sbin/$FRONT")"
fi

# ---- what the build can do (read from --help, so the script also runs against older builds, e.g.
# a before/after comparison; the current build has both) -------------------------------------
GW_HELP="$("$GW_BIN" --help 2>&1 || true)"
SIM_HELP="$("$SIM_BIN" --help 2>&1 || true)"
HAS_BOOTSTRAP=0; grep -q -- '--kv-bootstrap-peer' <<<"$GW_HELP" && HAS_BOOTSTRAP=1
SIM_TOKPATH=0; grep -q -- '--tokenizer-path' <<<"$SIM_HELP" && SIM_TOKPATH=1
TOK_NOTE=""
if [[ "$API" == generate-ids ]]; then
    TOKENIZER_PATH=""; TOK_NOTE="not needed: /generate input_ids"
else
    given=()
    [[ -n "$TOKENIZER_PATH" ]] && given=(--given "$TOKENIZER_PATH")
    if TOKENIZER_PATH="$(scripts/tokenizer-folder.sh "$OUT/tokenizer" "${given[@]}" --make "$MAKE_TOKENIZER" 2>"$LOGS/tokenizer.log")"; then
        TOK_NOTE="$(tr '\n' ' ' <"$LOGS/tokenizer.log")"
        [[ -n "$TOK_NOTE" ]] || TOK_NOTE="given with --tokenizer-path"
    else
        TOKENIZER_PATH=""
        TOK_NOTE="none: $(tr '\n' ' ' <"$LOGS/tokenizer.log")— event mode on chat falls back to the text tree"
    fi
fi

# Workers' tokenizer and the loadgen API flags.
if [[ -n "$TOKENIZER_PATH" && "$SIM_TOKPATH" == 1 ]]; then
    SIM_TOK=(--tokenizer-path "$TOKENIZER_PATH"); SIM_TOK_DESC="--tokenizer-path $TOKENIZER_PATH"
elif [[ -n "$TOKENIZER_PATH" ]]; then
    SIM_TOK=(--tokenizer bpe); SIM_TOK_DESC="bpe (cl100k, as the given tokenizer folder is assumed to be)"
else
    SIM_TOK=(--tokenizer "$TOKENIZER"); SIM_TOK_DESC="$TOKENIZER"
fi
case "$API" in
    chat) LG_API=(--api chat) ;;
    generate-ids) LG_API=(--api generate --input-ids "$TOKENIZER") ;;
esac
LG=(--workload chat "${LG_API[@]}" --rate "$RATE")
SIM_TS="$(python3 -c "print(f'{1.0 / float($TIME_SCALE):g}')")"
NCPU="$(nproc)"

# ---- ports: workers, copies 0..N-1 plus two late copies, their metrics, the front -------------
SLOTS=$((COPIES + 2))
BASE="$(free_ports $((WORKERS + 2 * SLOTS + 1)))"
LAST=$((BASE + WORKERS - 1))
gw_port() { echo $((BASE + WORKERS + $1)); }
gw_mport() { echo $((BASE + WORKERS + SLOTS + $1)); }
FRONT_PORT=$((BASE + WORKERS + 2 * SLOTS))
FRONT_URL="http://127.0.0.1:$FRONT_PORT"
URLS=()
for ((i = 0; i < WORKERS; i++)); do URLS+=("http://127.0.0.1:$((BASE + i))"); done

COMMIT="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo +dirty)"
M_COMMAND="$COMMAND" M_LOADGEN="${LG[*]} $LOADGEN_ARGS" M_SIM_TOK="$SIM_TOK_DESC" M_GW_TOK="${TOKENIZER_PATH:-none}" \
M_TOK_NOTE="$TOK_NOTE" M_SIM_ARGS="$SIM_ARGS" M_GW_ARGS="$GATEWAY_ARGS" M_COMMIT="$COMMIT" M_MODES="${MODES[*]}" \
python3 - "$OUT/meta.json" <<PY
import json, os, sys
e = os.environ
json.dump({"command": e["M_COMMAND"], "copies": $COPIES, "front": "$FRONT", "modes": e["M_MODES"],
           "workers": $WORKERS, "kv_tokens_per_worker": $KV_TOKENS, "duration_s": $DURATION,
           "loadgen_time_scale": $TIME_SCALE, "sim_time_scale": $SIM_TS, "rate": $RATE,
           "api": "$API", "loadgen": e["M_LOADGEN"].strip(), "sim_tokenizer": e["M_SIM_TOK"],
           "gateway_tokenizer": e["M_GW_TOK"], "tokenizer_note": e["M_TOK_NOTE"].strip(),
           "has_bootstrap": $HAS_BOOTSTRAP, "sim_has_tokenizer_path": $SIM_TOKPATH,
           "cpus": $NCPU, "commit": e["M_COMMIT"], "sim_args": e["M_SIM_ARGS"],
           "gateway_args": e["M_GW_ARGS"], "probes": $PROBES, "new_copy": $NEW_COPY},
          open(sys.argv[1], "w"), indent=1)
PY

# ---- simulated workers, publishing KV events on ephemeral ports --------------------------------
KV_CFG='{"publisher":"zmq","endpoint":"tcp://127.0.0.1:*","replay_endpoint":"tcp://127.0.0.1:*"}'
log "starting $WORKERS simulated workers on $BASE-$LAST (KV $KV_TOKENS tokens each, GPU x$SIM_TS, tokenizer $SIM_TOK_DESC, KV events on)"
# shellcheck disable=SC2086
"$SIM_BIN" --ports "$BASE-$LAST" --time-scale "$SIM_TS" "${SIM_TOK[@]}" --max-total-tokens "$KV_TOKENS" \
    --kv-events-config "$KV_CFG" $SIM_ARGS >"$LOGS/sim-worker.log" 2>&1 &
SIM_PID=$!
PIDS+=("$SIM_PID")
for u in "${URLS[@]}"; do
    wait_http "$u/health" 60 "$SIM_PID" || { echo "sim-worker did not come up:" >&2; tail -20 "$LOGS/sim-worker.log" >&2; exit 1; }
done

flush_workers() {
    local u
    for u in "${URLS[@]}"; do
        for _ in $(seq 1 50); do
            [[ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 -X POST "$u/flush_cache" || true)" == 200 ]] && break
            sleep 0.2
        done
    done
}
scrape_workers() { # DIR PREFIX
    local i
    for ((i = 0; i < WORKERS; i++)); do curl -s --max-time 10 "${URLS[$i]}/metrics" >"$1/$2-$i.prom" || true; done
}
scrape_copies() { # DIR PREFIX COUNT
    local i
    for ((i = 0; i < $3; i++)); do curl -s --max-time 10 "http://127.0.0.1:$(gw_mport "$i")/metrics" >"$1/$2-gw$i.prom" || true; done
}
# radixgate_kv_warm_workers of copy $1 (empty when not exported).
warm_workers() {
    curl -s --max-time 5 "http://127.0.0.1:$(gw_mport "$1")/metrics" 2>/dev/null \
        | awk '$1 == "radixgate_kv_warm_workers" { print int($2) }' || true
}
# Wait until copy $1 reports every worker warm; prints the seconds it took (or "timeout").
wait_warm() {
    local t0 w
    t0="$(date +%s.%N)"
    for _ in $(seq 1 $((${2:-30} * 10))); do
        w="$(warm_workers "$1")"
        if [[ -n "$w" && "$w" -ge "$WORKERS" ]]; then python3 -c "import time; print(f'{time.time() - $t0:.1f}')"; return 0; fi
        sleep 0.1
    done
    echo timeout
    return 1
}

# ---- radixgate copies and the front --------------------------------------------------------------
COPY_PIDS=()
# start_copy INDEX MODE DIR [extra flags...]: one copy, one serving core pinned to CPU INDEX mod
# the CPU count; its PID is appended to COPY_PIDS.
start_copy() {
    local idx="$1" mode="$2" dir="$3" args
    shift 3
    args=(--worker-urls "${URLS[@]}" --policy cache_aware --host 127.0.0.1 --port "$(gw_port "$idx")"
          --prometheus-host 127.0.0.1 --prometheus-port "$(gw_mport "$idx")" --cpu-list "$((idx % NCPU))"
          --shutdown-grace-period-secs 5 --log-level warn)
    if [[ "$mode" == events ]]; then
        args+=(--kv-events)
        [[ -n "$TOKENIZER_PATH" ]] && args+=(--tokenizer-path "$TOKENIZER_PATH")
    fi
    # shellcheck disable=SC2086
    "$GW_BIN" "${args[@]}" "$@" $GATEWAY_ARGS >"$dir/gateway-$idx.log" 2>&1 &
    COPY_PIDS+=($!)
    PIDS+=($!)
    printf '%q ' "$GW_BIN" "${args[@]}" "$@" >"$dir/gateway-$idx.cmd"
}

FRONT_PID=""
start_front() { # DIR COUNT
    local dir="$1" n="$2" run="$1/front" i lines=""
    mkdir -p "$run/nginx-tmp"
    if [[ "$FRONT" == nginx ]]; then
        for ((i = 0; i < n; i++)); do lines+="        server 127.0.0.1:$(gw_port "$i") max_fails=0;"$'\n'; done
        local user_line=""
        [[ "$(id -u)" == 0 ]] && user_line="user $(id -un) $(id -gn);"
        python3 - configs/nginx-front.conf "$run/nginx.conf" "$run" "127.0.0.1:$FRONT_PORT" "$lines" "$user_line" <<'PY'
import sys
src, dst, run, listen, ups, user = sys.argv[1:7]
t = open(src).read()
t = t.replace("@UPSTREAMS@\n", ups).replace("@RUN_DIR@", run).replace("@LISTEN@", listen).replace("@USER@", user)
open(dst, "w").write(t)
PY
        "$FRONT_BIN" -p "$run/" -e "$run/nginx-error.log" -c "$run/nginx.conf" -g 'daemon off;' >"$run/nginx.out" 2>&1 &
    else
        for ((i = 0; i < n; i++)); do lines+="    server gw$i 127.0.0.1:$(gw_port "$i") check"$'\n'; done
        python3 - configs/haproxy-front.cfg "$run/haproxy.cfg" "$run" "127.0.0.1:$FRONT_PORT" "$lines" <<'PY'
import sys
src, dst, run, listen, servers = sys.argv[1:6]
t = open(src).read()
t = t.replace("@SERVERS@\n", servers).replace("@RUN_DIR@", run).replace("@LISTEN@", listen)
open(dst, "w").write(t)
PY
        "$FRONT_BIN" -f "$run/haproxy.cfg" -db >"$run/haproxy.out" 2>&1 &
    fi
    FRONT_PID=$!
    PIDS+=("$FRONT_PID")
    wait_http "$FRONT_URL/readiness" 30 "$FRONT_PID"
}

# Run a command in the background and wait for it (a trapped signal interrupts `wait` at once).
run_fg() {
    local pid rc=0
    "$@" &
    pid=$!
    PIDS+=("$pid")
    wait "$pid" || rc=$?
    forget_pid "$pid"
    return "$rc"
}

# ---- new copy mid-run (events mode, N copies) --------------------------------------------------
# probe_new_copies DIR: for each late copy (replay only; bootstrapped from copy 0 when the build
# has --kv-bootstrap-peer): K probe conversations run two turns through the front, the copy
# starts, and their next turn goes straight to it as soon as it answers /readiness (what it knows
# of the past: replay / bootstrap); once it reports every worker warm, K fresh conversations run
# two turns through the front and their next turn goes straight to it too (what it learns live).
# Under eviction a prefix left idle for long is gone from every worker, so each check follows
# its conversations' earlier turns at once.
probe_new_copies() {
    local dir="$1" api k=0 idx label peer t_ready warm late_pid v t0 target
    api=generate-ids
    [[ "$API" == chat ]] && api=chat
    local variants=(replay)
    [[ "$HAS_BOOTSTRAP" == 1 ]] && variants+=(bootstrap)
    : >"$dir/probe-times.txt"
    for v in "${variants[@]}"; do
        idx=$((COPIES + k))
        target="http://127.0.0.1:$(gw_port "$idx")"
        local extra=()
        label="new copy (replay only)"
        if [[ "$v" == bootstrap ]]; then
            peer="http://127.0.0.1:$(gw_port 0)"
            extra=(--kv-bootstrap-peer "$peer")
            label="new copy (--kv-bootstrap-peer $peer)"
        fi
        python3 scripts/gateway-probe.py start --state "$dir/probe-$v-1ready.json" --target "$FRONT_URL" --api "$api" \
            --conversations "$PROBES" --prefix-tokens 2000 --turns 2 --seed $((100 + k)) >>"$dir/probe.log" 2>&1 \
            || { echo "$label: probe conversations failed (see probe.log)" >>"$dir/probe-times.txt"; k=$((k + 1)); continue; }
        t0="$(date +%s.%N)"
        COPY_PIDS=()
        start_copy "$idx" events "$dir" "${extra[@]}"
        late_pid="${COPY_PIDS[0]}"
        if ! wait_http "$target/readiness" 60 "$late_pid"; then
            echo "$label: not ready within 60 s" >>"$dir/probe-times.txt"
            stop_and_forget "$late_pid"; k=$((k + 1)); continue
        fi
        t_ready="$(python3 -c "import time; print(f'{time.time() - $t0:.1f}')")"
        python3 scripts/gateway-probe.py next --state "$dir/probe-$v-1ready.json" --target "$target" \
            --label "$label, at /readiness (warm workers: $(warm_workers "$idx")/$WORKERS)" >>"$dir/probe.log" 2>&1 || true
        warm="$(wait_warm "$idx" 60 || true)"
        python3 scripts/gateway-probe.py start --state "$dir/probe-$v-2warm.json" --target "$FRONT_URL" --api "$api" \
            --conversations "$PROBES" --prefix-tokens 2000 --turns 2 --seed $((200 + k)) >>"$dir/probe.log" 2>&1 || true
        python3 scripts/gateway-probe.py next --state "$dir/probe-$v-2warm.json" --target "$target" \
            --label "$label, once warm" >>"$dir/probe.log" 2>&1 || true
        echo "- $label: answered /readiness ${t_ready} s after its start; every worker warm ${warm} s after that" >>"$dir/probe-times.txt"
        curl -s --max-time 5 "http://127.0.0.1:$(gw_mport "$idx")/metrics" >"$dir/late-$v.prom" || true
        stop_and_forget "$late_pid"
        k=$((k + 1))
    done
    local states=()
    for f in "$dir"/probe-*.json; do [[ -f "$f" ]] && states+=(--state "$f"); done
    {
        cat "$dir/probe-times.txt"
        echo
        [[ ${#states[@]} -gt 0 ]] && python3 scripts/gateway-probe.py report "${states[@]}" --summary "$dir/new-copy-summary.json"
    } >"$dir/probe.md" 2>>"$dir/probe.log" || true
}

# ---- one run ---------------------------------------------------------------------------------------
run_one() { # INDEX MODE COUNT [probe]: probe = 1 adds the new-copy-mid-run check
    local idx="$1" mode="$2" n="$3" probe="${4:-0}" dir status=ok i w lg_pid
    dir="$OUT/runs/$(printf '%02d' "$idx")-$mode-$n"
    [[ "$probe" == 1 ]] && dir+="-newcopy"
    mkdir -p "$dir"
    log "[$mode, $n cop$( ((n == 1)) && echo y || echo ies)] starting radixgate x$n behind $FRONT"
    COPY_PIDS=()
    for ((i = 0; i < n; i++)); do start_copy "$i" "$mode" "$dir"; done
    local copies=("${COPY_PIDS[@]}")
    for ((i = 0; i < n; i++)); do
        wait_http "http://127.0.0.1:$(gw_port "$i")/readiness" 60 "${copies[$i]}" || { status="copy $i did not become ready"; break; }
    done
    if [[ "$status" == ok ]] && ! start_front "$dir" "$n"; then status="$FRONT did not come up"; fi
    if [[ "$status" == ok ]]; then
        local warmed=0
        for _ in $(seq 1 20); do
            if run_fg "$LOADGEN" --target "$FRONT_URL" --workload rate --rate 20 --duration 1 --drain 5 \
                --quiet --json "$dir/warmup.json" >/dev/null 2>>"$dir/warmup.log" \
                && [[ "$(jq -r '.failed' "$dir/warmup.json")" == 0 ]]; then warmed=1; break; fi
            sleep 0.5
        done
        [[ "$warmed" == 1 ]] || status="warm-up failed"
    fi
    if [[ "$status" == ok ]]; then
        flush_workers
        if [[ "$mode" == events ]]; then
            for ((i = 0; i < n; i++)); do
                w="$(wait_warm "$i" 30 || true)"
                echo "copy $i: every worker warm after ${w} s" >>"$dir/warm.txt"
            done
            sleep 0.5 # the flush's AllBlocksCleared reaches every copy
        fi
        scrape_workers "$dir" before
        scrape_copies "$dir" before "$n"
        log "[$mode, $n] replaying chat for ${DURATION}s through $FRONT_URL"
        # shellcheck disable=SC2086
        "$LOADGEN" --target "$FRONT_URL" "${LG[@]}" --time-scale "$TIME_SCALE" --duration "$DURATION" \
            --drain "$DRAIN" --quiet --json "$dir/loadgen.json" --markdown "$dir/loadgen.md" $LOADGEN_ARGS \
            2>"$dir/loadgen.log" &
        lg_pid=$!
        PIDS+=("$lg_pid")
        if [[ "$probe" == 1 ]]; then
            sleep "$(python3 -c "print(max(1.0, $DURATION / 3))")"
            log "[$mode, $n] new copy mid-run: probes and late copies"
            probe_new_copies "$dir"
        fi
        wait "$lg_pid" || status="loadgen failed (see loadgen.log)"
        forget_pid "$lg_pid"
        scrape_workers "$dir" after
        scrape_copies "$dir" after "$n"
    fi
    [[ -n "$FRONT_PID" ]] && stop_and_forget "$FRONT_PID"
    FRONT_PID=""
    for i in "${copies[@]}"; do stop_and_forget "$i"; done
    python3 - "$dir/run.json" "$mode" "$n" "$status" "$probe" <<'PY'
import json, sys
json.dump({"mode": sys.argv[2], "copies": int(sys.argv[3]), "status": sys.argv[4],
           "probe": sys.argv[5] == "1"}, open(sys.argv[1], "w"))
PY
    if [[ "$status" == ok ]]; then
        log "[$mode, $n] done: $(jq -r '"ok \(.ok)/\(.sent), client hit \((.hit_rate // 0) * 100 | floor) %"' "$dir/loadgen.json")"
    else
        log "[$mode, $n] FAILED: $status"
    fi
}

idx=0
for mode in "${MODES[@]}"; do
    counts=(1)
    [[ "$COPIES" -gt 1 ]] && counts+=("$COPIES")
    for n in "${counts[@]}"; do
        idx=$((idx + 1))
        run_one "$idx" "$mode" "$n"
    done
done
# The new-copy check runs on its own (same workload, event mode, N copies), so its probes and the
# late copies' start-up replay do not touch the rows above.
if [[ "$NEW_COPY" == 1 && " ${MODES[*]} " == *" events "* ]]; then
    idx=$((idx + 1))
    run_one "$idx" events "$COPIES" 1
fi
stop_and_forget "$SIM_PID"

# ---- report ------------------------------------------------------------------------------------------
python3 - "$OUT" <<'PY'
import json, os, re, sys

root = sys.argv[1]
meta = json.load(open(os.path.join(root, "meta.json")))
SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfINFaN]+)')


def prom(path):
    out = {}
    try:
        for line in open(path, encoding="utf-8", errors="replace"):
            m = SAMPLE.match(line.strip())
            if m and not line.startswith("#"):
                out.setdefault(m.group(1), []).append((m.group(2) or "", float(m.group(3))))
    except OSError:
        pass
    return out


def tot(m, name, must=None):
    return sum(v for lab, v in m.get(name, []) if must is None or must in lab)


def delta(d, prefix, name, must=None):
    s, i = 0.0, 0
    while os.path.exists(os.path.join(d, f"before-{prefix}{i}.prom")):
        s += tot(prom(os.path.join(d, f"after-{prefix}{i}.prom")), name, must) - \
             tot(prom(os.path.join(d, f"before-{prefix}{i}.prom")), name, must)
        i += 1
    return s


def pct(x):
    return "n/a" if x is None else f"{100 * x:.1f} %"


runs = []
for name in sorted(os.listdir(os.path.join(root, "runs"))):
    d = os.path.join(root, "runs", name)
    try:
        r = json.load(open(os.path.join(d, "run.json")))
    except (OSError, ValueError):
        continue
    r["dir"] = d
    try:
        r["lg"] = json.load(open(os.path.join(d, "loadgen.json")))
    except (OSError, ValueError):
        r["lg"] = None
    prompt = delta(d, "", "sglang:prompt_tokens_total")
    labelled = any("cache_source" in lab for f in os.listdir(d) if f.startswith("after-") and "gw" not in f
                   for lab, _ in prom(os.path.join(d, f)).get("sglang:cached_tokens_total", []))
    cached = delta(d, "", "sglang:cached_tokens_total", 'cache_source="total"' if labelled else None)
    # The probe conversations' own requests (server-reported tokens) are not the workload's.
    pp = pc = 0
    for f in sorted(os.listdir(d)):
        if not (f.startswith("probe-") and f.endswith(".json")):
            continue
        for c in json.load(open(os.path.join(d, f)))["conversations"]:
            for t in c["turns"]:
                pp += t.get("prompt_tokens") or 0
                pc += t.get("cached_tokens") or 0
    r["probe_tokens"] = pp
    prompt, cached = prompt - pp, cached - pc
    r["hit"] = cached / prompt if prompt > 0 else None
    r["prompt"] = prompt
    fb = {}
    for i in range(r["copies"]):
        a, b = prom(os.path.join(d, f"after-gw{i}.prom")), prom(os.path.join(d, f"before-gw{i}.prom"))
        for lab, v in a.get("radixgate_kv_fallback_total", []):
            reason = re.search(r'reason="([^"]*)"', lab)
            before = sum(x for l2, x in b.get("radixgate_kv_fallback_total", []) if l2 == lab)
            if reason and v - before > 0:
                fb[reason.group(1)] = fb.get(reason.group(1), 0) + v - before
    r["fallbacks"] = fb
    r["routed"] = delta(d, "gw", "smg_worker_selection_total")
    r["routed_per"] = [int(tot(prom(os.path.join(d, f"after-gw{i}.prom")), "smg_worker_selection_total")
                           - tot(prom(os.path.join(d, f"before-gw{i}.prom")), "smg_worker_selection_total"))
                       for i in range(r["copies"])]
    kp = delta(d, "gw", "radixgate_kv_prompt_tokens_total")
    r["predicted"] = delta(d, "gw", "radixgate_kv_predicted_cached_tokens_total") / kp if kp > 0 else None
    runs.append(r)

one = {r["mode"]: r for r in runs if r["copies"] == 1 and r["status"] == "ok" and not r.get("probe")}
out = [f"# {meta['copies']} radixgate copies behind {meta['front']}: the servers' hit rate\n",
       "Command (from the repository root):\n", "```", meta["command"], "```\n",
       f"Commit `{meta['commit']}`, {meta['cpus']} CPUs. Workload: compare-policies' chat (`{meta['loadgen']}`, "
       f"time scale {meta['loadgen_time_scale']}, {meta['duration_s']} s), {meta['workers']} simulated workers "
       f"with {meta['kv_tokens_per_worker']} KV tokens each (they evict), GPU ×{meta['sim_time_scale']}, "
       f"worker tokenizer {meta['sim_tokenizer']}, KV events on every worker in every run. "
       f"Each copy: cache_aware, one serving core pinned (`--cpu-list i mod {meta['cpus']}`). Caches flushed before "
       f"every run; fresh copies and front per run.\n",
       f"Gateway tokenizer: {meta['gateway_tokenizer']} — {meta['tokenizer_note']}. "
       f"`--kv-bootstrap-peer`: {'present' if meta['has_bootstrap'] else 'not in this build (the bootstrap check is skipped)'}.\n",
       "| mode | copies | hit rate (servers) | vs 1 copy | hit rate (client) | gateway-predicted hit | "
       "routed requests (per copy) | text-tree fallbacks | TTFT p50 ms | TTFT p99 ms | ok / sent |",
       "|---|---|---|---|---|---|---|---|---|---|---|"]
for r in runs:
    lg = r["lg"]
    if r["status"] != "ok" or not lg:
        out.append(f"| {r['mode']} | {r['copies']}{' + new copy mid-run' if r.get('probe') else ''} "
                   f"| failed: {r['status']} | | | | | | | | |")
        continue
    base = one.get(r["mode"])
    rel = (r["hit"] / base["hit"]) if base and base["hit"] and r["hit"] is not None else None
    fb = ", ".join(f"{k} {int(v)}" for k, v in sorted(r["fallbacks"].items())) or ("0" if r["mode"] == "events" else "—")
    out.append(f"| {r['mode']} | {r['copies']}{' + new copy mid-run' if r.get('probe') else ''} | **{pct(r['hit'])}** | {'' if rel is None else f'{100 * rel:.1f} %'} "
               f"| {pct(lg.get('hit_rate'))} | {pct(r['predicted']) if r['mode'] == 'events' else '—'} "
               f"| {int(r['routed'])}{' (' + ' + '.join(map(str, r['routed_per'])) + ')' if r['copies'] > 1 else ''} | {fb} | {lg['ttft']['p50_ms']:.1f} | {lg['ttft']['p99_ms']:.1f} "
               f"| {lg['ok']} / {lg['sent']} |")
out.append("\nHit rate (servers) = Δ `sglang:cached_tokens_total` / Δ `sglang:prompt_tokens_total` over all "
           "workers during the replay (probe conversations' own tokens subtracted). Fallbacks: "
           "Δ `radixgate_kv_fallback_total` over the copies — requests the text tree routed although `--kv-events` is on. "
           "Routed requests include the probe conversations' turns sent through the front.\n")
warm = []
for r in runs:
    p = os.path.join(r["dir"], "warm.txt")
    if os.path.exists(p):
        warm.append(f"- {os.path.basename(r['dir'])}: " + "; ".join(l.strip() for l in open(p) if l.strip()))
if warm:
    out += ["Event mode, before each replay (after the flush): time until each copy reported every worker "
            "warm (`radixgate_kv_warm_workers`; the first copy of a run replays what the publishers still buffer "
            "from earlier runs):\n"] + warm + [""]

acc = []
n = meta["copies"]
for mode in ("events", "text"):
    a = one.get(mode)
    b = next((r for r in runs if r["mode"] == mode and r["copies"] == n and r["status"] == "ok" and n > 1
              and not r.get("probe")), None)
    if a and b and a["hit"] and b["hit"] is not None:
        rel = b["hit"] / a["hit"]
        if mode == "events":
            acc.append(f"- {'PASS' if rel >= 0.98 else 'FAIL'} — event mode, {n} copies keep ≥ 98 % of one copy's "
                       f"server-measured hit rate: {pct(b['hit'])} vs {pct(a['hit'])} ({100 * rel:.1f} %)")
            fbn = sum(b["fallbacks"].values())
            if b["routed"] and fbn / b["routed"] > 0.5:
                acc.append(f"  - caveat: {int(fbn)} of {int(b['routed'])} routed requests fell back to the text tree "
                           f"({', '.join(sorted(b['fallbacks']))}): this row measures the text tree, not the events")
        else:
            acc.append(f"- text-tree mode, {n} copies: {pct(b['hit'])} vs {pct(a['hit'])} with one copy ({100 * rel:.1f} %)")
# A copy started mid-run with --kv-bootstrap-peer must send its first turns (sent to it as soon
# as it answers /readiness) to the workers that served the conversations' earlier turns.
for r in runs:
    p = os.path.join(r["dir"], "new-copy-summary.json")
    if not os.path.exists(p):
        continue
    for label, v in json.load(open(p)).items():
        if "--kv-bootstrap-peer" not in label or "/readiness" not in label:
            continue
        ok = v["n"] > 0 and v["same"] == v["n"]
        acc.append(f"- {'PASS' if ok else 'FAIL'} — a copy started mid-run with `--kv-bootstrap-peer` routes "
                   f"its first turns to the servers that hold them: {v['same']} of {v['n']} next turns to the "
                   f"worker that served the previous turn, mean server hit {100 * v['mean_hit']:.0f} % "
                   f"({label})")
if acc:
    out += ["## Acceptance (issue 10, item 8)\n"] + acc + [""]

for r in runs:
    p = os.path.join(r["dir"], "probe.md")
    if os.path.exists(p):
        out.append(f"## New copy mid-run ({r['mode']} mode, {r['copies']} copies running)\n")
        out.append(f"A third of the way into the replay, {meta['probes']} probe conversations (2,000-token "
                   f"prefix) ran two turns through {meta['front']}; then a new copy was started and the next turn "
                   f"of each was sent straight to it once it answered `/readiness`. After it reported every worker "
                   f"warm, {meta['probes']} fresh conversations did the same. `same worker`: it chose the worker "
                   f"that served the previous turn (the prefix is there unless evicted meanwhile; the server's "
                   f"cached tokens tell).\n")
        out.append(open(p).read())
        if not meta["has_bootstrap"]:
            out.append("\n`--kv-bootstrap-peer` is not in this build: only the replay-only copy was checked.\n")
text = "\n".join(out) + "\n"
open(os.path.join(root, "multi-gateway.md"), "w").write(text)
# The short version docs/benchmarks.md shows: the servers' hit rate per mode and copies.
docs = ["| mode | copies | servers' hit rate | vs 1 copy | TTFT p50 / p99 ms | ok / sent |",
        "|---|---|---|---|---|---|"]
for r in runs:
    lg = r["lg"]
    label = f"{r['copies']}{' + new copy mid-run' if r.get('probe') else ''}"
    if r["status"] != "ok" or not lg:
        docs.append(f"| {r['mode']} | {label} | failed: {r['status']} | | | |")
        continue
    base = one.get(r["mode"])
    rel = (r["hit"] / base["hit"]) if base and base["hit"] and r["hit"] is not None else None
    docs.append(f"| {r['mode']} | {label} | {pct(r['hit'])} | {'' if rel is None else f'{100 * rel:.1f} %'} "
                f"| {lg['ttft']['p50_ms']:.1f} / {lg['ttft']['p99_ms']:.1f} | {lg['ok']} / {lg['sent']} |")
docs.append(f"\nFront: {meta['front']}; {meta['workers']} simulated workers of {meta['kv_tokens_per_worker']} KV tokens.")
if acc:
    docs += [""] + acc
open(os.path.join(root, "docs.md"), "w").write("\n".join(docs) + "\n")
print(text)
PY
log "report: $OUT/multi-gateway.md"
if [[ "$WRITE_DOCS" == 1 ]]; then
    python3 scripts/bench-docs.py write "$DOCS_SECTION" "$OUT/docs.md" --command "$COMMAND"
fi
