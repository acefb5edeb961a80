#!/usr/bin/env bash
# Admission under overload: an interactive tenant beside a batch tenant offered 3x what the fleet
# can serve, through each gateway configuration in turn, on simulated SGLang workers.
#
# Starts N simulated workers (target/release/sim-worker, real-time GPU clock, `approx` tokenizer,
# --kv-tokens of KV each) on 127.0.0.1. First measures the fleet's capacity for the batch mix: a
# closed loop of users sending batch requests through radixgate (no admission) until every
# worker is saturated (their queues never empty), started over --capacity-ramp seconds, for
# --capacity-duration seconds; the capacity is the batch requests completed per second after
# --capacity-warmup, and the running capacity (the gateway cap of configurations b and d) the
# mean of the workers' summed sglang:num_running_reqs meanwhile. Then, per run (--runs, default
# 3), each configuration on fresh workers (restarted, so no backlog carries over):
#
#   baseline  radixgate, no admission, interactive traffic only: the reference TTFT
#   a         radixgate, no admission
#   b         radixgate, reference-style fixed cap: --max-concurrent-requests <running capacity>
#             --queue-size --queue-timeout-secs
#   c         radixgate --saturation-admission --saturation-queue-reqs --saturation-kv-usage, the
#             same --queue-size --queue-timeout-secs (its waiting room) and a tenants table
#             (--config, written here, both keys); a gateway without the flag fails to start:
#             reported as such, and the run goes on
#   d         sglang-router 0.3.2 (PyPI, in .venv/) cache_aware with its own
#             --max-concurrent-requests <running capacity> --queue-size --queue-timeout-secs
#
# Every gateway routes cache_aware. Workload (loadgen --workload overload): the interactive
# tenant (key interactive-key, X-SMG-Priority 10 and body priority 10) starts --interactive-rate
# chat sessions a second, 2-4 streamed turns each (200-token system prompt, 30-150-token
# questions, 32-96-token answers, 1-3 s think time); the batch tenant (key batch-key, priority 0)
# sends 4-8k-token prompts for 128-384 tokens, Poisson at --batch-factor (3) x the capacity, not
# streamed, 60 s client timeout. Measured over the window from --warmup (default a third of the
# run, at most 20 s: under overload nothing completes before the workers' KV has filled) to the
# end of the send window: interactive TTFT p50/p99 (of the requests sent in the window; one with
# no first token in time counts with the time it waited); batch goodput (completed output and prompt tokens/s); batch
# requests refused (429), timed out (client timeout, 408, 504) and unfinished at the end; the
# workers' mean KV use (sglang:token_usage sampled every second) and idle GPU share (the
# simulator's sglang:gpu_idle_seconds_total). Each configuration's interactive TTFT p99 is
# compared with the baseline's: "within 1.5x" when it is at most 1.5 times it.
#
# Writes results/<stamp>-overload/report.md (mean over runs and every run), runs/*/loadgen.json,
# the gateways' logs. --write-docs also puts the short table into docs/benchmarks.md, section
# overload. Stops by itself; kills only the processes it started, by PID.
# Defaults take ~18 minutes on 2 cores (capacity ~1 min, then 3 runs x 5 configurations x ~70 s).
#
# Usage: scripts/bench-overload.sh [--workers N] [--runs N] [--duration S] [--warmup S]
#          [--configs baseline,a,b,c,d] [--kv-tokens N] [--batch-factor X] [--interactive-rate R]
#          [--capacity-duration S] [--capacity-warmup S] [--capacity-ramp S] [--capacity-users N]
#          [--queue-size N] [--queue-timeout S] [--sat-queue-reqs N] [--sat-kv-usage F]
#          [--capacity REQ_PER_S,RUNNING] [--sim-priority] [--engine sglang|vllm] [--sim-args "..."]
#          [--gateway-args "..."] [--c-args "..."] [--d-args "..."]
#          [--skip-build] [--out DIR] [--write-docs [--docs-section NAME]] [--report DIR]
# --capacity skips the measurement and takes these figures (from an earlier report).
# --report DIR rewrites DIR's report.md (and with --write-docs the docs section, with the command
# that measured it) from its runs, measuring nothing.
# --sim-priority runs the workers with --enable-priority-scheduling (SGLang's default is off).
# --engine vllm runs vLLM-shaped workers (sim-worker --engine vllm): vLLM's routes and gauges
# (vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc, which the
# report's KV use and running figures then come from), caches emptied with /reset_prefix_cache.
# --gateway-args go to every radixgate; --c-args only to configuration c, --d-args only to d.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
COMMAND="scripts/bench-overload.sh$(printf ' %q' "$@")"

