#!/usr/bin/env bash
# Scale in workers (issue 11, deliverable 4): latency through radixgate cache_aware in front of
# 8, 64, 512 and 4,096 workers, with sglang-router 0.3.2 cache_aware beside it where it runs.
#
#   scripts/bench-worker-scale.sh [--sizes 8,64,512,4096] [--duration S] [--rounds N]
#       [--warmup S] [--connections C] [--delay-ms MS] [--start-timeout S] [--no-sglang-router]
#       [--skip-build] [--out DIR] [--write-docs [--docs-section NAME]] [--help]
#
#   --sizes LIST        worker counts (default 8,64,512,4096)
#   --duration S        one measurement, seconds (default 6)
#   --warmup S          load before each measurement, seconds (default 10): past the start-up
#                       transients (the first health round's thousands of connections, closed
#                       together once idle for --upstream-idle-timeout-ms), so steady state is
#                       measured
#   --rounds N          measurements per gateway and size; medians reported (default 3)
#   --connections C     wrk connections (default 8)
#   --delay-ms MS       pause of each connection after an answer (wrk delay(); default 2): a
#                       fixed, moderate offered load rather than the gateway's peak
#   --start-timeout S   longest wait for a gateway to report every worker healthy (default 300);
#                       a gateway that does not is recorded as such, not measured
#   --no-sglang-router  radixgate only
#   --skip-build        use target/release/{radixgate,sim-worker} as they are
#   --out DIR           results folder (default results/bench-worker-scale-<stamp>)
#
# One sim-worker process serves the largest size's consecutive free ports (one monoio thread;
# --token-interval-ms 0, one output token, --tokenizer approx), on CPU 1 with wrk; size N uses
# the first N. Each gateway in turn is pinned whole to CPU 0: radixgate --cpu-list 0 with a
# --config file listing the N URLs, default health-check and worker-metrics settings, and the
# same with --worker-metrics-interval-secs 0 (radixgate-no-telemetry: shows what scraping every
# worker's /metrics every 5 s costs); sglang-router 0.3.2 from PyPI in .venv/,
# TOKIO_WORKER_THREADS=1, the URLs on its command line. Measurement starts only once the gateway
# reports all N workers healthy (radixgate: GET /workers; sglang-router: "healthy_workers" of
# GET /readiness). Load: wrk -t1 -cC, OpenAI chat completions (max_tokens 1) rotating over 64
# bodies (8 tenants' ~1.5k-character system prompts, distinct questions), each connection
# pausing --delay-ms after every answer; a --warmup load per start. radixgate starts in about a
# second, so each round starts every (variant, size) afresh in a rotated order; sglang-router
# starts once per size and runs its rounds then. Reports p50/p99 per size and gateway (medians
# over rounds), achieved req/s, start-up time, and p99(N)/p99(first size).
#
# Writes results/bench-worker-scale-<stamp>/report.md (printed at the end) and raw.tsv; --write-docs
# also puts the report's table into docs/benchmarks.md (section worker-scale, or NAME). The
# open-file limit is raised to 4 x N + 1024 for the processes (the hard limit must allow it).
# Defaults take about 5-10 minutes. Only 127.0.0.1; every process started here is stopped by
# PID on exit.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

SIZES="8,64,512,4096"
DURATION=6
WARMUP=10
ROUNDS=3
CONNECTIONS=8
DELAY=2
START_TIMEOUT=300
SGLANG=1
BUILD=1
OUT=""
WRITE_DOCS=0
DOCS_SECTION=worker-scale
SGLANG_ROUTER_VERSION=0.3.2
PROXY_CPU=0
LOAD_CPU=1

usage() { sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
    case "$1" in
        --sizes) SIZES="$2"; shift 2 ;;
        --duration) DURATION="$2"; shift 2 ;;
        --warmup) WARMUP="$2"; shift 2 ;;
        --rounds) ROUNDS="$2"; shift 2 ;;
        --connections) CONNECTIONS="$2"; shift 2 ;;
        --delay-ms) DELAY="$2"; shift 2 ;;
        --start-timeout) START_TIMEOUT="$2"; shift 2 ;;
        --no-sglang-router) SGLANG=0; shift ;;
        --skip-build) BUILD=0; shift ;;
        --out) OUT="$2"; shift 2 ;;
        --write-docs) WRITE_DOCS=1; shift ;;
        --docs-section) DOCS_SECTION="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown option: $1 (see --help)" >&2; exit 2 ;;
    esac
