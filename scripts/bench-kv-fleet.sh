#!/usr/bin/env bash
# KV-event intake at fleet scale (issue 47, item 1): one radixgate copy with --kv-events fed by
# thousands of simulated SGLang 0.5.23 publishers (loadtest's kv-fleet), at set aggregate rates.
#
#   scripts/bench-kv-fleet.sh [--publishers 1024,4096,8192] [--rates 100000,1000000]
#       [--duration S] [--dp D] [--block-size B] [--blocks-per-rank N] [--bg-rate R]
#       [--marker-rate R] [--ready-timeout S] [--nice N] [--quick] [--skip-build] [--out DIR]
#       [--write-docs [--docs-section NAME]] [--help]
#
#   --publishers LIST   fleet sizes in publishers (servers × DP ranks; default 1024,4096,8192)
#   --rates LIST        aggregate offered rates, stored blocks/s (k/M suffixes; default
#                       100000,1000000); each size first runs an idle phase (nothing published,
#                       background requests only: the latency baseline), then one phase a rate
#   --duration S        seconds per phase (default 20); 6 quiet seconds follow each phase
#   --dp D              DP ranks (publishers) per server (default 8)
#   --block-size B      tokens per block (default 16)
#   --blocks-per-rank N blocks a rank holds before removing its least recently stored leaves
#                       (default: 3M / publishers, within 256..2048: the gateway's 4 Mi-block
#                       index never evicts on its own)
#   --bg-rate R         routed background /generate requests per second (default 200)
#   --marker-rate R     markers per second (default 20)
#   --ready-timeout S   longest wait for the gateway's /readiness (default 300); past it the
#                       phases run anyway and the report says how many workers were warm
#   --nice N            run the fleet and the gateway at nice N (e.g. -10 on a machine shared
#                       with builds, so their CPU is not taken from the measured processes;
#                       default 0), the gateway's helper threads (nice 10 of their own) at N + 10;
#                       the report gives the load average at each phase's start
#   --quick             1,024 publishers, one rate (100000), 10 s phases: a check that it works
#   --skip-build        use target/release/{radixgate,kv-fleet} as they are
#   --out DIR           results folder (default results/bench-kv-fleet-<stamp>)
#   --write-docs        put the table into docs/benchmarks.md (section kv-fleet, or NAME)
#
# Per size: the fleet (servers = publishers / D, each with an HTTP listener and per rank a libzmq
# PUB socket and replay ROUTER) runs pinned to CPU 0 as as many kv-fleet processes as the
# open-file limit needs (5-6 descriptors a publisher; --shard K/N, disjoint servers, one
# schedule); radixgate runs pinned to CPU 1 (taskset -c 1, --cpu-list 1) with --policy
# cache_aware --kv-events and every server in --worker-urls (a --config file). Shard 0 drives:
# it waits for /readiness, then runs the phases; during each it publishes markers (a fresh
# 4-block chain on a random server of its own; the probe sends /generate with the marker's
# input_ids every ~1 ms, at most 500 probes/s in all, until the answer names that server:
# staleness = that send − publish; "never routed" after 5 s)
# and sends background /generate requests for prompts the fleet stored at start (pinned, so the
# same requests in every phase); it reads the gateway's Prometheus counters at each phase's
# start, end and end of settle, and /proc/PID for the CPU of the gateway's kv-* threads and
# its memory, and /proc/net/tcp for the bytes waiting at the phase's end in the publishers'
# connections (unread by the gateway, unsent by the fleet). Writes results/bench-kv-fleet-<stamp>/report.md (printed at the end) and the raw
# rows (phases.jsonl, shard-K.jsonl per size). Only 127.0.0.1; every process started here is
# stopped by PID on exit. Defaults take about 6 minutes (--quick: 1).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PUBLISHERS="1024,4096,8192"
RATES="100000,1000000"
DURATION=20
SETTLE=6
DP=8
BLOCK_SIZE=16
BLOCKS_PER_RANK=0
BG_RATE=200
MARKER_RATE=20
READY_TIMEOUT=300
NICE=0
BUILD=1
OUT=""
WRITE_DOCS=0
DOCS_SECTION=kv-fleet
FLEET_CPU=0
GW_CPU=1
ARGS_SHOWN=()