WORKERS=4
RUNS=3
DURATION=60
WARMUP=""
CONFIGS="baseline,a,b,c,d"
KV_TOKENS=400000
BATCH_FACTOR=3
INTERACTIVE_RATE=2
CAP_DURATION=50
CAP_WARMUP=25
CAP_RAMP=20
CAP_USERS=""
QUEUE_SIZE=100
QUEUE_TIMEOUT=30
SAT_QUEUE=2
SAT_KV=0.95
SIM_PRIORITY=0
ENGINE=sglang
SIM_ARGS=""
GATEWAY_ARGS=""
C_ARGS=""
D_ARGS=""
CAPACITY=""
REPORT_DIR=""
BUILD=1
OUT=""
WRITE_DOCS=0
DOCS_SECTION=overload
DRAIN=3
SGLANG_ROUTER_VERSION=0.3.2
# The batch mix (loadgen flags) and its mean size, for the capacity probe's user count.
BATCH_PROMPT=4000-8000
BATCH_OUTPUT=128-384
BATCH_MEAN_TOKENS=6256

usage() { sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --workers) WORKERS="$2"; shift 2 ;;
        --runs) RUNS="$2"; shift 2 ;;
        --duration) DURATION="$2"; shift 2 ;;
        --warmup) WARMUP="$2"; shift 2 ;;
        --configs) CONFIGS="$2"; shift 2 ;;
        --kv-tokens) KV_TOKENS="$2"; shift 2 ;;
        --batch-factor) BATCH_FACTOR="$2"; shift 2 ;;
        --interactive-rate) INTERACTIVE_RATE="$2"; shift 2 ;;
        --capacity-duration) CAP_DURATION="$2"; shift 2 ;;
        --capacity-warmup) CAP_WARMUP="$2"; shift 2 ;;
        --capacity-ramp) CAP_RAMP="$2"; shift 2 ;;
        --capacity-users) CAP_USERS="$2"; shift 2 ;;
        --queue-size) QUEUE_SIZE="$2"; shift 2 ;;
        --queue-timeout) QUEUE_TIMEOUT="$2"; shift 2 ;;
        --sat-queue-reqs) SAT_QUEUE="$2"; shift 2 ;;
        --sat-kv-usage) SAT_KV="$2"; shift 2 ;;
        --sim-priority) SIM_PRIORITY=1; shift ;;
        --engine) ENGINE="$2"; shift 2 ;;
        --sim-args) SIM_ARGS="$2"; shift 2 ;;
        --gateway-args) GATEWAY_ARGS="$2"; shift 2 ;;
        --c-args) C_ARGS="$2"; shift 2 ;;
        --d-args) D_ARGS="$2"; shift 2 ;;
        --capacity) CAPACITY="$2"; shift 2 ;;
        --report) REPORT_DIR="$2"; shift 2 ;;
        --skip-build) BUILD=0; shift ;;
        --out) OUT="$2"; shift 2 ;;
        --write-docs) WRITE_DOCS=1; shift ;;
        --docs-section) DOCS_SECTION="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown option: $1 (see --help)" >&2; exit 2 ;;
    esac
done

case "$ENGINE" in
    sglang|vllm) ;;
    *) echo "--engine: sglang or vllm" >&2; exit 2 ;;
esac
posint() { [[ "$2" =~ ^[1-9][0-9]*$ ]] || { echo "$1 takes a positive integer, not '$2'" >&2; exit 2; }; }
posnum() { python3 -c "import sys; v = float(sys.argv[1]); sys.exit(0 if v > 0 and v == v and v != float('inf') else 1)" "$2" 2>/dev/null \
    || { echo "$1 takes a positive number, not '$2'" >&2; exit 2; }; }
posint --workers "$WORKERS"; posint --runs "$RUNS"; posint --kv-tokens "$KV_TOKENS"; posint --queue-size "$QUEUE_SIZE"
posint --queue-timeout "$QUEUE_TIMEOUT"; posint --sat-queue-reqs "$SAT_QUEUE"
posnum --duration "$DURATION"; posnum --batch-factor "$BATCH_FACTOR"; posnum --interactive-rate "$INTERACTIVE_RATE"
posnum --capacity-duration "$CAP_DURATION"; posnum --sat-kv-usage "$SAT_KV"
[[ -n "$CAP_USERS" ]] && posint --capacity-users "$CAP_USERS"
# Under 3x overload the workers first fill their KV with prefills (prefill-first scheduling) and
# complete nothing for ~20 s: the window starts after that, at a third of the run (at most 20 s).
WARMUP="${WARMUP:-$(python3 -c "print(f'{min(20.0, float($DURATION) / 3):g}')")}"
python3 -c "import sys; sys.exit(0 if 0 <= float($WARMUP) < float($DURATION) and 0 <= float($CAP_WARMUP) < float($CAP_DURATION) else 1)" \
    || { echo "warm-ups must end before their runs do" >&2; exit 2; }