done
for v in DURATION ROUNDS CONNECTIONS START_TIMEOUT; do
    [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || { echo "$v: a whole number >= 1" >&2; exit 2; }
done
[[ "$DELAY" =~ ^[0-9]+$ ]] || { echo "--delay-ms: a whole number" >&2; exit 2; }
IFS=',' read -r -a SIZE_LIST <<<"$SIZES"
for n in "${SIZE_LIST[@]}"; do
    [[ "$n" =~ ^[1-9][0-9]*$ ]] && (( n <= 16384 )) || { echo "--sizes: whole numbers 1..16384, not $n" >&2; exit 2; }
done
MAXN=0; for n in "${SIZE_LIST[@]}"; do (( n > MAXN )) && MAXN=$n; done
NOFILE=$(( 4 * MAXN + 1024 ))
if (( $(ulimit -n) < NOFILE )); then
    ulimit -n "$NOFILE" 2>/dev/null || { echo "cannot raise the open-file limit to $NOFILE (hard limit $(ulimit -Hn))" >&2; exit 1; }
fi

STAMP="$(date +%Y%m%d-%H%M%S)"
OUT="${OUT:-results/bench-worker-scale-$STAMP}"
mkdir -p "$OUT/logs"
OUT="$(cd "$OUT" && pwd)"
LOGS="$OUT/logs"
log() { printf '[bench-worker-scale %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

PIDS=()
# shellcheck source=lib/procs.sh
source "$ROOT/scripts/lib/procs.sh"

stop_pid() {
    local pid="$1" i
    kill -0 "$pid" 2>/dev/null || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}
cleanup() {
    local rc=$? p
    trap - EXIT INT TERM
    for p in "${PIDS[@]}"; do stop_pid "$p"; done
    exit "$rc"
}
trap cleanup EXIT
trap 'echo; echo "interrupted" >&2; exit 130' INT TERM

# A listener port below the ephemeral range (a gateway with thousands of workers dials
# thousands of connections), in lib/procs.sh.
free_port() { free_port_in 20000 30000; }
# First BASE (from 31000, in steps of 1000) where ports BASE..BASE+N-1 have no listener.
free_range() {
    local n="$1"
    python3 - "$n" <<'PY'
import socket, sys
n = int(sys.argv[1])
for base in range(31000, 65535 - n, 1000):
    ok = True
    socks = []
    for p in range(base, base + n):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", p))
        except OSError:
            ok = False
        socks.append(s)
        if not ok:
            break
    for s in socks:
        s.close()
    if ok:
        print(base)
        sys.exit(0)
sys.exit(1)
PY
}

command -v wrk >/dev/null || { log "installing wrk (apt-get)"; timeout 300 apt-get install -y -q wrk >"$LOGS/apt-wrk.log" 2>&1 || true; }
command -v wrk >/dev/null || { echo "wrk is missing and could not be installed" >&2; exit 1; }
if [[ "$BUILD" == 1 ]]; then
    log "building release binaries (cargo build --release -p radixgate -p loadtest)"
    cargo build --release -p radixgate -p loadtest >"$LOGS/build.log" 2>&1 || { tail -30 "$LOGS/build.log" >&2; exit 1; }
fi
RG_BIN="$ROOT/target/release/radixgate"
SIM_BIN="$ROOT/target/release/sim-worker"
for b in "$RG_BIN" "$SIM_BIN"; do [[ -x "$b" ]] || { echo "missing $b (build it)" >&2; exit 1; }; done

GATEWAYS=(radixgate)
NOTES=()
SGL_PY="$ROOT/.venv/bin/python"
if [[ "$SGLANG" == 1 ]]; then
    have="$("$SGL_PY" -c 'import importlib.metadata as m; print(m.version("sglang-router"))' 2>/dev/null || true)"
    if [[ "$have" != "$SGLANG_ROUTER_VERSION" ]]; then
        log "installing sglang-router==$SGLANG_ROUTER_VERSION into .venv/ (at most 5 minutes)"
        [[ -x "$SGL_PY" ]] || timeout 120 python3 -m venv .venv >"$LOGS/venv.log" 2>&1 || true
        [[ -x "$SGL_PY" ]] && { timeout 300 "$SGL_PY" -m pip install -q "sglang-router==$SGLANG_ROUTER_VERSION" >>"$LOGS/venv.log" 2>&1 || true; }
        have="$("$SGL_PY" -c 'import importlib.metadata as m; print(m.version("sglang-router"))' 2>/dev/null || true)"
    fi
    if [[ "$have" == "$SGLANG_ROUTER_VERSION" ]]; then
        GATEWAYS+=(sglang-router)
    else
        NOTES+=("sglang-router left out: sglang-router==$SGLANG_ROUTER_VERSION could not be installed (see logs/venv.log)")
    fi
fi

cat >"$OUT/chat.lua" <<'LUA'
-- 64 chat completions: 8 tenants' system prompts (~1.5k characters) x 8 distinct questions,
-- sent in rotation; each connection pauses DELAY_MS (first argument) after every answer.
local words = {}
for w in ("the a of to and in that is for it as with was on be by this are from or at an which "
  .. "cache prefix request worker router gateway model token prompt latency throughput memory "
  .. "conversation answer question system user assistant context window batch queue schedule"):gmatch("%S+") do
  words[#words + 1] = w
end
local reqs, pause, i = {}, 0, 0
local r = 4242
local function text(len)
  local p, n = {}, 0
  while n < len do
    r = (r * 1103515245 + 12345) % 2147483648
    local w = words[r % #words + 1]
    p[#p + 1] = w
    n = n + #w + 1
  end
  return table.concat(p, " ")
end
function init(args)
  pause = tonumber(args[1]) or 0
  for t = 1, 8 do
    local system = "You are assistant number " .. t .. ". " .. text(1500)
    for q = 1, 8 do
      local body = '{"model":"meta-llama/Llama-3.1-8B-Instruct","max_tokens":1,"stream":false,'
        .. '"messages":[{"role":"system","content":"' .. system .. '"},'
        .. '{"role":"user","content":"question ' .. q .. ': ' .. text(200) .. '"}]}'
      reqs[#reqs + 1] = wrk.format("POST", "/v1/chat/completions",
        { ["Content-Type"] = "application/json" }, body)
    end
  end
end
function request()
  i = i % #reqs + 1
  return reqs[i]
end
function delay()
  return pause
end
LUA

pct() { awk -v p="$1" '$1==p { v=$2; if (v ~ /us$/) { sub(/us$/,"",v); print v } else if (v ~ /ms$/) { sub(/ms$/,"",v); print v*1000 } else if (v ~ /s$/) { sub(/s$/,"",v); print v*1000000 } }'; }
rps() { awk '/Requests\/sec/ { print $2 }'; }
errs() { awk '/Non-2xx|Socket errors/ { print }' | tr '\n' ' '; }
median() { sort -g | awk '{ a[NR]=$1 } END { if (NR == 0) print "nan"; else if (NR%2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2 }'; }
code() { curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$1" || true; }

# Healthy workers gateway KIND on PORT reports.
healthy() {
    local kind="$1" port="$2"
    if [[ "$kind" == radixgate ]]; then
        curl -s --max-time 10 "http://127.0.0.1:$port/workers" \
            | python3 -c 'import json,sys; print(sum(1 for w in json.load(sys.stdin)["workers"] if w["healthy"]))' 2>/dev/null || echo 0
    else
        curl -s --max-time 10 "http://127.0.0.1:$port/readiness" \
            | python3 -c 'import json,sys; print(json.load(sys.stdin)["healthy_workers"])' 2>/dev/null || echo 0
    fi
}

printf 'workers\tgateway\tround\tp50_us\tp99_us\trps\terrors\n' >"$OUT/raw.tsv"
declare -A START_S=() STATUS=()

# One sim-worker process serves the largest size's ports; size N uses the first N of them.
base="$(free_range "$MAXN")" || { echo "no $MAXN consecutive free ports" >&2; exit 1; }
last=$(( base + MAXN - 1 ))
log "sim-worker on ports $base-$last"
taskset -c "$LOAD_CPU" "$SIM_BIN" --ports "$base-$last" --tokenizer approx --token-interval-ms 0 \
    --default-max-tokens 1 >"$LOGS/sim.log" 2>&1 &
sim_pid=$!; PIDS+=("$sim_pid")
for _ in $(seq 1 600); do
    [[ "$(grep -c 'listening on' "$LOGS/sim.log" || true)" -ge "$MAXN" ]] && break
    kill -0 "$sim_pid" 2>/dev/null || break
    sleep 0.1
done
[[ "$(grep -c 'listening on' "$LOGS/sim.log" || true)" -ge "$MAXN" ]] \
    || { echo "sim-worker did not bind $MAXN ports:" >&2; tail "$LOGS/sim.log" >&2; exit 1; }
for n in "${SIZE_LIST[@]}"; do
    urls=(); for p in $(seq "$base" $(( base + n - 1 ))); do urls+=("http://127.0.0.1:$p"); done
    { printf 'worker-urls = ['; printf '"%s",' "${urls[@]}" | sed 's/,$//'; printf ']\n'; } >"$OUT/workers-$n.toml"
done

# Start gateway G for size N on a free port; sets GPID and GPORT, records start-up in START_S and
# STATUS; returns 1 when not every worker is healthy within --start-timeout.
start_gateway() {
    local g="$1" n="$2" t0 h=0 ok=0 mport urls=()
    GPORT="$(free_port)"; mport="$(free_port)"
    t0=$(date +%s.%N)
    case "$g" in
        radixgate|radixgate-no-telemetry)
            local extra=()
            [[ "$g" == radixgate-no-telemetry ]] && extra=(--worker-metrics-interval-secs 0)
            taskset -c "$PROXY_CPU" "$RG_BIN" --config "$OUT/workers-$n.toml" --host 127.0.0.1 --port "$GPORT" \
                --prometheus-host 127.0.0.1 --prometheus-port "$mport" --cpu-list "$PROXY_CPU" \
                --policy cache_aware --log-level warn "${extra[@]}" >>"$LOGS/$g-$n.log" 2>&1 & ;;
        sglang-router)
            for p in $(seq "$base" $(( base + n - 1 ))); do urls+=("http://127.0.0.1:$p"); done
            TOKIO_WORKER_THREADS=1 taskset -c "$PROXY_CPU" "$SGL_PY" -m sglang_router.launch_router \
                --worker-urls "${urls[@]}" --policy cache_aware --host 127.0.0.1 --port "$GPORT" \
                --prometheus-host 127.0.0.1 --prometheus-port "$mport" --log-level warn \
                --worker-startup-timeout-secs "$START_TIMEOUT" >>"$LOGS/$g-$n.log" 2>&1 & ;;
    esac
    GPID=$!; PIDS+=("$GPID")
    while :; do
        h="$(healthy "${g%-no-telemetry}" "$GPORT")"
        if (( h >= n )); then ok=1; break; fi
        kill -0 "$GPID" 2>/dev/null || break
        (( $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { print int(b - a) }') < START_TIMEOUT )) || break
        sleep 0.5
    done
    START_S[$n,$g]=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    if (( ok == 0 )); then
        if kill -0 "$GPID" 2>/dev/null; then
            STATUS[$n,$g]="not all workers healthy after ${START_TIMEOUT} s ($h of $n)"
        else
            STATUS[$n,$g]="exited during start-up ($h of $n healthy; see logs/$g-$n.log)"
        fi
        log "N=$n $g: ${STATUS[$n,$g]}"
        stop_pid "$GPID"
        return 1
    fi
    STATUS[$n,$g]=ok
    log "N=$n $g: all $n workers healthy after ${START_S[$n,$g]} s"
}
measure() {
    local g="$1" n="$2" r="$3" out
    out=$(taskset -c "$LOAD_CPU" timeout $((DURATION + 60)) wrk -t1 -c"$CONNECTIONS" -d"${DURATION}s" --latency \
        -s "$OUT/chat.lua" "http://127.0.0.1:$GPORT" -- "$DELAY" 2>&1 || true)
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$n" "$g" "$r" "$(pct 50% <<<"$out")" "$(pct 99% <<<"$out")" \
        "$(rps <<<"$out")" "$(errs <<<"$out")" >>"$OUT/raw.tsv"
    log "N=$n $g round $r: $(tail -1 "$OUT/raw.tsv" | cut -f4-)"
}
warm() {
    taskset -c "$LOAD_CPU" timeout 60 wrk -t1 -c"$CONNECTIONS" -d"${WARMUP}s" -s "$OUT/chat.lua" \
        "http://127.0.0.1:$GPORT" -- "$DELAY" >/dev/null 2>&1 || true
}

# radixgate starts in about a second at any size: every round starts each (variant, size) afresh,
# in an order rotated round by round, so drift on a shared machine hits every size alike.
RG_VARIANTS=(radixgate radixgate-no-telemetry)
combos=()
for n in "${SIZE_LIST[@]}"; do for g in "${RG_VARIANTS[@]}"; do combos+=("$g:$n"); done; done
for r in $(seq 1 "$ROUNDS"); do
    k=${#combos[@]}
    for i in $(seq 0 $(( k - 1 ))); do
        c="${combos[$(( (i + (r - 1) * 3) % k ))]}"
        g="${c%%:*}"; n="${c##*:}"
        [[ "${STATUS[$n,$g]:-ok}" == ok ]] || continue
        start_gateway "$g" "$n" || continue
        warm
        measure "$g" "$n" "$r"
        stop_pid "$GPID"
    done
done
# sglang-router needs much longer to start at large sizes: once per size, then its rounds.
if [[ " ${GATEWAYS[*]} " == *" sglang-router "* ]]; then
    for n in "${SIZE_LIST[@]}"; do
        start_gateway sglang-router "$n" || continue
        warm
        for r in $(seq 1 "$ROUNDS"); do measure sglang-router "$n" "$r"; done
        stop_pid "$GPID"
    done
fi
GATEWAYS=("${RG_VARIANTS[@]}" "${GATEWAYS[@]:1}")

# ---- report ----------------------------------------------------------------------------------
med() { awk -F'\t' -v n="$1" -v g="$2" -v c="$3" 'NR > 1 && $1 == n && $2 == g && $c != "" { print $c }' "$OUT/raw.tsv" | median; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a > 0 && b == b + 0) printf "%.2f×", b / a; else print "—" }'; }
first="${SIZE_LIST[0]}"
{
    echo "## Scale in workers ($(date -u +'%Y-%m-%d %H:%M UTC'))"
    echo
    echo "\`scripts/bench-worker-scale.sh --sizes $SIZES --duration $DURATION --rounds $ROUNDS --warmup $WARMUP --connections $CONNECTIONS --delay-ms $DELAY\`"
    echo
    echo "Machine: $(nproc) CPUs, $(awk -F': ' '/model name/ { print $2; exit }' /proc/cpuinfo), kernel $(uname -r), load average $(cut -d' ' -f1-3 /proc/loadavg) at the end."
    echo "Gateway pinned whole to CPU $PROXY_CPU; one sim-worker process (all N ports) and wrk on CPU $LOAD_CPU."
    echo "Load: wrk -t1 -c$CONNECTIONS, chat completions rotating over 64 bodies (8 shared system prompts), ${DELAY} ms pause per connection after each answer; medians of $ROUNDS × ${DURATION} s."
    echo
    echo "radixgate-no-telemetry: the same gateway with --worker-metrics-interval-secs 0 (no scrape of every worker's /metrics every 5 s)."
    echo
    echo "<!-- docs -->"
    echo "| workers | gateway (cache_aware) | start-up until all healthy (s) | p50 (µs) | p99 (µs) | req/s | p99 / p99 at $first |"
    echo "|---|---|---|---|---|---|---|"
    for n in "${SIZE_LIST[@]}"; do
        for g in "${GATEWAYS[@]}"; do
            if [[ "${STATUS[$n,$g]:-}" != ok ]]; then
                echo "| $n | $g | ${START_S[$n,$g]:-—} | ${STATUS[$n,$g]:-not run} | | | |"
                continue
            fi
            p99=$(med "$n" "$g" 5); p99f=$(med "$first" "$g" 5)
            echo "| $n | $g | ${START_S[$n,$g]} | $(med "$n" "$g" 4) | $p99 | $(med "$n" "$g" 6) | $(ratio "$p99f" "$p99") |"
        done
    done
    echo
    for note in "${NOTES[@]}"; do echo "- $note"; done
    echo "<!-- /docs -->"
    echo
    echo "Per round (raw.tsv):"
    echo
    echo '```'
    column -t -s $'\t' "$OUT/raw.tsv"
    echo '```'
} >"$OUT/report.md"
cat "$OUT/report.md"
if [[ "$WRITE_DOCS" == 1 ]]; then
    python3 scripts/bench-docs.py write "$DOCS_SECTION" "$OUT/report.md" --command "scripts/bench-worker-scale.sh --sizes $SIZES --duration $DURATION --rounds $ROUNDS --warmup $WARMUP --connections $CONNECTIONS --delay-ms $DELAY$([[ "$SGLANG" == 1 ]] || echo ' --no-sglang-router')"
fi
