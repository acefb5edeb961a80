#!/usr/bin/env bash
# Latency radixgate adds over a direct connection to one worker, and peak requests/s through it.
#
#   scripts/bench-latency.sh [DURATION_SECS] [RUNS] [--write-docs]
#
# Method (rust-stack.md §7): one simulated worker answering at once (--token-interval-ms 0,
# one output token) and wrk on CPU 1, the gateway pinned to CPU 0. Each run measures direct
# and proxied back to back at one connection (wrk -c1, closed loop), so the ratio comes from
# the same conditions; the medians over RUNS are reported. Then peak throughput at 64
# connections. Only 127.0.0.1; every process started here is stopped by PID on exit.
# --write-docs puts the table into docs/benchmarks.md (section latency) with the command and the
# machine (scripts/bench-docs.py).
set -euo pipefail
cd "$(dirname "$0")/.."
COMMAND="scripts/bench-latency.sh$(printf ' %q' "$@")"
WRITE_DOCS=0
pos=()
for a in "$@"; do
  case "$a" in
    --write-docs) WRITE_DOCS=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) pos+=("$a") ;;
  esac
done
DURATION=${pos[0]:-10}
RUNS=${pos[1]:-5}
command -v wrk >/dev/null || { echo "installing wrk (Debian package)"; apt-get install -y wrk >/dev/null; }
cargo build --release -q -p radixgate -p loadtest
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
SIM=$(free_port); GW=$(free_port); GW1=$(free_port)
taskset -c 1 target/release/sim-worker --ports "$SIM" --tokenizer approx --token-interval-ms 0 >/dev/null 2>&1 & pids+=($!)
# Two gateways on the same worker: one on its own CPU (0), one sharing CPU 1 with the worker
# and wrk. On this VM a wake-up across CPUs costs tens of µs (idle exit + IPI), which the first
# placement pays four times per request; the second shows the gateway's own cost.
taskset -c 0 target/release/radixgate --host 127.0.0.1 --port "$GW" --prometheus-port 0 --cpu-list 0 \
  --worker-urls "http://127.0.0.1:$SIM" --log-level warn & pids+=($!)
taskset -c 1 target/release/radixgate --host 127.0.0.1 --port "$GW1" --prometheus-port 0 --cpu-list 1 \
  --worker-urls "http://127.0.0.1:$SIM" --log-level warn & pids+=($!)
for port in "$GW" "$GW1"; do
  for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/readiness" >/dev/null && break; sleep 0.1; done
done

LUA=$(mktemp); trap 'rm -f "$LUA"; cleanup' EXIT
cat > "$LUA" <<'LUA'
wrk.method = "POST"
wrk.body = '{"text":"hello radixgate","sampling_params":{"max_new_tokens":1}}'
wrk.headers["Content-Type"] = "application/json"
LUA
# wrk prints percentiles as e.g. "50%  112.00us"; convert to microseconds.
pct() { awk -v p="$1" '$1==p { v=$2; if (v ~ /us$/) { sub(/us$/,"",v); print v } else if (v ~ /ms$/) { sub(/ms$/,"",v); print v*1000 } else if (v ~ /s$/) { sub(/s$/,"",v); print v*1000000 } }'; }
rps() { awk '/Requests\/sec/ { print $2 }'; }
median() { sort -n | awk '{ a[NR]=$1 } END { if (NR%2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2 }'; }

echo "warm-up"
taskset -c 1 wrk -t1 -c1 -d2s -s "$LUA" "http://127.0.0.1:$GW/generate" >/dev/null
taskset -c 1 wrk -t1 -c1 -d2s -s "$LUA" "http://127.0.0.1:$GW1/generate" >/dev/null
d50=(); d99=(); p50=(); p99=(); s50=(); s99=()
lat() { taskset -c 1 wrk -t1 -c1 -d"${DURATION}s" --latency -s "$LUA" "http://127.0.0.1:$1/generate"; }
for i in $(seq "$RUNS"); do
  out=$(lat "$SIM"); d50+=("$(pct 50% <<<"$out")"); d99+=("$(pct 99% <<<"$out")")
  out=$(lat "$GW1"); s50+=("$(pct 50% <<<"$out")"); s99+=("$(pct 99% <<<"$out")")
  out=$(lat "$GW"); p50+=("$(pct 50% <<<"$out")"); p99+=("$(pct 99% <<<"$out")")
  echo "run $i: direct p50 ${d50[-1]}us p99 ${d99[-1]}us | radixgate same CPU p50 ${s50[-1]}us p99 ${s99[-1]}us | radixgate own CPU p50 ${p50[-1]}us p99 ${p99[-1]}us"
done
med() { printf '%s\n' "$@" | median; }
md50=$(med "${d50[@]}"); md99=$(med "${d99[@]}")
ms50=$(med "${s50[@]}"); ms99=$(med "${s99[@]}")
mp50=$(med "${p50[@]}"); mp99=$(med "${p99[@]}")
add() { awk -v a="$1" -v b="$2" 'BEGIN{print a-b}'; }
peak=$(taskset -c 1 wrk -t1 -c64 -d"${DURATION}s" -s "$LUA" "http://127.0.0.1:$GW/generate" | rps)
direct_peak=$(taskset -c 1 wrk -t1 -c64 -d"${DURATION}s" -s "$LUA" "http://127.0.0.1:$SIM/generate" | rps)
TABLE="$(mktemp)"; trap 'rm -f "$LUA" "$TABLE"; cleanup' EXIT
{
echo "| one connection, medians of $RUNS runs × ${DURATION}s | p50 (µs) | p99 (µs) | added p50 | added p99 |"
echo "|---|---|---|---|---|"
echo "| direct to the worker | $md50 | $md99 | | |"
echo "| radixgate on the worker's CPU | $ms50 | $ms99 | $(add "$ms50" "$md50") | $(add "$ms99" "$md99") |"
echo "| radixgate on its own CPU | $mp50 | $mp99 | $(add "$mp50" "$md50") | $(add "$mp99" "$md99") |"
echo
echo "Peak at 64 connections (wrk and the worker on CPU 1): through radixgate (CPU 0) $peak req/s; direct to the worker $direct_peak req/s."
} >"$TABLE"
echo
cat "$TABLE"
if [[ "$WRITE_DOCS" == 1 ]]; then
  python3 scripts/bench-docs.py write latency "$TABLE" --command "$COMMAND"
fi