IFS=',' read -r -a CONFIG_LIST <<<"$CONFIGS"
for c in "${CONFIG_LIST[@]}"; do
    case "$c" in baseline|a|b|c|d) ;; *) echo "unknown configuration: $c (baseline a b c d)" >&2; exit 2 ;; esac
done
# Enough closed-loop users to fill every worker's KV and keep a queue behind it: 1.5x what the
# KV holds of the batch mix.
CAP_USERS="${CAP_USERS:-$(python3 -c "print(max(8, round(1.5 * $WORKERS * $KV_TOKENS / $BATCH_MEAN_TOKENS)))")}"

STAMP="$(date +%Y%m%d-%H%M%S)"
OUT="${OUT:-results/$STAMP-overload}"
LOGS="$OUT/logs"
[[ -n "$REPORT_DIR" ]] || mkdir -p "$OUT/runs" "$LOGS"
# Thousands of connections at 3x overload without admission (client, gateway, workers).
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

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
# Run a command in the background and wait for it (a trapped signal interrupts `wait` at once;
# the PID is on the cleanup list meanwhile). Returns the command's exit status.
run_fg() {
    local pid rc=0
    "$@" &
    pid=$!
    PIDS+=("$pid")
    wait "$pid" || rc=$?
    forget_pid "$pid"
    return "$rc"
}

log() { printf '[overload %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# A contiguous block of free loopback ports: N workers + gateway + its metrics port.
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
    local url="$1" secs="$2" pid="${3:-}"
    for _ in $(seq 1 $((secs * 10))); do
        if [[ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$url" || true)" == "200" ]]; then return 0; fi
        if [[ -n "$pid" ]] && ! kill -0 "$pid" 2>/dev/null; then return 1; fi
        sleep 0.1
    done
    return 1
}

