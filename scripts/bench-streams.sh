#!/usr/bin/env bash
# Thousands of open SSE streams through each proxy: the delay every proxy adds to each streamed
# event (not only the first), TTFT, CPU per event, memory per open stream and per idle
# keep-alive connection, and whether /health still answers promptly while the streams are open.
#
#   scripts/bench-streams.sh [--levels 2048x20,4096x40,8192x80,512x2] [--duration S]
#       [--warmup S] [--rounds N] [--candidates direct,radixgate,nginx,sglang-router]
#       [--serving-cores 1|2] [--max-tokens N] [--prompt-bytes N] [--skip-build]
#       [--radixgate-bin PATH] [--tools-dir DIR] [--out DIR] [--write-docs [--docs-section NAME]]
#       [--help]
#
# Levels: STREAMSxINTERVAL_MS, e.g. 2048x20 = 2,048 streams open at once, each receiving one
# event every 20 ms (102k events/s offered); 512x2 = 512 streams at 2 ms (256k/s). Default
# 2048x20,4096x40,8192x80,512x2.
#
# Candidates (default: all):
#   direct          the load generator straight to the upstream (no proxy): the baseline
#   radixgate       radixgate --policy cache_aware --cpu-list 0 (--max-connections-per-core
#                   raised to streams + 256 when a level needs more than its 8,192 default)
#   nginx           one worker process, proxy_buffering off, proxy_http_version 1.1, a
#                   keep-alive upstream group; worker_connections sized to the level (apt-get
#                   installed when missing; run as the current user, its own prefix and paths)
#   sglang-router   sglang-router 0.3.2 (PyPI, into .venv/ as compare-policies.sh does),
#                   cache_aware, TOKIO_WORKER_THREADS=1
#
# Upstream: stream-upstream (loadtest/src/streams/upstream.rs; one thread, raw epoll): every
# POST /v1/chat/completions gets max_tokens (--max-tokens, default 64) SSE events of ~200 bytes,
# one per interval, each stamped with the CLOCK_MONOTONIC time of its write; the first is written
# at once with the response head (so TTFT is what the proxy adds to the request and the first
# event), the last carries [DONE]. Load: `loadgen streams` (one thread, raw epoll): N keep-alive
# connections, each in a closed loop of streamed requests (--prompt-bytes, default 1024, every
# prompt distinct from its first bytes), timing each event against its stamp (event delay) and
# the first event against the request's write (TTFT); a separate connection GETs /health every
# 10 ms while the streams are open. Connections open spread evenly over one event interval (N /
# interval a millisecond), so the streams' events are spread in time as a fleet's are rather than
# falling into one burst per interval; the window starts --warmup seconds (default 3) after the last one opened and lasts --duration seconds (default 10).
#
# Placement (a 2-core machine): the proxy is pinned with taskset to CPU 0 (the whole process);
# the upstream and the load generator share CPU 1. --serving-cores 2 gives the proxy both CPUs
# (radixgate --cpu-list 0,1, nginx worker_processes 2, sglang-router TOKIO_WORKER_THREADS=2):
# then the load generator and the upstream share the proxy's cores, and the report says so.
#
# Method: per level, every candidate is started fresh and checked (a streamed request answered
# with 200 and [DONE]); its idle resident memory is read; then N idle keep-alive connections are
# opened (each sends one GET /health, then holds 3 s): idle keep-alive memory = RSS delta / N.
# That comes first, on the fresh process, because after a streaming run the allocator's retained
# memory would absorb the new connections and hide their cost. Then --rounds rounds (default 2),
# each running every candidate once, the order rotated round by round. Per run, read at the load
# generator's own window edges: the proxy's utime+stime (summed over its process tree) and VmRSS
# every 0.5 s. Reported per level and candidate (medians over rounds): delivered events/s
# against offered, event delay p50/p99/p99.9, added delay (the candidate's minus direct's of the
# same round), TTFT p50/p99, proxy CPU-seconds per million events, RSS with the streams open and
# per open stream ((RSS open - RSS of the fresh process) / streams), /health p99 and max while
# open, idle keep-alive KiB per connection, errors (connect, non-200, broken, timeout, malformed),
# and CPU 1's busy share (when near 100 % the load side, not the proxy, may be the limit).
#
# Both tools run SCHED_BATCH, so on their shared CPU one's wake-up does not preempt the other
# and each handles events in batches; STREAMS_SCHED=normal in the environment keeps the normal
# policy (worth comparing on a machine where other work shares CPU 1). On a 2-CPU VM the two
# tools together cost ~10 µs of CPU 1 per event (95 % of it the kernel's loopback TCP), so
# CPU 1 carries about 90-100k events/s: the report says when they filled it.
#
# Descriptors: the script raises `ulimit -n` to the hard limit; a level whose proxy would need
# more (2 per stream plus slack) is skipped, and the report says so.
#
# Writes results/bench-streams-<stamp>/report.md (printed at the end), raw.json (every run and the
# medians), runs/ (each run's JSON line and summary), logs/, and docs.md; --write-docs puts docs.md
# into docs/benchmarks.md (section streams, or --docs-section NAME). Every step has a time bound
# and the script stops by itself; only 127.0.0.1; every process started here is stopped by PID.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

