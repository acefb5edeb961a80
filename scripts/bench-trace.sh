#!/usr/bin/env bash
# Latency --enable-trace adds per request: the same gateway binary, tracing off and tracing on
# at --trace-sample-ratio 1.0 exporting to an OTLP/gRPC receiver, against one worker.
#
#   scripts/bench-trace.sh [DURATION_SECS] [RUNS]
#
# Method (as scripts/bench-latency.sh): one simulated worker answering at once and wrk on CPU 1,
# each gateway pinned to CPU 0; each run measures direct, off and on back to back at one
# connection (wrk -c1, closed loop) and the medians over RUNS are reported. The receiver is
# tests/fixtures/otlp_receiver.py (Python from RADIXGATE_TEST_PYTHON, else .venv-test/; see
# scripts/test.sh) on CPU 1, its output discarded. Only 127.0.0.1; every process started here
# is stopped by PID on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in -h|--help) sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;; esac
DURATION=${1:-10}
RUNS=${2:-5}
PY=${RADIXGATE_TEST_PYTHON:-.venv-test/bin/python}
command -v wrk >/dev/null || { echo "installing wrk (Debian package)"; apt-get install -y wrk >/dev/null; }
cargo build --release -q -p radixgate -p loadtest
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
SIM=$(free_port); OFF=$(free_port); ON=$(free_port)
taskset -c 1 target/release/sim-worker --ports "$SIM" --tokenizer approx --token-interval-ms 0 >/dev/null 2>&1 & pids+=($!)
RECV_OUT=$(mktemp)
sleep infinity | taskset -c 1 "$PY" tests/fixtures/otlp_receiver.py --exit-on-stdin-eof >"$RECV_OUT" & pids+=($!)
for _ in $(seq 100); do [[ -s "$RECV_OUT" ]] && break; sleep 0.1; done
OTLP=$(head -1 "$RECV_OUT" | python3 -c 'import json,sys; print(json.load(sys.stdin)["port"])')
common=(--host 127.0.0.1 --prometheus-port 0 --cpu-list 0 --worker-urls "http://127.0.0.1:$SIM" --log-level warn)
taskset -c 0 target/release/radixgate --port "$OFF" "${common[@]}" & pids+=($!)
taskset -c 0 target/release/radixgate --port "$ON" "${common[@]}" \
  --enable-trace --otlp-traces-endpoint "127.0.0.1:$OTLP" --trace-sample-ratio 1.0 & pids+=($!)
for port in "$OFF" "$ON"; do
  for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/readiness" >/dev/null && break; sleep 0.1; done
done

LUA=$(mktemp); trap 'rm -f "$LUA" "$RECV_OUT"; cleanup' EXIT
cat > "$LUA" <<'LUA'
wrk.method = "POST"
wrk.body = '{"text":"hello radixgate","sampling_params":{"max_new_tokens":1}}'
wrk.headers["Content-Type"] = "application/json"
LUA
pct() { awk -v p="$1" '$1==p { v=$2; if (v ~ /us$/) { sub(/us$/,"",v); print v } else if (v ~ /ms$/) { sub(/ms$/,"",v); print v*1000 } else if (v ~ /s$/) { sub(/s$/,"",v); print v*1000000 } }'; }
median() { sort -n | awk '{ a[NR]=$1 } END { if (NR%2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2 }'; }
lat() { taskset -c 1 wrk -t1 -c1 -d"${DURATION}s" --latency -s "$LUA" "http://127.0.0.1:$1/generate"; }

echo "warm-up"
for port in "$OFF" "$ON"; do taskset -c 1 wrk -t1 -c1 -d2s -s "$LUA" "http://127.0.0.1:$port/generate" >/dev/null; done
d50=(); d99=(); f50=(); f99=(); n50=(); n99=()
for i in $(seq "$RUNS"); do
  out=$(lat "$SIM"); d50+=("$(pct 50% <<<"$out")"); d99+=("$(pct 99% <<<"$out")")
  out=$(lat "$OFF"); f50+=("$(pct 50% <<<"$out")"); f99+=("$(pct 99% <<<"$out")")
  out=$(lat "$ON"); n50+=("$(pct 50% <<<"$out")"); n99+=("$(pct 99% <<<"$out")")
  echo "run $i: direct p50 ${d50[-1]}us p99 ${d99[-1]}us | tracing off p50 ${f50[-1]}us p99 ${f99[-1]}us | tracing on p50 ${n50[-1]}us p99 ${n99[-1]}us"
done
med() { printf '%s\n' "$@" | median; }
add() { awk -v a="$1" -v b="$2" 'BEGIN{print a-b}'; }
md50=$(med "${d50[@]}"); md99=$(med "${d99[@]}")
mf50=$(med "${f50[@]}"); mf99=$(med "${f99[@]}")
mn50=$(med "${n50[@]}"); mn99=$(med "${n99[@]}")
# Each run measures off and on back to back: the median of those paired differences is less
# moved by a neighbour's load drifting between runs than the difference of the medians.
deltas=(); for i in "${!f50[@]}"; do deltas+=("$(add "${n50[$i]}" "${f50[$i]}")"); done
mdelta=$(med "${deltas[@]}")
spans=$(($(wc -l <"$RECV_OUT") - 1))
echo
echo "| one connection, medians of $RUNS runs × ${DURATION}s | p50 (µs) | p99 (µs) | added p50 over direct | added p50 over off |"
echo "|---|---|---|---|---|"
echo "| direct to the worker | $md50 | $md99 | | |"
echo "| radixgate, tracing off | $mf50 | $mf99 | $(add "$mf50" "$md50") | |"
echo "| radixgate, tracing on (ratio 1.0) | $mn50 | $mn99 | $(add "$mn50" "$md50") | $(add "$mn50" "$mf50") |"
echo
echo "Paired per-run p50 difference, on minus off: ${deltas[*]} µs; median $mdelta µs."
echo "Spans the receiver decoded: $spans"