# ---- report ----------------------------------------------------------------------------------
# report.md (mean over runs and every run) and docs.md (the short table) from the runs in $OUT.
make_report() {
python3 - "$OUT" <<'PY'
import glob, json, os, statistics, sys

out = sys.argv[1]
meta = json.load(open(os.path.join(out, "meta.json")))
order = meta["configs"]
runs = {}
for d in sorted(glob.glob(os.path.join(out, "runs", "r*-*"))):
    r = json.load(open(os.path.join(d, "run.json")))
    lg = os.path.join(d, "loadgen.json")
    r["report"] = json.load(open(lg)) if r["status"] == "ok" and os.path.exists(lg) else None
    runs.setdefault(r["config"], []).append(r)

def figures(rep):
    i, b, s = rep["interactive"], rep["batch"], rep["servers"]
    return {
        "ttft_p50": i["ttft"]["p50_ms"], "ttft_p99": i["ttft"]["p99_ms"],
        "i_ok": i["ok"], "i_sent": i["sent"], "i_fail": i["sent"] - i["ok"],
        "out_tps": b["output_tok_per_s"], "prompt_tps": b["prompt_tok_per_s"],
        "b_ok": b["ok"], "b_sent": b["sent"], "refused": b["refused"], "timed_out": b["timed_out"],
        "unfinished": b["unfinished"], "b_errors": sum(b["errors"].values()) + b["dropped"],
        "kv": s.get("kv_usage_mean"), "idle": s.get("idle_share"), "queued": s.get("queued_mean"),
    }

def mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None

def fmt(v, digits=0, scale=1.0, unit=""):
    return "n/a" if v is None else f"{v * scale:.{digits}f}{unit}"

base = [figures(r["report"]) for r in runs.get("baseline", []) if r["report"]]
base_p99 = mean([f["ttft_p99"] for f in base])

def row(label, f, n_ok, n):
    within = "—"
    if base_p99 and f["ttft_p99"] is not None and label.split(":")[0] != "baseline":
        within = ("yes" if f["ttft_p99"] <= 1.5 * base_p99 else "no") + f" ({f['ttft_p99'] / base_p99:.1f}×)"
    runs_note = "" if n_ok == n else f" ({n_ok} of {n} runs)"
    return (f"| {label}{runs_note} | {fmt(f['ttft_p50'])} | {fmt(f['ttft_p99'])} | {within} | "
            f"{fmt(f['i_ok'])}/{fmt(f['i_sent'])} | {fmt(f['out_tps'])} | {fmt(f['prompt_tps'])} | "
            f"{fmt(f['refused'])} | {fmt(f['timed_out'])} | {fmt(f['unfinished'])} | "
            f"{fmt(f['kv'], 1, 100)} | {fmt(f['idle'], 1, 100)} |")

HEAD = ("| configuration | interactive TTFT p50 ms | p99 ms | p99 within 1.5× baseline | interactive ok/sent | "
        "batch goodput out tok/s | batch goodput prompt tok/s | batch 429 | batch timed out | batch unfinished | "
        "mean KV use % | GPU idle % |\n|---|---|---|---|---|---|---|---|---|---|---|---|")

table, failed = [HEAD], []
for cfg in order:
    rs = runs.get(cfg, [])
    fs = [figures(r["report"]) for r in rs if r["report"]]
    label = rs[0]["label"] if rs else cfg
    if not fs:
        # The tenants file's path names this run's folder: the page needs only its name.
        why = (rs[0]["status"] if rs else "not run").replace(os.path.join(out, "tenants.toml"), "tenants.toml")
        table.append(f"| {label} | failed: {why} |" + " |" * 10)
        failed.append((label, why))
        continue
    m = {k: mean([f[k] for f in fs]) for k in fs[0]}
    table.append(row(label, m, len(fs), len(rs)))

cap = meta["capacity"]
loads = [x for rs in runs.values() for r in rs for x in r.get("load", [])]
load_note = ""
if loads:
    load_note = (f" Machine load average (1 min) around the runs: {min(loads):.1f}-{max(loads):.1f} on "
                 f"{os.cpu_count()} CPUs (other processes stall simulated GPUs and gateways alike: read the "
                 f"tails with it).")
lines = ["# Admission under overload", ""]
lines.append(
    f"{meta['workers']} simulated{' vLLM' if meta.get('engine') == 'vllm' else ''} workers ({meta['kv_tokens_per_worker']} KV tokens each, real-time GPU clock"
    f"{', priority scheduling' if meta['sim_priority_scheduling'] else ''}). Capacity for the batch mix "
    f"(prompts {meta['batch_prompt_tokens']} tokens, outputs {meta['batch_output_tokens']}): "
    f"{cap['batch_req_per_s']:.2f} req/s and {cap['running_mean']:.0f} requests running, "
    + (f"measured with {cap['users']} closed-loop users over {cap['duration_s']:g} s (from {cap['warmup_s']:g} s; "
       f"workers' queues {cap['queued_mean']:.0f} in all, idle {cap['idle_share'] * 100:.1f} %). "
       if cap["users"] is not None else "as given (--capacity). ") +
    f"Batch offered at {meta['batch_factor']:g}× = {meta['batch_rate']:.2f} req/s; interactive "
    f"{meta['interactive_session_rate']:g} sessions/s. Each run {meta['duration_s']:g} s, measured from "
    f"{meta['warmup_s']:g} s; mean of {meta['runs']} run(s)." + load_note)
lines.append("")
docs = ["<!-- docs -->", lines[2], "", *table]
if failed:
    docs.append("")
    docs.extend(f"{l}: {why}" for l, why in failed)
docs.append("<!-- /docs -->")
lines = lines[:2] + docs[1:-1]
lines += ["", "## Every run", "",
          "| run | configuration | interactive TTFT p50 | p99 | interactive ok/sent | batch out tok/s | "
          "batch prompt tok/s | batch ok/sent | 429 | timed out | unfinished | other errors | KV % | idle % | queued | load avg |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
for cfg in order:
    for r in runs.get(cfg, []):
        if not r["report"]:
            why = r["status"].replace(os.path.join(out, "tenants.toml"), "tenants.toml")
            lines.append(f"| {r['run']} | {r['label']} | failed: {why} |" + " |" * 13)
            continue
        f = figures(r["report"])
        lines.append(
            f"| {r['run']} | {r['label']} | {fmt(f['ttft_p50'])} | {fmt(f['ttft_p99'])} | {f['i_ok']}/{f['i_sent']} | "
            f"{fmt(f['out_tps'])} | {fmt(f['prompt_tps'])} | {f['b_ok']}/{f['b_sent']} | {f['refused']} | "
            f"{f['timed_out']} | {f['unfinished']} | {f['b_errors']} | {fmt(f['kv'], 1, 100)} | "
            f"{fmt(f['idle'], 1, 100)} | {fmt(f['queued'], 1)} | "
            f"{'-'.join(f'{x:.1f}' for x in r.get('load', [])) or 'n/a'} |")
lines += ["", "Goodput counts the batch requests completed inside the measurement window. Interactive TTFT: "
          "the requests sent inside the window; one with no first token in time (timed out, or cut by the end of "
          "the run) counts with the time it waited. \"Timed out\": the "
          "client's 60 s timeout, or a gateway's 408/504; \"unfinished\": still running when the run ended. "
          + ("KV use is vllm:kv_cache_usage_perc sampled every second; GPU idle is the simulator's "
             "vllm:gpu_idle_seconds_total over the window (vLLM-shaped workers). "
             if meta.get("engine") == "vllm" else
             "KV use is sglang:token_usage sampled every second; GPU idle is the simulator's "
             "sglang:gpu_idle_seconds_total over the window. ")
          + "Per-run details: runs/*/loadgen.md."]
open(os.path.join(out, "report.md"), "w").write("\n".join(lines) + "\n")
open(os.path.join(out, "docs.md"), "w").write("\n".join(docs[1:-1]) + "\n")
print("\n".join(lines))
PY
}

# --report DIR: only the report (and --write-docs) from an earlier run's folder.
if [[ -n "$REPORT_DIR" ]]; then
    OUT="$REPORT_DIR"
    [[ -f "$OUT/meta.json" ]] || { echo "$OUT/meta.json missing: not a bench-overload.sh folder" >&2; exit 2; }
    make_report
    if [[ "$WRITE_DOCS" == 1 ]]; then
        python3 scripts/bench-docs.py write "$DOCS_SECTION" "$OUT/docs.md" --command "$(jq -r '.command' "$OUT/meta.json")"
    fi
    exit 0
fi

# ---- build -----------------------------------------------------------------------------------
if [[ "$BUILD" == 1 ]]; then
    log "building release (cargo build --release -p radixgate -p loadtest)"
    cargo build --release -p radixgate -p loadtest >"$LOGS/build.log" 2>&1 || { tail -30 "$LOGS/build.log" >&2; exit 1; }
fi
for bin in radixgate sim-worker loadgen; do
    [[ -x "target/release/$bin" ]] || { echo "missing target/release/$bin (build failed?)" >&2; exit 1; }
done
LOADGEN=target/release/loadgen
"$LOADGEN" --help | grep -q -- '--batch-concurrency' || { echo "target/release/loadgen has no --workload overload (rebuild)" >&2; exit 1; }

# ---- sglang-router in .venv/ (configuration d) ---------------------------------------------
if [[ ",$CONFIGS," == *",d,"* ]]; then
    if [[ ! -x .venv/bin/python ]]; then
        log "creating .venv/"
        python3 -m venv .venv >"$LOGS/venv.log" 2>&1 || log "could not create .venv (see $LOGS/venv.log)"
    fi
    if [[ -x .venv/bin/python ]] && ! .venv/bin/python -c 'import sglang_router' 2>/dev/null; then
        log "installing sglang-router==$SGLANG_ROUTER_VERSION into .venv/"
        .venv/bin/pip install -q "sglang-router==$SGLANG_ROUTER_VERSION" >>"$LOGS/venv.log" 2>&1 \
            || log "sglang-router unavailable: configuration d will be reported as failed"
    fi
fi

# ---- cluster ---------------------------------------------------------------------------------
BASE="$(free_ports $((WORKERS + 2)))"
LAST=$((BASE + WORKERS - 1))
GW_PORT=$((BASE + WORKERS))
GW_METRICS_PORT=$((BASE + WORKERS + 1))
URLS=()
for ((i = 0; i < WORKERS; i++)); do URLS+=("http://127.0.0.1:$((BASE + i))"); done
WORKER_LIST="$(IFS=,; echo "${URLS[*]}")"
SIM_FLAGS=(--engine "$ENGINE" --ports "$BASE-$LAST" --tokenizer approx --max-total-tokens "$KV_TOKENS")
[[ "$SIM_PRIORITY" == 1 ]] && SIM_FLAGS+=(--enable-priority-scheduling)

SIM_PID=""
start_sims() { # start_sims LOGFILE
    # shellcheck disable=SC2086
    target/release/sim-worker "${SIM_FLAGS[@]}" $SIM_ARGS >"$1" 2>&1 &
    SIM_PID=$!
    PIDS+=("$SIM_PID")
    local p
    for ((p = BASE; p <= LAST; p++)); do
        wait_http "http://127.0.0.1:$p/health" 30 "$SIM_PID" || { echo "sim-worker did not come up; log:" >&2; tail -20 "$1" >&2; exit 1; }
    done
}
stop_sims() {
    [[ -n "$SIM_PID" ]] || return 0
    stop_pid "$SIM_PID"; forget_pid "$SIM_PID"; SIM_PID=""
}

TENANTS="$OUT/tenants.toml"
cat >"$TENANTS" <<'TOML'
# Written by scripts/bench-overload.sh: the overload workload's two tenants, by API key.
[tenants.interactive]
keys = ["interactive-key"]
max_priority = 10

[tenants.batch]
keys = ["batch-key"]
max_priority = 0
TOML

# Start the gateway of configuration $1 (CAP: the fixed cap), logging to $2. Sets GW_PID, or
# GW_STATUS to why it did not start.
GW_PID=""
GW_STATUS=ok
start_gateway() { # start_gateway CONFIG LOGFILE CAP
    local cfg="$1" logf="$2" cap="$3" extra=()
    GW_STATUS=ok
    GW_PID=""
    case "$cfg" in
        baseline|a) ;;
        b) extra=(--max-concurrent-requests "$cap" --queue-size "$QUEUE_SIZE" --queue-timeout-secs "$QUEUE_TIMEOUT") ;;
        c) extra=(--saturation-admission --saturation-queue-reqs "$SAT_QUEUE" --saturation-kv-usage "$SAT_KV"
                  --queue-size "$QUEUE_SIZE" --queue-timeout-secs "$QUEUE_TIMEOUT" --config "$TENANTS") ;;
    esac
    if [[ "$cfg" == d ]]; then
        if [[ -x .venv/bin/python ]] && .venv/bin/python -c 'import sglang_router' 2>/dev/null; then
            # shellcheck disable=SC2086
            .venv/bin/python -m sglang_router.launch_router --worker-urls "${URLS[@]}" --policy cache_aware \
                --max-concurrent-requests "$cap" --queue-size "$QUEUE_SIZE" --queue-timeout-secs "$QUEUE_TIMEOUT" \
                --host 127.0.0.1 --port "$GW_PORT" --prometheus-host 127.0.0.1 --prometheus-port "$GW_METRICS_PORT" \
                --log-level warn $D_ARGS >"$logf" 2>&1 &
        else
            GW_STATUS="sglang-router $SGLANG_ROUTER_VERSION not installed"
            return 0
        fi
    else
        local c_args=""
        [[ "$cfg" == c ]] && c_args="$C_ARGS"
        # shellcheck disable=SC2086
        target/release/radixgate --worker-urls "${URLS[@]}" --policy cache_aware "${extra[@]}" \
            --host 127.0.0.1 --port "$GW_PORT" --prometheus-host 127.0.0.1 --prometheus-port "$GW_METRICS_PORT" \
            $GATEWAY_ARGS $c_args >"$logf" 2>&1 &
    fi
    GW_PID=$!
    PIDS+=("$GW_PID")
    if ! wait_http "http://127.0.0.1:$GW_PORT/readiness" 60 "$GW_PID" && ! wait_http "http://127.0.0.1:$GW_PORT/health" 5 "$GW_PID"; then
        if kill -0 "$GW_PID" 2>/dev/null; then
            GW_STATUS="gateway did not become ready"
        else
            GW_STATUS="gateway failed to start: $(grep -v '^\s*$' "$logf" | tail -3 | tr '\n' ' ' | cut -c1-300)"
        fi
        stop_gateway
    fi
}
stop_gateway() {
    [[ -n "$GW_PID" ]] || return 0
    stop_pid "$GW_PID"; forget_pid "$GW_PID"; GW_PID=""
}