ALL_CANDIDATES="direct,radixgate,nginx,sglang-router"
LEVELS="2048x20,4096x40,8192x80,512x2"
DURATION=10
WARMUP=3
ROUNDS=2
CANDIDATES="$ALL_CANDIDATES"
SERVING_CORES=1
MAX_TOKENS=64
PROMPT_BYTES=1024
IDLE_HOLD=3
BUILD=1
RG_BIN=""
TOOLS_DIR=""
OUT=""
WRITE_DOCS=0
DOCS_SECTION=""
SGLANG_ROUTER_VERSION=0.3.2

usage() { sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --levels) LEVELS="$2"; shift 2 ;;
        --duration) DURATION="$2"; shift 2 ;;
        --warmup) WARMUP="$2"; shift 2 ;;
        --rounds) ROUNDS="$2"; shift 2 ;;
        --candidates) CANDIDATES="$2"; shift 2 ;;
        --serving-cores) SERVING_CORES="$2"; shift 2 ;;
        --max-tokens) MAX_TOKENS="$2"; shift 2 ;;
        --prompt-bytes) PROMPT_BYTES="$2"; shift 2 ;;
        --skip-build) BUILD=0; shift ;;
        --radixgate-bin) RG_BIN="$2"; shift 2 ;;
        --tools-dir) TOOLS_DIR="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --write-docs) WRITE_DOCS=1; shift ;;
        --docs-section) DOCS_SECTION="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown option: $1 (see --help)" >&2; exit 2 ;;
    esac
done
[[ "$DURATION" =~ ^[1-9][0-9]*$ ]] || { echo "--duration: whole seconds >= 1" >&2; exit 2; }
[[ "$WARMUP" =~ ^[0-9]+$ ]] || { echo "--warmup: whole seconds >= 0" >&2; exit 2; }
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || { echo "--rounds: a whole number >= 1" >&2; exit 2; }
[[ "$SERVING_CORES" == 1 || "$SERVING_CORES" == 2 ]] || { echo "--serving-cores 1|2" >&2; exit 2; }
[[ "$MAX_TOKENS" =~ ^[1-9][0-9]*$ ]] || { echo "--max-tokens: a whole number >= 1" >&2; exit 2; }
[[ "$PROMPT_BYTES" =~ ^[0-9]+$ ]] || { echo "--prompt-bytes: a whole number" >&2; exit 2; }
IFS=',' read -r -a CAND_LIST <<<"$CANDIDATES"
for c in "${CAND_LIST[@]}"; do
    [[ ",$ALL_CANDIDATES," == *",$c,"* ]] || { echo "unknown candidate: $c (known: $ALL_CANDIDATES)" >&2; exit 2; }
done
IFS=',' read -r -a LEVEL_LIST <<<"$LEVELS"
declare -A LV_STREAMS=() LV_INTERVAL=()
for l in "${LEVEL_LIST[@]}"; do
    [[ "$l" =~ ^([1-9][0-9]*)x([0-9]+(\.[0-9]+)?)$ ]] || { echo "--levels: STREAMSxINTERVAL_MS (e.g. 2048x20,512x2.5), not $l" >&2; exit 2; }
    LV_STREAMS[$l]="${BASH_REMATCH[1]}"
    LV_INTERVAL[$l]="${BASH_REMATCH[2]}"
    awk -v i="${LV_INTERVAL[$l]}" 'BEGIN {exit !(i >= 0.01)}' || { echo "--levels: interval of $l below 0.01 ms" >&2; exit 2; }
done

if [[ "$SERVING_CORES" == 2 ]]; then PROXY_CPUS="0,1"; else PROXY_CPUS="0"; fi
LOAD_CPU=1
[[ "$(nproc)" -ge 2 ]] || { echo "needs 2 CPUs (the proxy on CPU 0, the load on CPU 1); this machine has $(nproc)" >&2; exit 1; }