usage() { sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
    case "$1" in
        --publishers) PUBLISHERS="$2"; ARGS_SHOWN+=("$1" "$2"); shift 2 ;;
        --rates) RATES="$2"; ARGS_SHOWN+=("$1" "$2"); shift 2 ;;
        --duration) DURATION="$2"; ARGS_SHOWN+=("$1" "$2"); shift 2 ;;
        --dp) DP="$2"; ARGS_SHOWN+=("$1" "$2"); shift 2 ;;
        --block-size) BLOCK_SIZE="$2"; ARGS_SHOWN+=("$1" "$2"); shift 2 ;;
        --blocks-per-rank) BLOCKS_PER_RANK="$2"; ARGS_SHOWN+=("$1" "$2"); shift 2 ;;
        --bg-rate) BG_RATE="$2"; ARGS_SHOWN+=("$1" "$2"); shift 2 ;;
        --marker-rate) MARKER_RATE="$2"; ARGS_SHOWN+=("$1" "$2"); shift 2 ;;
        --ready-timeout) READY_TIMEOUT="$2"; ARGS_SHOWN+=("$1" "$2"); shift 2 ;;
        --nice) NICE="$2"; ARGS_SHOWN+=("$1" "$2"); shift 2 ;;
        --quick) PUBLISHERS=1024; RATES=100000; DURATION=10; ARGS_SHOWN+=("$1"); shift ;;
        --skip-build) BUILD=0; shift ;;
        --out) OUT="$2"; shift 2 ;;
        --write-docs) WRITE_DOCS=1; shift ;;
        --docs-section) DOCS_SECTION="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done

STAMP="$(date -u +%Y%m%d-%H%M%S)"
OUT="${OUT:-results/bench-kv-fleet-$STAMP}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
log() { printf '[bench-kv-fleet %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
RG_BIN="$TARGET/release/radixgate"
FLEET_BIN="$TARGET/release/kv-fleet"
if [[ "$BUILD" == 1 ]]; then
    log "building radixgate and kv-fleet (release)"
    CARGO_PROFILE_RELEASE_LTO=thin CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16 \
        cargo build --release -p radixgate --bin radixgate >&2
    CARGO_PROFILE_RELEASE_LTO=thin CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16 \
        cargo build --release -p loadtest --bin kv-fleet >&2
fi
[[ -x "$RG_BIN" && -x "$FLEET_BIN" ]] || { echo "missing $RG_BIN or $FLEET_BIN (build first)" >&2; exit 1; }

# Every publisher is a PUB socket (libzmq: its mailbox, its listener, the gateway's
# connection) and a ROUTER (mailbox, listener): 5 descriptors, plus the servers' HTTP.
HARD="$(ulimit -Hn)"
ulimit -n "$HARD"
FD_BUDGET=$(( HARD - 1500 ))

# shellcheck source=lib/procs.sh
source "$ROOT/scripts/lib/procs.sh"

PIDS=()
stop_all() {
    local p
    for p in "${PIDS[@]}"; do stop_pid "$p"; done
    PIDS=()
}
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    stop_all
    exit "$rc"
}
trap cleanup EXIT
trap 'echo; echo "interrupted" >&2; exit 130' INT TERM

# Listener ports below the ephemeral range (the gateway dials thousands of publishers) and
# above the fleet's port ranges (HTTP 11000.., PUB 12100.., replay 20400..; at most 1,024
# servers × 8 ranks end below 28600).
port_below_ephemeral() { free_port_in 29000 32001; }

IFS=',' read -r -a SIZE_LIST <<<"$PUBLISHERS"
log "sizes ${SIZE_LIST[*]} publishers, rates 0(idle),$RATES, ${DURATION}s phases; results in $OUT"