# Tiny requests until all succeed (connection pools, health state). Returns non-zero when the
# gateway never answered cleanly.
warm_up() { # warm_up DIR
    for _ in $(seq 1 20); do
        if run_fg "$LOADGEN" --target "http://127.0.0.1:$GW_PORT" --workload rate --rate 20 --duration 1 --drain 5 \
            --quiet --json "$1/warmup.json" >/dev/null 2>>"$1/warmup.log" \
            && [[ "$(jq -r '.failed' "$1/warmup.json")" == 0 ]]; then return 0; fi
        sleep 0.5
    done
    return 1
}

# Empty every worker's cache after the warm-up (the idle counter and the other counters are read
# as differences over the window, so they need no reset).
flush_workers() {
    local u
    for u in "${URLS[@]}"; do
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

overload() { # overload DIR [loadgen flags...]: one overload run through the gateway
    local dir="$1"
    shift
    run_fg "$LOADGEN" --workload overload --target "http://127.0.0.1:$GW_PORT" --drain "$DRAIN" \
        --sample-workers "$WORKER_LIST" --batch-prompt-tokens "$BATCH_PROMPT" --batch-output-tokens "$BATCH_OUTPUT" \
        --quiet --json "$dir/loadgen.json" --markdown "$dir/loadgen.md" "$@" 2>"$dir/loadgen.log"
}

# ---- capacity --------------------------------------------------------------------------------
if [[ -n "$CAPACITY" ]]; then
    IFS=',' read -r CAP_RPS CAP_RUNNING <<<"$CAPACITY"
    posnum "--capacity (req/s)" "$CAP_RPS"; posnum "--capacity (running)" "${CAP_RUNNING:-}"
    CAP_QUEUED=None; CAP_IDLE=None; CAP_USERS=None
    log "capacity given: $CAP_RPS batch req/s, $CAP_RUNNING running"
else
    CAP_DIR="$OUT/runs/00-capacity"
    mkdir -p "$CAP_DIR"
    log "capacity: $CAP_USERS closed-loop batch users through radixgate (no admission) on $WORKERS workers (KV $KV_TOKENS tokens each), ${CAP_DURATION}s"
    start_sims "$CAP_DIR/sim-worker.log"
    start_gateway a "$CAP_DIR/gateway.log" 0
    [[ "$GW_STATUS" == ok ]] || { echo "radixgate did not start for the capacity probe: $GW_STATUS" >&2; exit 1; }
    warm_up "$CAP_DIR" || { echo "radixgate warm-up failed for the capacity probe" >&2; exit 1; }
    flush_workers
    overload "$CAP_DIR" --interactive-rate 0 --batch-concurrency "$CAP_USERS" --batch-ramp "$CAP_RAMP" \
        --duration "$CAP_DURATION" --warmup "$CAP_WARMUP" || { echo "capacity probe failed (see $CAP_DIR/loadgen.log)" >&2; exit 1; }
    stop_gateway; stop_sims
    read -r CAP_RPS CAP_RUNNING CAP_QUEUED CAP_IDLE < <(jq -r '[.batch.req_per_s, (.servers.running_mean // 0), (.servers.queued_mean // 0), (.servers.idle_share // 0)] | @tsv' "$CAP_DIR/loadgen.json")
    python3 -c "import sys; sys.exit(0 if float('$CAP_RPS') > 0 else 1)" || { echo "capacity probe completed no batch request" >&2; exit 1; }
fi
BATCH_RATE="$(python3 -c "print(f'{float($CAP_RPS) * float($BATCH_FACTOR):.3f}')")"
FIXED_CAP="$(python3 -c "print(max(1, round(float($CAP_RUNNING))))")"
if [[ -z "$CAPACITY" ]]; then
    log "capacity: $(printf '%.2f' "$CAP_RPS") batch req/s, $(printf '%.0f' "$CAP_RUNNING") running (queued $(printf '%.0f' "$CAP_QUEUED"), idle $(python3 -c "print(f'{float($CAP_IDLE)*100:.1f}')") %)"
    if python3 -c "import sys; sys.exit(0 if float('$CAP_QUEUED') < $WORKERS else 1)"; then
        log "warning: the workers' queues were short during the capacity probe (mean $(printf '%.1f' "$CAP_QUEUED") queued in all): the capacity may be underestimated (--capacity-users)"
    fi
fi
log "batch offered at $BATCH_RATE req/s, fixed cap $FIXED_CAP"

python3 - "$OUT/meta.json" "$COMMAND" <<PY
import json, sys
json.dump({"workers": $WORKERS, "engine": "$ENGINE", "kv_tokens_per_worker": $KV_TOKENS, "runs": $RUNS, "duration_s": $DURATION,
           "warmup_s": $WARMUP, "drain_s": $DRAIN, "configs": "$CONFIGS".split(","),
           "interactive_session_rate": $INTERACTIVE_RATE, "batch_factor": $BATCH_FACTOR,
           "batch_prompt_tokens": "$BATCH_PROMPT", "batch_output_tokens": "$BATCH_OUTPUT",
           "capacity": {"users": $CAP_USERS, "duration_s": $CAP_DURATION, "warmup_s": $CAP_WARMUP,
                        "ramp_s": $CAP_RAMP, "batch_req_per_s": $CAP_RPS, "running_mean": $CAP_RUNNING,
                        "queued_mean": $CAP_QUEUED, "idle_share": $CAP_IDLE},
           "batch_rate": $BATCH_RATE, "fixed_cap": $FIXED_CAP, "queue_size": $QUEUE_SIZE,
           "queue_timeout_s": $QUEUE_TIMEOUT, "saturation_queue_reqs": $SAT_QUEUE,
           "saturation_kv_usage": $SAT_KV, "sim_priority_scheduling": bool($SIM_PRIORITY),
           "sim_args": "$SIM_ARGS", "gateway_args": "$GATEWAY_ARGS", "c_args": "$C_ARGS", "d_args": "$D_ARGS",
           "sglang_router": "$SGLANG_ROUTER_VERSION", "command": sys.argv[2]}, open(sys.argv[1], "w"), indent=1)
PY

# ---- the configurations ------------------------------------------------------------------------
declare -A LABEL=(
    [baseline]="baseline: radixgate, interactive only"
    [a]="a: radixgate, no admission"
    [b]="b: radixgate, fixed cap $FIXED_CAP (queue $QUEUE_SIZE, ${QUEUE_TIMEOUT}s)"
    [c]="c: radixgate --saturation-admission (queue ≥ $SAT_QUEUE or KV ≥ $SAT_KV; queue $QUEUE_SIZE, ${QUEUE_TIMEOUT}s) + tenants${C_ARGS:+ $C_ARGS}"
    [d]="d: sglang-router $SGLANG_ROUTER_VERSION cache_aware, cap $FIXED_CAP (queue $QUEUE_SIZE, ${QUEUE_TIMEOUT}s)${D_ARGS:+ $D_ARGS}"
)
run_config() { # run_config RUN CONFIG
    local run="$1" cfg="$2" dir status=ok load_before="" load_after=""
    dir="$OUT/runs/r$run-$cfg"
    mkdir -p "$dir"
    log "[run $run/$RUNS] ${LABEL[$cfg]}"
    start_sims "$dir/sim-worker.log"
    start_gateway "$cfg" "$dir/gateway.log" "$FIXED_CAP"
    status="$GW_STATUS"
    if [[ "$status" == ok ]] && ! warm_up "$dir"; then status="warm-up failed"; fi
    [[ "$status" == ok ]] && flush_workers
    if [[ "$status" == ok ]]; then
        local batch=(--batch-rate "$BATCH_RATE")
        [[ "$cfg" == baseline ]] && batch=(--batch-rate 0)
        load_before="$(cut -d' ' -f1 /proc/loadavg)"
        overload "$dir" --interactive-rate "$INTERACTIVE_RATE" "${batch[@]}" --duration "$DURATION" --warmup "$WARMUP" \
            --seed "$run" || status="loadgen failed (see loadgen.log)"
        load_after="$(cut -d' ' -f1 /proc/loadavg)"
    fi
    stop_gateway; stop_sims
    # The machine's 1-minute load average before and after: other processes on the same CPUs
    # (builds, tests) stall the simulated GPUs and the gateway alike, and show in the tails.
    python3 - "$dir/run.json" "$run" "$cfg" "${LABEL[$cfg]}" "$status" "${load_before:-}" "${load_after:-}" <<'PY'
import json, sys
run = {"run": int(sys.argv[2]), "config": sys.argv[3], "label": sys.argv[4], "status": sys.argv[5]}
if sys.argv[6] and sys.argv[7]:
    run["load"] = [float(sys.argv[6]), float(sys.argv[7])]
json.dump(run, open(sys.argv[1], "w"))
PY
    if [[ "$status" == ok ]]; then
        log "[run $run/$RUNS] $cfg: $(jq -r '"interactive TTFT p99 \(.interactive.ttft.p99_ms | floor) ms, batch goodput \(.batch.output_tok_per_s | floor) out tok/s, 429 \(.batch.refused), timed out \(.batch.timed_out), KV \((.servers.kv_usage_mean // 0) * 100 | floor) %, idle \((.servers.idle_share // 0) * 100 | floor) %"' "$dir/loadgen.json")"
    else
        log "[run $run/$RUNS] $cfg FAILED: $status"
    fi
}

for ((run = 1; run <= RUNS; run++)); do
    for cfg in "${CONFIG_LIST[@]}"; do run_config "$run" "$cfg"; done
done

make_report
log "report: $OUT/report.md"
if [[ "$WRITE_DOCS" == 1 ]]; then
    python3 scripts/bench-docs.py write "$DOCS_SECTION" "$OUT/docs.md" --command "$COMMAND"
fi