STAMP="$(date +%Y%m%d-%H%M%S)"
OUT="${OUT:-results/bench-streams-$STAMP}"
mkdir -p "$OUT/logs" "$OUT/runs"
OUT="$(cd "$OUT" && pwd)"
LOGS="$OUT/logs"
log() { printf '[bench-streams %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# Every stream is a descriptor in the load generator and the upstream, two in a proxy.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
NOFILE="$(ulimit -n)"
[[ "$NOFILE" == unlimited ]] && NOFILE=1048576

# ---- process bookkeeping: stop only what we started, by PID --------------------------------
PIDS=()
# shellcheck source=lib/procs.sh
source "$ROOT/scripts/lib/procs.sh"
cleanup() {
    local rc=$? p
    trap - EXIT INT TERM
    for p in "${PIDS[@]+"${PIDS[@]}"}"; do stop_pid "$p"; done
    exit "$rc"
}
trap cleanup EXIT
trap 'echo; echo "interrupted" >&2; exit 130' INT TERM
forget_pid() { local keep=() p; for p in "${PIDS[@]+"${PIDS[@]}"}"; do [[ "$p" == "$1" ]] || keep+=("$p"); done; PIDS=("${keep[@]+"${keep[@]}"}"); }



has() { [[ " ${CAND_LIST[*]} " == *" $1 "* ]]; }
NOTES=()
drop_candidate() {
    local keep=() c
    for c in "${CAND_LIST[@]}"; do [[ "$c" == "$1" ]] || keep+=("$c"); done
    CAND_LIST=("${keep[@]+"${keep[@]}"}")
    NOTES+=("$1 left out: $2")
    log "$1 left out: $2"
}

# ---- tools and binaries --------------------------------------------------------------------
if has nginx && ! command -v nginx >/dev/null; then
    log "installing nginx (apt-get)"
    timeout 300 apt-get install -y -q nginx >"$LOGS/apt-nginx.log" 2>&1 || true
    command -v nginx >/dev/null || drop_candidate nginx "nginx could not be installed (see logs/apt-nginx.log)"
fi
NGINX_USER_LINE=""
[[ "$(id -u)" == 0 ]] && NGINX_USER_LINE="user $(id -un) $(id -gn);"
if [[ "$BUILD" == 1 ]]; then
    log "building release binaries (cargo build --release -p radixgate -p loadtest)"
    cargo build --release -p radixgate -p loadtest >"$LOGS/build.log" 2>&1 || { tail -30 "$LOGS/build.log" >&2; exit 1; }
fi
TARGET_DIR="${CARGO_TARGET_DIR:-target}"
RG_BIN="$(realpath "${RG_BIN:-$TARGET_DIR/release/radixgate}")"
TOOLS_DIR="$(realpath "${TOOLS_DIR:-$TARGET_DIR/release}")"
UP_BIN="$TOOLS_DIR/stream-upstream"
LG_BIN="$TOOLS_DIR/loadgen"
for b in "$UP_BIN" "$LG_BIN"; do
    [[ -x "$b" ]] || { echo "missing $b (build it, or pass --tools-dir)" >&2; exit 1; }
done
if has radixgate; then [[ -x "$RG_BIN" ]] || { echo "missing $RG_BIN (build it, or pass --radixgate-bin)" >&2; exit 1; }; fi
SGL_PY="$ROOT/.venv/bin/python"
if has sglang-router; then
    have="$("$SGL_PY" -c 'import importlib.metadata as m; print(m.version("sglang-router"))' 2>/dev/null || true)"
    if [[ "$have" != "$SGLANG_ROUTER_VERSION" ]]; then
        log "installing sglang-router==$SGLANG_ROUTER_VERSION into .venv/ (at most 5 minutes)"
        [[ -x "$SGL_PY" ]] || timeout 120 python3 -m venv .venv >"$LOGS/venv.log" 2>&1 || true
        [[ -x "$SGL_PY" ]] && { timeout 300 "$SGL_PY" -m pip install -q "sglang-router==$SGLANG_ROUTER_VERSION" >>"$LOGS/venv.log" 2>&1 || true; }
        have="$("$SGL_PY" -c 'import importlib.metadata as m; print(m.version("sglang-router"))' 2>/dev/null || true)"
    fi
    [[ "$have" == "$SGLANG_ROUTER_VERSION" ]] || drop_candidate sglang-router "sglang-router==$SGLANG_ROUTER_VERSION could not be installed (see logs/venv.log)"
fi
[[ ${#CAND_LIST[@]} -gt 0 ]] || { echo "no candidates left" >&2; exit 1; }

# ---- measurement helpers ---------------------------------------------------------------------
CLK_TCK="$(getconf CLK_TCK)"
# "busy total" jiffies of one CPU.
cpu_jiffies() { awk -v c="cpu$1" '$1 == c { idle = $5 + $6; total = 0; for (i = 2; i <= 9; i++) total += $i; print total - idle, total }' /proc/stat; }
cpus_jiffies() { # "busy total" summed over a comma list of CPUs
    local c b t sb=0 st=0
    for c in ${1//,/ }; do read -r b t < <(cpu_jiffies "$c"); sb=$((sb + b)); st=$((st + t)); done
    echo "$sb $st"
}

# ---- candidates --------------------------------------------------------------------------------
declare -A PORT=() PID_OF=()
UP_PID=""
UP_PORT=""

start_upstream() { # start_upstream INTERVAL_MS
    UP_PORT="$(free_port)"
    taskset -c "$LOAD_CPU" "$UP_BIN" --port "$UP_PORT" --interval-ms "$1" --max-tokens "$MAX_TOKENS" \
        >"$LOGS/upstream-$LEVEL.log" 2>&1 &
    UP_PID=$!
    PIDS+=("$UP_PID")
    wait_ready "http://127.0.0.1:$UP_PORT" 20 "$UP_PID" || { echo "stream-upstream did not come up:" >&2; cat "$LOGS/upstream-$LEVEL.log" >&2; exit 1; }
}

start_candidate() { # start_candidate NAME STREAMS
    local c="$1" n="$2" port pid="" mport
    port="$(free_port)"
    local upstream="http://127.0.0.1:$UP_PORT"
    case "$c" in
        direct) PORT[$c]="$UP_PORT"; PID_OF[$c]=""; return 0 ;;
        radixgate)
            local maxc=$(( n + 256 > 8192 ? n + 256 : 8192 ))
            taskset -c "$PROXY_CPUS" "$RG_BIN" --host 127.0.0.1 --port "$port" --prometheus-port 0 \
                --cpu-list "$PROXY_CPUS" --worker-urls "$upstream" --policy cache_aware --log-level warn \
                --max-connections-per-core "$maxc" >"$LOGS/$c-$LEVEL.log" 2>&1 &
            pid=$! ;;
        sglang-router)
            mport="$(free_port)"
            TOKIO_WORKER_THREADS="$SERVING_CORES" taskset -c "$PROXY_CPUS" "$SGL_PY" -m sglang_router.launch_router \
                --worker-urls "$upstream" --policy cache_aware --host 127.0.0.1 --port "$port" \
                --prometheus-host 127.0.0.1 --prometheus-port "$mport" --log-level warn \
                >"$LOGS/$c-$LEVEL.log" 2>&1 &
            pid=$! ;;
        nginx)
            local run="$OUT/nginx-$LEVEL" wc=$(( 2 * n + 1024 ))
            mkdir -p "$run/tmp"
            cat >"$run/nginx.conf" <<NGINX
# Written by scripts/bench-streams.sh: $SERVING_CORES worker process(es), streamed answers passed
# through unbuffered to a keep-alive upstream group.
$NGINX_USER_LINE
worker_processes $SERVING_CORES;
worker_rlimit_nofile $NOFILE;
pid $run/nginx.pid;
error_log $run/error.log warn;
events { worker_connections $wc; }
http {
    access_log off;
    client_body_temp_path $run/tmp/client_body;
    proxy_temp_path $run/tmp/proxy;
    fastcgi_temp_path $run/tmp/fastcgi;
    uwsgi_temp_path $run/tmp/uwsgi;
    scgi_temp_path $run/tmp/scgi;
    keepalive_requests 1000000;
    keepalive_timeout 300s;
    upstream up {
        server 127.0.0.1:$UP_PORT;
        keepalive $(( n + 64 ));
        keepalive_requests 1000000;
        keepalive_timeout 300s;
    }
    server {
        listen 127.0.0.1:$port backlog=65535;
        client_body_buffer_size 1m;
        location / {
            proxy_pass http://up;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 120s;
        }
    }
}
NGINX
            taskset -c "$PROXY_CPUS" nginx -p "$run/" -e "$run/error.log" -c "$run/nginx.conf" -g 'daemon off;' \
                >"$LOGS/$c-$LEVEL.log" 2>&1 &
            pid=$! ;;
    esac
    PIDS+=("$pid")
    PORT[$c]="$port"; PID_OF[$c]="$pid"
}

stop_candidates() {
    local c
    for c in "${LV_CANDS[@]}"; do
        [[ -n "${PID_OF[$c]:-}" ]] && { stop_pid "${PID_OF[$c]}"; forget_pid "${PID_OF[$c]}"; }
    done
    stop_pid "$UP_PID"; forget_pid "$UP_PID"; UP_PID=""
}

# A streamed request answered 200 with [DONE] before the clock starts.
check_stream() {
    local c="$1" out="$LOGS/check-$1-$LEVEL.out"
    curl -s -N --max-time 30 -o "$out" -w '%{http_code}' -H 'Content-Type: application/json' \
        --data '{"model":"sim-model","stream":true,"max_tokens":3,"messages":[{"role":"user","content":"check"}]}' \
        "http://127.0.0.1:${PORT[$c]}/v1/chat/completions" | grep -q '^200$' && grep -q '\[DONE\]' "$out"
}

RUNS="$OUT/runs.tsv"
printf 'round\tlevel\tcandidate\tkind\tfile\tupstream_cpu_s\twall_s\tload_cpu_busy\tproxy_cpus_busy\trss_fresh_kb\trc\n' >"$RUNS"

# One loadgen run (streams or idle) against candidate C; appends a row to runs.tsv.
measured_run() { # measured_run ROUND C KIND STREAMS
    local r="$1" c="$2" kind="$3" n="$4" file pids="" s0 s1 w0 w1 b0 t0 b1 t1 p0 q0 p1 q1 rc=0 extra=()
    file="$OUT/runs/$kind-$LEVEL-r$r-$c"
    [[ -n "${PID_OF[$c]}" ]] && pids="$(tree_pids "${PID_OF[$c]}" | paste -sd, -)"
    if [[ "$kind" == idle ]]; then
        extra=(--idle-hold-secs "$IDLE_HOLD")
    else
        # Connections open spread over one event interval, so the streams' events are spread
        # in time as a fleet's are: opened all at once, every stream's events would fall into one
        # burst per interval (8,192 in 32 ms at 8192x160), and every proxy's tail would measure
        # that burst, not its steady relay.
        extra=(--duration "$DURATION" --warmup "$WARMUP" --health-url "http://127.0.0.1:${PORT[$c]}/health"
               --ramp-per-ms "$(awk -v n="$n" -v i="${LV_INTERVAL[$LEVEL]}" 'BEGIN {r = n / i; print (r == int(r)) ? r : int(r) + 1}')")
    fi
    [[ -n "$pids" ]] && extra+=(--watch-pids "$pids")
    s0="$(ticks "$UP_PID")"; w0="$(date +%s.%N)"; read -r b0 t0 < <(cpu_jiffies "$LOAD_CPU"); read -r p0 q0 < <(cpus_jiffies "$PROXY_CPUS")
    timeout $((WARMUP + DURATION + IDLE_HOLD + 120)) taskset -c "$LOAD_CPU" "$LG_BIN" streams \
        --target "http://127.0.0.1:${PORT[$c]}" --streams "$n" --max-tokens "$MAX_TOKENS" \
        --prompt-bytes "$PROMPT_BYTES" "${extra[@]}" --json >"$file.json" 2>"$file.txt" || rc=$?
    s1="$(ticks "$UP_PID")"; w1="$(date +%s.%N)"; read -r b1 t1 < <(cpu_jiffies "$LOAD_CPU"); read -r p1 q1 < <(cpus_jiffies "$PROXY_CPUS")
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$r" "$LEVEL" "$c" "$kind" "$file.json" \
        "$(awk -v a="$s0" -v b="$s1" -v h="$CLK_TCK" 'BEGIN {printf "%.3f", (b - a) / h}')" \
        "$(awk -v a="$w0" -v b="$w1" 'BEGIN {printf "%.3f", b - a}')" \
        "$(awk -v a="$b0" -v b="$b1" -v x="$t0" -v y="$t1" 'BEGIN {printf "%.3f", (y > x) ? (b - a) / (y - x) : 0}')" \
        "$(awk -v a="$p0" -v b="$p1" -v x="$q0" -v y="$q1" 'BEGIN {printf "%.3f", (y > x) ? (b - a) / (y - x) : 0}')" \
        "${RSS_FRESH[$c]:-0}" "$rc" >>"$RUNS"
    if [[ "$rc" != 0 ]]; then
        log "round $r $LEVEL $c $kind: loadgen exited $rc (see runs/$(basename "$file").txt)"
    elif [[ "$kind" == streams ]]; then
        log "round $r $LEVEL $c: $(grep -E '^events:|^event delay' "$file.txt" | tr '\n' ' ')"
    fi
}

# ---- run ---------------------------------------------------------------------------------------
declare -A RSS_FRESH=()
LV_DONE=()
n_c=${#CAND_LIST[@]}
est=$(( ${#LEVEL_LIST[@]} * (n_c * (ROUNDS * (WARMUP + DURATION + 3) + IDLE_HOLD + 8)) / 60 + 1 ))
log "levels: ${LEVEL_LIST[*]}; candidates: ${CAND_LIST[*]}; $ROUNDS rounds x ${DURATION} s (+${WARMUP} s warm-up); about $est minutes"
for LEVEL in "${LEVEL_LIST[@]}"; do
    n="${LV_STREAMS[$LEVEL]}"
    need=$(( 2 * n + 256 ))
    if (( need > NOFILE )); then
        NOTES+=("level $LEVEL skipped: a proxy needs about $need descriptors (2 per stream), the hard limit is $NOFILE")
        log "level $LEVEL skipped: needs ~$need descriptors, limit $NOFILE"
        continue
    fi
    start_upstream "${LV_INTERVAL[$LEVEL]}"
    LV_CANDS=()
    for c in "${CAND_LIST[@]}"; do start_candidate "$c" "$n"; LV_CANDS+=("$c"); done
    ok=()
    for c in "${LV_CANDS[@]}"; do
        if [[ "$c" != direct ]] && ! wait_ready "http://127.0.0.1:${PORT[$c]}" 60 "${PID_OF[$c]}"; then
            NOTES+=("$c at $LEVEL: did not become ready in 60 s (see logs/$c-$LEVEL.log)"); log "$c not ready at $LEVEL"; continue
        fi
        if ! check_stream "$c"; then
            NOTES+=("$c at $LEVEL: no 200 streamed answer with [DONE] (see logs/check-$c-$LEVEL.out)"); log "$c failed the stream check at $LEVEL"; continue
        fi
        ok+=("$c")
    done
    sleep 1
    for c in "${ok[@]+"${ok[@]}"}"; do
        RSS_FRESH[$c]="$(kb_sum "${PID_OF[$c]}" VmRSS)"
        [[ "$c" == direct ]] || measured_run 0 "$c" idle "$n"
    done
    for r in $(seq 1 "$ROUNDS"); do
        k=${#ok[@]}
        for i in $(seq 0 $((k - 1))); do
            measured_run "$r" "${ok[$(( (i + r - 1) % k ))]}" streams "$n"
        done
    done
    stop_candidates
    LV_DONE+=("$LEVEL")
done

# ---- report ----------------------------------------------------------------------------------
MACHINE="$(nproc) CPUs, $(awk -F': ' '/^model name/ {print $2; exit}' /proc/cpuinfo), kernel $(uname -r)"
VERSIONS="radixgate $("$RG_BIN" --version 2>/dev/null | awk '{print $NF}' || echo '?'), $(nginx -v 2>&1 | sed 's/^nginx version: //' || echo 'nginx ?'), sglang-router $("$SGL_PY" -c 'import importlib.metadata as m; print(m.version("sglang-router"))' 2>/dev/null || echo 'not installed')"
CMDLINE="scripts/bench-streams.sh --levels $LEVELS --duration $DURATION --warmup $WARMUP --rounds $ROUNDS --candidates $(IFS=,; echo "${CAND_LIST[*]}") --serving-cores $SERVING_CORES --max-tokens $MAX_TOKENS --prompt-bytes $PROMPT_BYTES"
M_MACHINE="$MACHINE" M_VERSIONS="$VERSIONS" M_CMD="$CMDLINE" M_NOTES="$(printf '%s\n' "${NOTES[@]+"${NOTES[@]}"}")" \
M_LEVELS="$(IFS=,; echo "${LV_DONE[*]+"${LV_DONE[*]}"}")" M_CANDS="$(IFS=,; echo "${CAND_LIST[*]}")" M_ROUNDS="$ROUNDS" \
M_DUR="$DURATION" M_WARM="$WARMUP" M_CORES="$SERVING_CORES" M_PCPUS="$PROXY_CPUS" M_LCPU="$LOAD_CPU" M_STAMP="$STAMP" \
M_MAXTOK="$MAX_TOKENS" M_PROMPT="$PROMPT_BYTES" M_IDLE="$IDLE_HOLD" \
python3 - "$OUT" <<'PY'
import csv, json, os, statistics, sys

out = sys.argv[1]
env = os.environ
cands = [c for c in env["M_CANDS"].split(",") if c]
levels = [l for l in env["M_LEVELS"].split(",") if l]
rows = list(csv.DictReader(open(f"{out}/runs.tsv"), delimiter="\t"))
notes = [n for n in env["M_NOTES"].split("\n") if n]
cores = int(env["M_CORES"])
names = {"direct": "direct", "radixgate": "radixgate cache_aware", "nginx": "nginx",
         "sglang-router": "sglang-router cache_aware"}

def load(path):
    try:
        lines = [l for l in open(path) if l.startswith("{")]
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None

for r in rows:
    r["report"] = load(r["file"])

def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None

def parse_level(l):
    n, i = l.split("x")
    return int(n), float(i)

def runs(c, l, kind="streams"):
    return [r for r in rows if r["candidate"] == c and r["level"] == l and r["kind"] == kind]

agg = {}
for l in levels:
    n, interval = parse_level(l)
    direct = {r["round"]: r["report"] for r in runs("direct", l) if r["report"]}
    for c in cands:
        rs = [r for r in runs(c, l) if r["report"]]
        if not runs(c, l):
            continue
        rep = [r["report"] for r in rs]
        def q(key, p):
            return med(x[key][p] for x in rep if x[key]["count"])
        def added(p):
            vals = []
            for r in rs:
                d = direct.get(r["round"])
                if d and d["delay_us"]["count"] and r["report"]["delay_us"]["count"]:
                    vals.append(r["report"]["delay_us"][p] - d["delay_us"][p])
            return med(vals) if c != "direct" else None
        def cpu_per_m(x):
            w = x.get("watch")
            return w["cpu_s"] / x["events"] * 1e6 if w and x["events"] else None
        def rss_open(x):
            w = x.get("watch")
            return w["rss_kb_open_max"] if w else None
        fresh = med(float(r["rss_fresh_kb"]) for r in rs if c != "direct") if c != "direct" else None
        ro = med(rss_open(x) for x in rep)
        idle = [r["report"] for r in runs(c, l, "idle") if r["report"]]
        idle_kb = None
        if idle and idle[0].get("watch") and idle[0]["open_at_end"]:
            w = idle[0]["watch"]
            idle_kb = (w["rss_kb_open_max"] - w["rss_kb_before"]) / idle[0]["open_at_end"]
        errs = {}
        for x in rep:
            for k, v in x["errors"].items():
                errs[k] = errs.get(k, 0) + v
        agg[(c, l)] = {
            "runs": len(rs), "failed_runs": len(runs(c, l)) - len(rs),
            "offered_ev_s": n * 1000.0 / interval,
            "ev_s": med(x["events_per_s"] for x in rep),
            "delay_p50": q("delay_us", "p50"), "delay_p99": q("delay_us", "p99"), "delay_p999": q("delay_us", "p999"),
            "added_p50": added("p50"), "added_p99": added("p99"), "added_p999": added("p999"),
            "ttft_p50": q("ttft_us", "p50"), "ttft_p99": q("ttft_us", "p99"),
            "cpu_s_per_m_events": med(cpu_per_m(x) for x in rep) if c != "direct" else None,
            "rss_fresh_kb": fresh, "rss_open_kb": ro if c != "direct" else None,
            "rss_per_stream_kb": (ro - fresh) / n if c != "direct" and ro and fresh else None,
            "idle_kb_per_conn": idle_kb,
            "health_p99_us": med(x["health"]["p99_us"] for x in rep if x.get("health") and x["health"]["count"]),
            "health_max_us": med(x["health"]["max_us"] for x in rep if x.get("health") and x["health"]["count"]),
            "health_errors": sum(x["health"]["errors"] for x in rep if x.get("health")),
            "errors": errs, "errors_total": sum(errs.values()),
            "open_at_end_min": min((x["open_at_end"] for x in rep), default=None),
            "loadgen_cpu_s": med(x["cpu_s"] for x in rep),
            "load_cpu_busy": med(float(r["load_cpu_busy"]) for r in rs),
            "proxy_cpus_busy": med(float(r["proxy_cpus_busy"]) for r in rs),
            "proxy_share": med(x["watch"]["cpu_s"] / x["window_s"] / cores for x in rep
                               if x.get("watch") and x["window_s"]) if c != "direct" else None,
            "upstream_cpu_share": med(float(r["upstream_cpu_s"]) / float(r["wall_s"]) for r in rs if float(r["wall_s"]) > 0),
        }

def own_load(a):
    """Share of the load CPU the upstream and the load generator took themselves."""
    lg = (a["loadgen_cpu_s"] or 0) / float(env["M_DUR"])
    return (a["upstream_cpu_share"] or 0) + lg

def f_num(v, d=0):
    return "—" if v is None else f"{v:,.{d}f}"
def f_k(v):
    return "—" if v is None else (f"{v / 1000:.1f}k" if v >= 10000 else f"{v:,.0f}")
def f_add(v):
    return "—" if v is None else f"{v:+,.0f}"
def f_mib(v):
    return "—" if v is None else f"{v / 1024:.1f}"

def table(l, cs, detail):
    n, interval = parse_level(l)
    L = []
    L.append(f"| {n:,} streams × {interval:g} ms (offered {f_k(n * 1000 / interval)} ev/s) | "
             + " | ".join(names[c] for c in cs) + " |")
    L.append("|---" * (len(cs) + 1) + "|")
    def row(title, fn):
        L.append(f"| {title} | " + " | ".join(fn(agg[(c, l)], c) for c in cs) + " |")
    row("delivered events/s", lambda a, c: f_k(a["ev_s"]))
    row("event delay p50 / p99 / p99.9 (µs)", lambda a, c: " / ".join(f_num(a[k]) for k in ("delay_p50", "delay_p99", "delay_p999")))
    if "direct" in cs:
        row("added delay p50 / p99 / p99.9 (µs)", lambda a, c: "—" if c == "direct" else " / ".join(f_add(a[k]) for k in ("added_p50", "added_p99", "added_p999")))
    row("TTFT p50 / p99 (µs)", lambda a, c: f"{f_num(a['ttft_p50'])} / {f_num(a['ttft_p99'])}")
    row("proxy CPU-s per million events", lambda a, c: "—" if c == "direct" else f_num(a["cpu_s_per_m_events"], 2))
    row("proxy RSS with the streams open, MiB (KiB per stream)", lambda a, c: "—" if c == "direct" else
        f"{f_mib(a['rss_open_kb'])} ({f_num(a['rss_per_stream_kb'], 1)})")
    row("idle keep-alive KiB per connection", lambda a, c: "—" if c == "direct" else f_num(a["idle_kb_per_conn"], 1))
    row("/health p99 / max while open (µs)", lambda a, c: f"{f_num(a['health_p99_us'])} / {f_num(a['health_max_us'])}")
    row("errors", lambda a, c: str(a["errors_total"]) if not a["errors_total"] else
        f"{a['errors_total']} (" + ", ".join(f"{k} {v}" for k, v in a["errors"].items() if v) + ")")
    if detail:
        row(f"CPU {env['M_PCPUS']}: proxy / all busy", lambda a, c:
            f"{'—' if a['proxy_share'] is None else f_num(a['proxy_share'] * 100) + ' %'} / {f_num((a['proxy_cpus_busy'] or 0) * 100)} %")
        row(f"CPU {env['M_LCPU']}: upstream + load generator / all busy", lambda a, c:
            f"{f_num(own_load(a) * 100)} % / {f_num((a['load_cpu_busy'] or 0) * 100)} %")
        row("load generator CPU-s in the window", lambda a, c: f_num(a["loadgen_cpu_s"], 2))
    return L

placement = (f"proxy pinned to CPU {env['M_PCPUS']}; stream-upstream and the load generator on CPU {env['M_LCPU']}"
             if cores == 1 else
             f"proxy on CPUs {env['M_PCPUS']} (--serving-cores 2): the load generator and the upstream (CPU "
             f"{env['M_LCPU']}) share the proxy's cores, so the proxy competes with its own load")
R = [f"# Streaming through proxies, {env['M_STAMP']}", "", f"`{env['M_CMD']}`", "",
     f"Machine: {env['M_MACHINE']}. {env['M_VERSIONS']}.", "",
     f"Placement: {placement}. Each stream asks max_tokens {env['M_MAXTOK']} (events per answer; the first "
     f"written at once with the head, then one per interval), prompts of ~{env['M_PROMPT']} bytes, distinct per "
     f"connection and request. Medians over {env['M_ROUNDS']} rounds of {env['M_DUR']} s "
     f"(after {env['M_WARM']} s of warm-up), candidates rotated per round. Added delay: the candidate's "
     "event delay minus direct's in the same round. RSS per stream: (largest RSS with the streams open − "
     f"RSS of the freshly started proxy) / streams. Idle keep-alive: N connections each answered one GET "
     f"/health, then held {env['M_IDLE']} s, on the fresh proxy before its streaming runs (RSS delta / N).", ""]
D = []
for l in levels:
    cs = [c for c in cands if (c, l) in agg]
    if not cs:
        continue
    R += table(l, cs, True) + [""]
    D += table(l, cs, False) + [""]
    for c in cs:
        a = agg[(c, l)]
        n, _ = parse_level(l)
        if a["failed_runs"]:
            notes.append(f"{names[c]} at {l}: {a['failed_runs']} run(s) gave no report (see runs/)")
        if a["open_at_end_min"] is not None and a["open_at_end_min"] < n:
            notes.append(f"{names[c]} at {l}: only {a['open_at_end_min']:,} of {n:,} streams were open at the end of a window")
        if a["ev_s"] is not None and a["ev_s"] < 0.9 * a["offered_ev_s"]:
            notes.append(f"{names[c]} at {l}: delivered {f_k(a['ev_s'])} of {f_k(a['offered_ev_s'])} events/s offered")
        busy, own = a["load_cpu_busy"] or 0, own_load(a)
        if own >= 0.9:
            notes.append(f"{names[c]} at {l}: the upstream and the load generator took {own * 100:.0f} % of CPU "
                         f"{env['M_LCPU']}: they may have been the limit, not the proxy")
        pb, ps = a["proxy_cpus_busy"] or 0, a["proxy_share"]
        if c != "direct" and ps is not None and pb - ps >= 0.2:
            notes.append(f"{names[c]} at {l}: other processes or interrupt work took about {(pb - ps) * 100:.0f} % of CPU "
                         f"{env['M_PCPUS']} beside the proxy: its delays include waiting behind them")
        if own < 0.9 and busy >= 0.95:
            notes.append(f"{names[c]} at {l}: CPU {env['M_LCPU']} was {busy * 100:.0f} % busy, "
                         f"{(busy - own) * 100:.0f} points of it other processes: delays include waiting behind them")
if notes:
    R += ["Notes:", ""] + [f"- {x}" for x in notes] + [""]
    D += [f"- {x}" for x in notes if any(k in x for k in ("skipped", "left out", "delivered", "only ",
                                                          "other processes", "may have been the limit"))] + [""]
open(f"{out}/report.md", "w").write("\n".join(R))
open(f"{out}/docs.md", "w").write("\n".join(D).rstrip("\n") + "\n")
json.dump({"command": env["M_CMD"], "machine": env["M_MACHINE"], "versions": env["M_VERSIONS"],
           "serving_cores": cores, "levels": levels, "candidates": cands, "notes": notes,
           "medians": {c: {l: agg[(c, l)] for l in levels if (c, l) in agg} for c in cands},
           "runs": [{k: v for k, v in r.items()} for r in rows]},
          open(f"{out}/raw.json", "w"), indent=1)
PY
cat "$OUT/report.md"
log "report: $OUT/report.md (raw numbers: raw.json; each run: runs/; logs: logs/)"
if [[ "$WRITE_DOCS" == 1 ]]; then
    python3 scripts/bench-docs.py write "${DOCS_SECTION:-streams}" "$OUT/docs.md" --command "$CMDLINE"
fi
