#!/usr/bin/env bash
# Tail latency under eviction (issue 11, deliverable 3): p50/p99 at one connection through
# radixgate cache_aware while its tree writer evicts a tree of more than 10 M characters, beside
# the same traffic through a radixgate that never evicts.
#
#   scripts/bench-eviction.sh [--duration S] [--rounds N] [--workers W] [--max-tree-size C]
#       [--prompt-chars C] [--filler-delay-ms MS] [--skip-build] [--out DIR]
#       [--write-docs [--docs-section NAME]] [--help]
#
#   --duration S          probe window per condition and round, seconds (default 8)
#   --rounds N            interleaved rounds, the order of the two conditions alternating (default 5)
#   --workers W           simulated workers, one sim-worker process (default 8)
#   --max-tree-size C     the evicting gateway's --max-tree-size, characters per worker
#                         (default 3000000; W x C must be at least 10 M: that is what its tree holds)
#   --prompt-chars C      characters of each filler prompt (default 8192)
#   --filler-delay-ms MS  pause of the filler after each answer (wrk delay(); default 3)
#   --skip-build          use target/release/{radixgate,sim-worker} as they are
#   --out DIR             results folder (default results/bench-eviction-<stamp>)
#
# Set-up (a 2-core machine): one sim-worker process serving W ports, answering at once
# (--token-interval-ms 0, one output token, --tokenizer approx), and every load generator on
# CPU 1; two radixgate --policy cache_aware gateways, each pinned whole to CPU 0 (taskset on
# the process, so its tree writer shares the serving core's CPU: the strict case; --cpu-list 0):
#   (a) no eviction  --max-tree-size 10^12 --eviction-interval 3600
#   (b) evicting     --max-tree-size C --eviction-interval 1 (a periodic pass every second) and
#                    the writer's immediate eviction of a worker 10 % over C
# Both trees are first filled (wrk, distinct prompts, as fast as the gateway takes them) until
# they hold 0.95 x W x C characters (radixgate_tree_chars). Then each round, per condition: a
# filler (wrk -c2, distinct /generate prompts of --prompt-chars characters under 64 shared
# tenant prefixes, paced by --filler-delay-ms) keeps inserting ~1-3 M characters a second, so
# (b) evicts about as much every second (all of it beyond C per worker), while the probe (wrk
# -t1 -c1 --latency, one fixed 1 KiB /generate body) measures p50/p99. The gateways' /metrics
# (radixgate_tree_{chars,nodes,evicted_chars,evictions}) are read before and after each probe
# window: the report shows what the tree held and how many characters were evicted during it.
# Figures are medians over rounds; ratio = (b) / (a).
#
# Writes results/bench-eviction-<stamp>/report.md (printed at the end) and raw.tsv; --write-docs
# also puts the report's table into docs/benchmarks.md (section eviction, or NAME). Defaults
# take about 3 minutes. Only 127.0.0.1; every process started here is stopped by PID on exit.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

DURATION=8
ROUNDS=5
WORKERS=8
MAX_TREE=3000000
PROMPT_CHARS=8192
FILLER_DELAY=3
BUILD=1
OUT=""
WRITE_DOCS=0
DOCS_SECTION=eviction
PROXY_CPU=0
LOAD_CPU=1

usage() { sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
    case "$1" in
        --duration) DURATION="$2"; shift 2 ;;
        --rounds) ROUNDS="$2"; shift 2 ;;
        --workers) WORKERS="$2"; shift 2 ;;
        --max-tree-size) MAX_TREE="$2"; shift 2 ;;
        --prompt-chars) PROMPT_CHARS="$2"; shift 2 ;;
        --filler-delay-ms) FILLER_DELAY="$2"; shift 2 ;;
        --skip-build) BUILD=0; shift ;;
        --out) OUT="$2"; shift 2 ;;
        --write-docs) WRITE_DOCS=1; shift ;;
        --docs-section) DOCS_SECTION="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown option: $1 (see --help)" >&2; exit 2 ;;
    esac
