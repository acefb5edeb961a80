#!/usr/bin/env bash
# Side-by-side latency and peak throughput of two radixgate binaries (e.g. before and after a
# change), measured in one run so the VM's drift hits both alike.
#
#   scripts/bench-ab.sh BEFORE_BIN AFTER_BIN [DURATION_SECS] [RUNS]
#
# Build the two binaries with `cargo build --release` (e.g. in a `git worktree` of the older
# commit). One simulated worker answering at once (--token-interval-ms 0) and wrk run on CPU 1;
# each binary runs twice: on CPU 0 ("own CPU") and on CPU 1 ("worker's CPU"). Latency: wrk -c1
# closed loop, the placements interleaved run by run, medians over RUNS. Peak: 64 connections,
# gateway on CPU 0, interleaved, median of RUNS. Only 127.0.0.1; every process started here is
# stopped by PID on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
BEFORE=$(realpath "$1"); AFTER=$(realpath "$2"); DUR=${3:-5}; RUNS=${4:-7}
command -v wrk >/dev/null || { apt-get update -q && apt-get install -y -q wrk >/dev/null; }
# SIM_WORKER: a sim-worker binary to use instead of building target/release/sim-worker.
SIM_BIN=${SIM_WORKER:-}
if [ -z "$SIM_BIN" ]; then
  cargo build --release -q -p loadtest --bin sim-worker
  SIM_BIN=target/release/sim-worker
fi
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM
fp() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
SIM=$(fp); B0=$(fp); A0=$(fp); B1=$(fp); A1=$(fp)
taskset -c 1 "$SIM_BIN" --ports "$SIM" --tokenizer approx --token-interval-ms 0 >/dev/null 2>&1 & pids+=($!)
read -r -a BEFORE_EXTRA <<<"${BEFORE_ARGS:-}"; read -r -a AFTER_EXTRA <<<"${AFTER_ARGS:-}"
start() { local bin="$1" port="$2" cpu="$3"; shift 3
          taskset -c "$cpu" "$bin" --host 127.0.0.1 --port "$port" --prometheus-port 0 --cpu-list "$cpu" \
            --worker-urls "http://127.0.0.1:$SIM" --log-level warn "$@" & pids+=($!); }
start "$BEFORE" "$B0" 0 "${BEFORE_EXTRA[@]}"; start "$AFTER" "$A0" 0 "${AFTER_EXTRA[@]}"
start "$BEFORE" "$B1" 1 "${BEFORE_EXTRA[@]}"; start "$AFTER" "$A1" 1 "${AFTER_EXTRA[@]}"
for port in "$B0" "$A0" "$B1" "$A1"; do
  for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/readiness" >/dev/null && break; sleep 0.1; done
done
LUA=$(mktemp); trap 'rm -f "$LUA"; cleanup' EXIT
printf '%s\n' 'wrk.method = "POST"' \
  "wrk.body = '{\"text\":\"hello radixgate\",\"sampling_params\":{\"max_new_tokens\":1}}'" \
  'wrk.headers["Content-Type"] = "application/json"' > "$LUA"
pct() { awk -v p="$1" '$1==p { v=$2; if (v ~ /us$/) { sub(/us$/,"",v); print v } else if (v ~ /ms$/) { sub(/ms$/,"",v); print v*1000 } else if (v ~ /s$/) { sub(/s$/,"",v); print v*1000000 } }'; }
lat() { taskset -c 1 wrk -t1 -c1 -d"${DUR}s" --latency -s "$LUA" "http://127.0.0.1:$1/generate"; }
peak() { taskset -c 1 wrk -t1 -c64 -d"${DUR}s" -s "$LUA" "http://127.0.0.1:$1/generate" | awk '/Requests\/sec/ {print $2}'; }
median() { tr ' ' '\n' | grep -v '^$' | sort -n | awk '{a[NR]=$1} END {print (NR%2)?a[(NR+1)/2]:(a[NR/2]+a[NR/2+1])/2}'; }
for p in "$SIM" "$B0" "$A0" "$B1" "$A1"; do taskset -c 1 wrk -t1 -c1 -d1s -s "$LUA" "http://127.0.0.1:$p/generate" >/dev/null; done
declare -A p50 p99 pk
names=("direct:$SIM" "before_worker_cpu:$B1" "after_worker_cpu:$A1" "before_own_cpu:$B0" "after_own_cpu:$A0")
for i in $(seq "$RUNS"); do
  for np in "${names[@]}"; do
    n=${np%%:*}; out=$(lat "${np##*:}")
    p50[$n]+="$(pct 50% <<<"$out") "; p99[$n]+="$(pct 99% <<<"$out") "
  done
  pk[before]+="$(peak "$B0") "; pk[after]+="$(peak "$A0") "
  echo "run $i done" >&2
done
echo "| one connection, medians of $RUNS × ${DUR}s | p50 (µs) | p99 (µs) |"
echo "|---|---|---|"
for np in "${names[@]}"; do n=${np%%:*}; echo "| $n | $(median <<<"${p50[$n]}") | $(median <<<"${p99[$n]}") |"; done
echo
echo "peak at 64 connections (gateway on CPU 0), median of $RUNS: before $(median <<<"${pk[before]}") req/s, after $(median <<<"${pk[after]}") req/s"