for pubs in "${SIZE_LIST[@]}"; do
    servers=$(( pubs / DP ))
    [[ $servers -ge 1 ]] || { echo "--publishers $pubs < --dp $DP" >&2; exit 2; }
    dir="$OUT/p$pubs"; mkdir -p "$dir"
    # 5 descriptors a publisher, one more while a replay connection is open, the servers' HTTP
    # connections from the gateway's pools and threads.
    per_server=$(( 7 * DP + 8 ))
    shards=$(( (servers * per_server + FD_BUDGET - 1) / FD_BUDGET ))
    [[ $shards -ge 1 ]] || shards=1
    gport="$(port_below_ephemeral)"; mport="$(port_below_ephemeral)"
    while [[ "$mport" == "$gport" ]]; do mport="$(port_below_ephemeral)"; done
    { printf 'worker-urls = ['
      for s in $(seq 0 $(( servers - 1 ))); do printf '"http://127.0.0.1:%d",' $(( 11000 + s )); done | sed 's/,$//'
      printf ']\n'; } >"$dir/workers.toml"
    rm -f "$dir/start" "$dir/gateway.pid"
    common=(--servers "$servers" --dp "$DP" --block-size "$BLOCK_SIZE" --blocks-per-rank "$BLOCKS_PER_RANK"
            --rates "0,$RATES" --duration "$DURATION" --settle "$SETTLE" --start-file "$dir/start"
            --out "$dir" --ready-timeout "$READY_TIMEOUT")
    log "[$pubs] $servers servers × $DP ranks in $shards kv-fleet process(es) on CPU $FLEET_CPU"
    for k in $(seq 0 $(( shards - 1 ))); do
        extra=()
        if [[ $k == 0 ]]; then
            extra=(--gateway "127.0.0.1:$gport" --metrics "127.0.0.1:$mport" --gateway-pid-file "$dir/gateway.pid"
                   --bg-rate "$BG_RATE" --marker-rate "$MARKER_RATE")
        fi
        nice -n "$NICE" taskset -c "$FLEET_CPU" "$FLEET_BIN" "${common[@]}" --shard "$k/$shards" "${extra[@]}" \
            >"$dir/fleet-$k.log" 2>&1 &
        PIDS+=("$!")
    done
    # Every shard bound its sockets (it logs "listening").
    for _ in $(seq 1 600); do
        n=0; for k in $(seq 0 $(( shards - 1 ))); do grep -q 'listening' "$dir/fleet-$k.log" 2>/dev/null && n=$((n + 1)); done
        [[ $n -ge $shards ]] && break
        for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null || { echo "kv-fleet exited:" >&2; tail -5 "$dir"/fleet-*.log >&2; exit 1; }; done
        sleep 0.2
    done
    log "[$pubs] starting radixgate on CPU $GW_CPU (port $gport, metrics $mport)"
    nice -n "$NICE" taskset -c "$GW_CPU" "$RG_BIN" --config "$dir/workers.toml" --policy cache_aware --kv-events \
        --host 127.0.0.1 --port "$gport" --prometheus-host 127.0.0.1 --prometheus-port "$mport" \
        --cpu-list "$GW_CPU" --kv-warm-timeout-secs "$READY_TIMEOUT" --log-level warn \
        >"$dir/gateway.log" 2>&1 &
    gw_pid=$!; PIDS+=("$gw_pid")
    echo "$gw_pid" >"$dir/gateway.pid"
    # The driving shard ends after the last phase's settle and markers; bounded by the schedule.
    phases=$(( 1 + $(awk -F, '{print NF}' <<<"$RATES") ))
    limit=$(( READY_TIMEOUT + phases * (${DURATION%.*} + SETTLE) + 60 ))
    for i in $(seq 1 $(( limit * 5 ))); do
        kill -0 "${PIDS[0]}" 2>/dev/null || break
        # radixgate sets its helper threads (kv-events among them) to nice 10, absolute: under
        # --nice N they are moved to N + 10, so they keep their place below the serving core
        # and above other work on the machine, as on a machine of their own.
        if [[ "$NICE" != 0 && $(( i % 5 )) == 1 ]]; then
            for t in /proc/"$gw_pid"/task/*; do
                [[ "$(awk '{print $19}' "$t/stat" 2>/dev/null)" == 10 ]] \
                    && renice -n $(( NICE + 10 )) -p "${t##*/}" >/dev/null 2>&1 || true
            done
        fi
        kill -0 "$gw_pid" 2>/dev/null || { log "[$pubs] radixgate exited"; tail -5 "$dir/gateway.log" >&2; break; }
        sleep 0.2
    done
    curl -s --max-time 20 "http://127.0.0.1:$mport/metrics" >"$dir/gateway-end.prom" || true
    grep -h 'kv-fleet: gateway ready' "$dir/fleet-0.log" >&2 || true
    stop_all
done

python3 - "$OUT" "$DURATION" <<'PY'
import json, os, sys
out, duration = sys.argv[1], sys.argv[2]

def rows(path):
    try:
        with open(path) as f:
            return [json.loads(l) for l in f if l.strip()]
    except OSError:
        return []

def n(x, digits=0):
    if x is None:
        return "–"
    return f"{x:,.{digits}f}"

def k(x):
    if x is None:
        return "–"
    return f"{x/1e6:.2f}M" if x >= 1e6 else f"{x/1e3:.0f}k" if x >= 1e3 else f"{x:.0f}"

def fleet_cpu(sh):
    gen = sum(s.get("threads_cpu_pct", {}).get("fleet-gen", 0) for s in sh)
    # libzmq's I/O thread keeps the name of the thread that started it (the main one, idle).
    io = sum(v for s in sh for kk, v in s.get("threads_cpu_pct", {}).items() if kk.startswith("ZMQbg/IO") or kk == "kv-fleet")
    return f"{gen:.0f} % / {io:.0f} %" if sh and any("threads_cpu_pct" in s for s in sh) else "–"

def backlog(p, sh):
    t = p.get("tcp_end")
    if not t:
        return "–"
    rss = sum(s.get("rss_mib_end", 0) for s in sh)
    return f"{t['gateway_unread_mib']:.0f} / {t['fleet_unsent_mib']:.0f} / {rss:,.0f}"