done
for v in DURATION ROUNDS WORKERS MAX_TREE PROMPT_CHARS; do
    [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || { echo "$v: a whole number >= 1" >&2; exit 2; }
done
[[ "$FILLER_DELAY" =~ ^[0-9]+$ ]] || { echo "--filler-delay-ms: a whole number" >&2; exit 2; }
(( WORKERS * MAX_TREE >= 10000000 )) || { echo "--workers x --max-tree-size must be >= 10000000" >&2; exit 2; }
(( WORKERS <= 256 )) || { echo "--workers: at most 256" >&2; exit 2; }

STAMP="$(date +%Y%m%d-%H%M%S)"
OUT="${OUT:-results/bench-eviction-$STAMP}"
mkdir -p "$OUT/logs"
OUT="$(cd "$OUT" && pwd)"
LOGS="$OUT/logs"
log() { printf '[bench-eviction %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

PIDS=()
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

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_ready() {
    local url="$1" secs="$2" pid="$3" i
    for i in $(seq 1 $((secs * 5))); do
        [[ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$url" || true)" == 200 ]] && return 0
        kill -0 "$pid" 2>/dev/null || return 1
        sleep 0.2
    done
    return 1
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

# ---- wrk scripts -----------------------------------------------------------------------------
cat >"$OUT/probe.lua" <<'LUA'
-- One fixed /generate body of 1 KiB of text, the same for every request and both gateways.
local words = { "cache", "prefix", "probe", "latency", "worker", "gateway", "tree", "token" }
local parts, n, i = {}, 0, 0
while n < 1024 do
  i = i + 1
  local w = words[(i * 7) % #words + 1] .. i
  parts[#parts + 1] = w
  n = n + #w + 1
end
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"text":"probe: ' .. table.concat(parts, " ") .. '","sampling_params":{"max_new_tokens":1}}'
LUA
cat >"$OUT/filler.lua" <<'LUA'
-- Distinct /generate prompts: one of 64 tenant prefixes (a quarter of the prompt, shared),
-- then a unique session number and words. Arguments: TAG CHARS DELAY_MS.
local words = {}
for w in ("the a of to and in that is for it as with was on be by this are from or at an which "
  .. "cache prefix request worker router gateway model token prompt latency throughput memory "
  .. "conversation answer question system user assistant context window batch queue schedule "
  .. "server client network socket buffer kernel thread process core pool connection stream"):gmatch("%S+") do
  words[#words + 1] = w
end
local tag, chars, pause, counter = "fill", 4096, 0, 0
local tenants = {}
function init(args)
  tag = args[1] or tag
  chars = tonumber(args[2]) or chars
  pause = tonumber(args[3]) or 0
  math.randomseed(os.time() + #tag)
  local r = 12345
  for t = 1, 64 do
    local p, n = { "tenant " .. t .. " system prompt:" }, 0
    while n < chars / 4 do
      r = (r * 1103515245 + 12345) % 2147483648
      local w = words[r % #words + 1]
      p[#p + 1] = w
      n = n + #w + 1
    end
    tenants[t] = table.concat(p, " ")
  end
end
function request()
  counter = counter + 1
  local head = tenants[counter % 64 + 1] .. " session " .. tag .. "-" .. counter .. ":"
  local p, n = { head }, #head
  while n < chars do
    local w = words[math.random(#words)]
    p[#p + 1] = w
    n = n + #w + 1
  end
  local body = '{"text":"' .. table.concat(p, " ") .. '","sampling_params":{"max_new_tokens":1}}'
  return wrk.format("POST", "/generate", { ["Content-Type"] = "application/json" }, body)
end
function delay()
  return pause
end
LUA

# ---- processes -------------------------------------------------------------------------------
ports="0"; for _ in $(seq 2 "$WORKERS"); do ports+=",0"; done
taskset -c "$LOAD_CPU" "$SIM_BIN" --ports "$ports" --tokenizer approx --token-interval-ms 0 \
    --default-max-tokens 1 >"$LOGS/sim-worker.log" 2>&1 &
SIM_PID=$!; PIDS+=("$SIM_PID")
for _ in $(seq 1 100); do
    [[ "$(grep -c 'listening on' "$LOGS/sim-worker.log" || true)" -ge "$WORKERS" ]] && break
    kill -0 "$SIM_PID" 2>/dev/null || break
    sleep 0.1
done
mapfile -t URLS < <(awk '/listening on/ { print "http://" $NF }' "$LOGS/sim-worker.log")
[[ ${#URLS[@]} -eq "$WORKERS" ]] || { echo "sim-worker did not come up:" >&2; tail "$LOGS/sim-worker.log" >&2; exit 1; }

declare -A GW_PORT=() MET_PORT=() GW_PID=()
start_gw() {
    local name="$1"; shift
    GW_PORT[$name]="$(free_port)"; MET_PORT[$name]="$(free_port)"
    taskset -c "$PROXY_CPU" "$RG_BIN" --host 127.0.0.1 --port "${GW_PORT[$name]}" \
        --prometheus-host 127.0.0.1 --prometheus-port "${MET_PORT[$name]}" --cpu-list "$PROXY_CPU" \
        --policy cache_aware --worker-urls "${URLS[@]}" --log-level warn "$@" >"$LOGS/radixgate-$name.log" 2>&1 &
    GW_PID[$name]=$!; PIDS+=("$!")
    wait_ready "http://127.0.0.1:${GW_PORT[$name]}/readiness" 60 "${GW_PID[$name]}" \
        || { echo "radixgate ($name) did not come up:" >&2; tail "$LOGS/radixgate-$name.log" >&2; exit 1; }
}
start_gw a --max-tree-size 1000000000000 --eviction-interval 3600
start_gw b --max-tree-size "$MAX_TREE" --eviction-interval 1

# A gauge of gateway NAME's /metrics, as an integer (0 when absent).
metric() {
    curl -s --max-time 5 "http://127.0.0.1:${MET_PORT[$1]}/metrics" \
        | awk -v m="$2" '$1 == m { printf "%.0f\n", $2; found = 1 } END { if (!found) print 0 }'
}
# CPU time (clock ticks, utime + stime) of gateway NAME's tree writer thread.
writer_ticks() {
    local t
    for t in /proc/"${GW_PID[$1]}"/task/*; do
        if [[ "$(cat "$t/comm" 2>/dev/null)" == radixgate-tree* ]]; then
            awk '{ sub(/^.*\) /, ""); print $12 + $13 }' "$t/stat"; return
        fi
    done
    echo 0
}
pct() { awk -v p="$1" '$1==p { v=$2; if (v ~ /us$/) { sub(/us$/,"",v); print v } else if (v ~ /ms$/) { sub(/ms$/,"",v); print v*1000 } else if (v ~ /s$/) { sub(/s$/,"",v); print v*1000000 } }'; }
rps() { awk '/Requests\/sec/ { print $2 }'; }
median() { sort -g | awk '{ a[NR]=$1 } END { if (NR == 0) print "nan"; else if (NR%2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2 }'; }

# ---- fill ------------------------------------------------------------------------------------
TARGET=$(( WORKERS * MAX_TREE * 95 / 100 ))
for g in a b; do
    log "filling gateway ($g) to $TARGET characters"
    t0=$(date +%s)
    while (( $(metric "$g" radixgate_tree_chars) < TARGET )); do
        (( $(date +%s) - t0 < 120 )) || { echo "gateway ($g) did not reach $TARGET characters in 120 s" >&2; exit 1; }
        taskset -c "$LOAD_CPU" timeout 30 wrk -t1 -c4 -d1s -s "$OUT/filler.lua" \
            "http://127.0.0.1:${GW_PORT[$g]}" -- "fill$g" "$PROMPT_CHARS" 0 >>"$LOGS/fill-$g.log" 2>&1 || true
    done
    log "gateway ($g): $(metric "$g" radixgate_tree_chars) characters, $(metric "$g" radixgate_tree_nodes) nodes"
done
for g in a b; do  # warm the probe's path
    taskset -c "$LOAD_CPU" timeout 30 wrk -t1 -c1 -d1s -s "$OUT/probe.lua" "http://127.0.0.1:${GW_PORT[$g]}/generate" >/dev/null 2>&1 || true
done

# ---- rounds ----------------------------------------------------------------------------------
printf 'round\tgateway\tp50_us\tp99_us\tprobe_rps\tfiller_rps\tchars_before\tchars_after\tnodes_after\tevicted_chars\tevictions\tapplied\twriter_cpu_ms\n' >"$OUT/raw.tsv"
measure() {
    local r="$1" g="$2" fpid out fout c0 e0 n0 a0 c1 e1 n1 a1 nodes w0 w1 hz
    c0=$(metric "$g" radixgate_tree_chars); e0=$(metric "$g" radixgate_tree_evicted_chars)
    n0=$(metric "$g" radixgate_tree_evictions); a0=$(metric "$g" radixgate_tree_inserts_applied)
    w0=$(writer_ticks "$g")
    taskset -c "$LOAD_CPU" timeout $((DURATION + 30)) wrk -t1 -c2 -d"$((DURATION + 2))s" -s "$OUT/filler.lua" \
        "http://127.0.0.1:${GW_PORT[$g]}" -- "r$r$g" "$PROMPT_CHARS" "$FILLER_DELAY" >"$LOGS/filler-$r-$g.log" 2>&1 &
    fpid=$!
    sleep 1
    out=$(taskset -c "$LOAD_CPU" timeout $((DURATION + 30)) wrk -t1 -c1 -d"${DURATION}s" --latency -s "$OUT/probe.lua" \
        "http://127.0.0.1:${GW_PORT[$g]}/generate" 2>&1 || true)
    c1=$(metric "$g" radixgate_tree_chars); e1=$(metric "$g" radixgate_tree_evicted_chars)
    n1=$(metric "$g" radixgate_tree_evictions); a1=$(metric "$g" radixgate_tree_inserts_applied)
    nodes=$(metric "$g" radixgate_tree_nodes)
    w1=$(writer_ticks "$g"); hz=$(getconf CLK_TCK)
    wait "$fpid" || true
    fout=$(rps <"$LOGS/filler-$r-$g.log")
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$r" "$g" "$(pct 50% <<<"$out")" "$(pct 99% <<<"$out")" \
        "$(rps <<<"$out")" "${fout:-0}" "$c0" "$c1" "$nodes" $((e1 - e0)) $((n1 - n0)) $((a1 - a0)) \
        $(( (w1 - w0) * 1000 / hz )) >>"$OUT/raw.tsv"
    log "round $r ($g): $(tail -1 "$OUT/raw.tsv" | cut -f3-)"
}
for r in $(seq 1 "$ROUNDS"); do
    if (( r % 2 )); then order="a b"; else order="b a"; fi
    for g in $order; do measure "$r" "$g"; done
done

# ---- report ----------------------------------------------------------------------------------
col() { awk -F'\t' -v g="$1" -v c="$2" 'NR > 1 && $2 == g { print $c }' "$OUT/raw.tsv" | median; }
declare -A M
for g in a b; do for c in 3 4 5 6 7 8 9 10 11 12 13; do M[$g,$c]=$(col "$g" "$c"); done; done
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a > 0) printf "%.2f", b / a; else print "n/a" }'; }
fmt() { awk -v x="$1" 'BEGIN { printf "%.1f", x / 1e6 }'; }
{
    echo "## Tail latency under eviction ($(date -u +'%Y-%m-%d %H:%M UTC'))"
    echo
    echo "\`scripts/bench-eviction.sh --duration $DURATION --rounds $ROUNDS --workers $WORKERS --max-tree-size $MAX_TREE --prompt-chars $PROMPT_CHARS --filler-delay-ms $FILLER_DELAY\`"
    echo
    echo "Machine: $(nproc) CPUs, $(awk -F': ' '/model name/ { print $2; exit }' /proc/cpuinfo), kernel $(uname -r), load average $(cut -d' ' -f1-3 /proc/loadavg) at the end."
    echo "Each gateway pinned whole to CPU $PROXY_CPU (its tree writer too); sim-worker ($WORKERS ports), filler and probe on CPU $LOAD_CPU."
    echo "Medians of $ROUNDS interleaved rounds; probe: wrk -c1, ${DURATION} s, one fixed 1 KiB /generate body; filler: wrk -c2, distinct ${PROMPT_CHARS}-character prompts."
    echo
    echo "<!-- docs -->"
    echo "| condition | p50 (µs) | p99 (µs) | probe req/s | filler req/s | tree chars (M) during the window | tree nodes | chars evicted in the window (M) | eviction runs in the window | inserts applied in the window | tree writer CPU in the window (ms) |"
    echo "|---|---|---|---|---|---|---|---|---|---|---|"
    echo "| (a) no eviction (--max-tree-size 10^12) | ${M[a,3]} | ${M[a,4]} | ${M[a,5]} | ${M[a,6]} | $(fmt "${M[a,7]}") → $(fmt "${M[a,8]}") | ${M[a,9]} | $(fmt "${M[a,10]}") | ${M[a,11]} | ${M[a,12]} | ${M[a,13]} |"
    echo "| (b) evicting (--max-tree-size $MAX_TREE, --eviction-interval 1) | ${M[b,3]} | ${M[b,4]} | ${M[b,5]} | ${M[b,6]} | $(fmt "${M[b,7]}") → $(fmt "${M[b,8]}") | ${M[b,9]} | $(fmt "${M[b,10]}") | ${M[b,11]} | ${M[b,12]} | ${M[b,13]} |"
    echo
    echo "p99 ratio (b)/(a): **$(ratio "${M[a,4]}" "${M[b,4]}")×** (target ≤ 1.2×); p50 ratio $(ratio "${M[a,3]}" "${M[b,3]}")×."
    echo "Per-round ratios of p99 (b)/(a), each pair measured back to back: $(awk -F'\t' 'NR > 1 { p[$1, $2] = $4 } END { for (r = 1; (r, "a") in p; r++) printf "%s%.2f", (r > 1 ? ", " : ""), p[r, "b"] / p[r, "a"] }' "$OUT/raw.tsv")."
    echo "Eviction runs count the writer's periodic passes (one a second) plus its immediate evictions of a worker 10 % over the limit."
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
    python3 scripts/bench-docs.py write "$DOCS_SECTION" "$OUT/report.md" --command "scripts/bench-eviction.sh --duration $DURATION --rounds $ROUNDS --workers $WORKERS --max-tree-size $MAX_TREE --prompt-chars $PROMPT_CHARS --filler-delay-ms $FILLER_DELAY"
fi