loads = []
lines = []
lines.append("<!-- docs -->")
lines.append("| publishers | offered blocks/s (fleet achieved) | applied blocks/s (× offered) | staleness in gateway p50 / p99 (ms) | marker staleness p50 / p99 / max (ms) | markers never routed | gaps / resets / dropped | workers warm / ranks indexed | kv-* CPU | RSS peak / end (MiB) | routed p50 / p99 (µs), p99 vs idle | fleet CPU: generator / libzmq I/O | at phase end, MiB: unread by gateway / unsent by fleet / held by fleet |")
lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
notes = []
sizes = sorted(int(d[1:]) for d in os.listdir(out) if d.startswith("p") and d[1:].isdigit())
for pubs in sizes:
    d = os.path.join(out, f"p{pubs}")
    phases = rows(os.path.join(d, "phases.jsonl"))
    shards = []
    for f in sorted(os.listdir(d)):
        if f.startswith("shard-") and f.endswith(".jsonl"):
            shards += rows(os.path.join(d, f))
    ready = rows(os.path.join(d, "ready.json"))
    if ready:
        r = ready[0]
        notes.append(f"- {pubs:,} publishers: gateway ready: {'yes' if r.get('ready') else 'NO (timed out)'} after {r.get('seconds', 0):.1f} s, "
                     f"warm workers {n(r.get('warm_workers'))}, index sources {n(r.get('index_sources'))}.")
    if not phases:
        lines.append(f"| {pubs:,} | (no result: see {d}/fleet-0.log, gateway.log) ||||||||||||")
        continue
    idle_p99 = None
    for p in phases:
        if p["rate"] == 0 and p.get("background", {}).get("p99_us"):
            idle_p99 = p["background"]["p99_us"]
    for p in phases:
        i = p["phase"]
        sh = [s for s in shards if s["phase"] == i]
        secs = max((s["seconds"] for s in sh), default=0) or p["secs"]
        achieved = sum(s["blocks_stored"] for s in sh) / secs if secs else None
        events = sum(s["events"] for s in sh)
        g = p["gateway"]
        if g.get("applied_blocks_per_s") is not None:
            applied = g["applied_blocks_per_s"]; est = ""
        elif g.get("events") is not None and events:
            # No applied-blocks counter: the fleet's blocks × the share of its events applied.
            applied = (achieved or 0) * min(g["events"] / events, 1.0) if achieved else 0.0; est = " (est.)"
        else:
            applied = None; est = ""
        ratio = f" ({applied / achieved:.2f}×)" if applied is not None and achieved else ""
        m = p.get("markers", {})
        b = p.get("background", {})
        drop = sum(g.get("dropped", {}).values()) if g.get("dropped") else 0
        rel = f", {b['p99_us'] / idle_p99:.2f}×" if idle_p99 and b.get("p99_us") and p["rate"] else ""
        offered = "idle" if p["rate"] == 0 else f"{k(p['rate'])} ({k(achieved)})"
        lines.append(
            f"| {pubs:,} | {offered} | {k(applied) + est + ratio if p['rate'] else '–'} | "
            f"{n(g.get('staleness_ms_p50'), 1)} / {n(g.get('staleness_ms_p99'), 1)} | "
            f"{n(m.get('p50_ms'), 1)} / {n(m.get('p99_ms'), 1)} / {n(m.get('max_ms'), 1)} | "
            f"{m.get('never', '–')} / {m.get('published', '–')} | "
            f"{n(g.get('gaps'))} / {n(g.get('resets'))} / {n(drop)} | "
            f"{n(g.get('warm_workers_end'))} / {n(g.get('index_sources_end'))} | "
            f"{p['kv_cpu_pct']:.0f} % | {p['rss_mib_peak']:.0f} / {p['rss_mib_end']:.0f} | "
            f"{n(b.get('p50_us'))} / {n(b.get('p99_us'))}{rel} | {fleet_cpu(sh)} | {backlog(p, sh)} |")
        if p.get("loadavg_start") is not None:
            loads.append(p["loadavg_start"])
lines.append("")
lines.extend(notes)
if loads:
    lines.append(f"- Load average (1 min) at the phases' start: {min(loads):.1f} to {max(loads):.1f} (2 CPUs: above ~2, other work shared the machine).")
lines.append("<!-- /docs -->")
text = "\n".join(lines) + "\n"
with open(os.path.join(out, "report.md"), "w") as f:
    f.write(f"# KV intake at fleet scale ({duration} s phases)\n\n" + text)
print(text)
PY

if [[ "$WRITE_DOCS" == 1 ]]; then
    python3 scripts/bench-docs.py write "$DOCS_SECTION" "$OUT/report.md" \
        --command "scripts/bench-kv-fleet.sh ${ARGS_SHOWN[*]}"
fi
log "report: $OUT/report.md"
