#!/usr/bin/env bash
# Request-path cost of routing on KV events: the latency radixgate adds for turn 10 of a
# conversation with a ~4k-token history, event mode (--kv-events, with --tokenizer-path when a
# tokenizer folder exists; segment cache warm) against text-tree mode, side by side in one run.
#
#   scripts/bench-turn-latency.sh [DURATION_SECS] [RUNS] [--page-size N] [--tokenizer-path DIR]
#                                 [--make-tokenizer CMD] [--no-criterion] [--write-docs]
#
# Method (as scripts/bench-latency.sh): one simulated worker answering at once
# (--token-interval-ms 0, one output token) publishing KV events, wrk on CPU 1 with the worker,
# two gateways (text tree; --kv-events) pinned to CPU 0, all at one connection (wrk -c1, closed
# loop). Each run measures direct, text-tree and event mode back to back on the same body; the
# medians over RUNS are reported, with the added p50/p99 (gateway − direct) and event − text
# (the median of each run's own difference; the order of the three rotates run by run).
# Two bodies:
# - chat: /v1/chat/completions, system prompt + 9 user/assistant pairs + the 10th user turn,
#   ~4k tokens. Event mode measures it in tokens only with a tokenizer (scripts/tokenizer-folder.sh
#   writes one when none is given); without one it falls back to the text tree, and the table says so.
# - generate-ids: /generate with ~4k input_ids, measured in tokens without a tokenizer (the index
#   path alone: id parsing, block chain, index match, pending entries).
# --page-size is the worker's KV page (default 1, SGLang's default): the index holds one block per
# page, so the event path's per-request work grows with prompt tokens / page size.
# The history (system prompt and turns 1-9) is the same in every request, so after the warm-up
# the worker holds it, the index knows it (events) and the tokenizer's segment cache holds its
# messages; the 10th user turn is new in every request (wrk appends a number no earlier request
# used: each run starts at a random offset), so
# each request tokenizes its new message, as turn 10 of a live conversation does ("segment
# cache warm"). The generate-ids body is sent unchanged.
# Verdict (issue 10): event mode's added p50 for the chat body at most 150 µs above text-tree
# mode, printed as PASS/FAIL. Beside it, from `cargo bench --bench tokenize` (criterion, same
# tokenizer folder): a cold 4k-token chat's tokenizing time and the tokenizer's throughput on
# one core (tokens/s); --no-criterion skips that part.
# --write-docs puts the table, the verdict and the tokenizer lines into docs/benchmarks.md
# (section turn-latency) with the command and the machine (scripts/bench-docs.py).
# Only 127.0.0.1; every process started here is stopped by PID on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=10
RUNS=5
TOKENIZER_PATH=""
MAKE_TOKENIZER=""
PAGE_SIZE=1
CRITERION=1
LIMIT_US=150
WRITE_DOCS=0
COMMAND="scripts/bench-turn-latency.sh$(printf ' %q' "$@")"
pos=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --tokenizer-path) TOKENIZER_PATH="$2"; shift 2 ;;
        --make-tokenizer) MAKE_TOKENIZER="$2"; shift 2 ;;
        --page-size) PAGE_SIZE="$2"; shift 2 ;;
        --no-criterion) CRITERION=0; shift ;;
        --write-docs) WRITE_DOCS=1; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) pos+=("$1"); shift ;;
    esac
done
[[ ${#pos[@]} -ge 1 ]] && DURATION="${pos[0]}"
[[ ${#pos[@]} -ge 2 ]] && RUNS="${pos[1]}"
command -v wrk >/dev/null || { echo "installing wrk (Debian package)"; apt-get install -y wrk >/dev/null; }
cargo build --release -q -p radixgate -p loadtest
pids=()
WORK="$(mktemp -d)"
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT INT TERM

given=()
[[ -n "$TOKENIZER_PATH" ]] && given=(--given "$TOKENIZER_PATH")
TOK_NOTE=""
if TOKENIZER_PATH="$(scripts/tokenizer-folder.sh "$WORK/tokenizer" "${given[@]}" --make "$MAKE_TOKENIZER" 2>"$WORK/tok.log")"; then
    SIM_TOK=(--tokenizer-path "$TOKENIZER_PATH")
    target/release/sim-worker --help | grep -q -- '--tokenizer-path' || SIM_TOK=(--tokenizer bpe)
    GW_TOK=(--tokenizer-path "$TOKENIZER_PATH")
    TOK_NOTE="tokenizer: $TOKENIZER_PATH"
else
    TOKENIZER_PATH=""
    SIM_TOK=(--tokenizer approx)
    GW_TOK=()
    TOK_NOTE="no tokenizer ($(tr '\n' ' ' <"$WORK/tok.log"))"
fi

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
SIM=$(free_port); GT=$(free_port); GE=$(free_port); GEM=$(free_port)
KV_CFG='{"publisher":"zmq","endpoint":"tcp://127.0.0.1:*","replay_endpoint":"tcp://127.0.0.1:*"}'
taskset -c 1 target/release/sim-worker --ports "$SIM" "${SIM_TOK[@]}" --token-interval-ms 0 --page-size "$PAGE_SIZE" \
    --kv-events-config "$KV_CFG" >"$WORK/sim.log" 2>&1 & pids+=($!)
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$SIM/health" >/dev/null && break; sleep 0.1; done
taskset -c 0 target/release/radixgate --host 127.0.0.1 --port "$GT" --prometheus-port 0 --cpu-list 0 \
    --worker-urls "http://127.0.0.1:$SIM" --log-level warn & pids+=($!)
taskset -c 0 target/release/radixgate --host 127.0.0.1 --port "$GE" --prometheus-host 127.0.0.1 --prometheus-port "$GEM" \
    --cpu-list 0 --worker-urls "http://127.0.0.1:$SIM" --kv-events "${GW_TOK[@]}" --log-level warn & pids+=($!)
for port in "$GT" "$GE"; do
    for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/readiness" >/dev/null && break; sleep 0.1; done
done
for _ in $(seq 100); do
    w=$(curl -s "http://127.0.0.1:$GEM/metrics" | awk '$1 == "radixgate_kv_warm_workers" { print int($2) }')
    [[ "${w:-0}" -ge 1 ]] && break
    sleep 0.1
done

# Bodies: ~4k tokens (3- and 4-letter words are one token each in the simulator's tokenizers).
python3 - "$WORK" <<'PY'
import json, random, sys
d = sys.argv[1]
rng = random.Random(10)
words = ("the and for are but not you all any can had her was one our out day get has him his how "
         "man new now old see two way who boy did its let put say she too use that with have this will "
         "your from they know want been good much some time very when come here just like long make "
         "many over such take than them well were").split()
say = lambda n: " ".join(rng.choice(words) for _ in range(n))
msgs = [{"role": "system", "content": say(400)}]
for _ in range(9):
    msgs += [{"role": "user", "content": say(200)}, {"role": "assistant", "content": say(200)}]
msgs.append({"role": "user", "content": say(100)})
json.dump({"model": "default", "messages": msgs, "max_tokens": 1, "temperature": 0, "stream": False},
          open(f"{d}/chat.json", "w"))
ids = [rng.randrange(1, 100_000) for _ in range(4000)]
json.dump({"input_ids": ids, "sampling_params": {"max_new_tokens": 1}, "stream": False},
          open(f"{d}/ids.json", "w"))
for name, path in (("chat", "/v1/chat/completions"), ("ids", "/generate")):
    open(f"{d}/{name}.lua", "w").write(
        'wrk.method = "POST"\n'
        f'local f = io.open("{d}/{name}.json", "rb"); wrk.body = f:read("*a"); f:close()\n'
        'wrk.headers["Content-Type"] = "application/json"\n')
    open(f"{d}/{name}.path", "w").write(path)
# The chat body's last message ends in a marker that each request replaces with its own number.
body = json.load(open(f"{d}/chat.json"))
body["messages"][-1]["content"] += " turn ten NNNN"
raw = json.dumps(body)
head, tail = raw.split("NNNN")
open(f"{d}/chat.lua", "w").write(
    'wrk.method = "POST"\n'
    'wrk.headers["Content-Type"] = "application/json"\n'
    f'local head = {json.dumps(head)}\n'
    f'local tail = {json.dumps(tail)}\n'
    # Each wrk run starts its numbers at a fresh random offset: runs (and gateways) never
    # repeat a turn 10 a segment cache has already seen.
    'math.randomseed(os.time() + math.floor(os.clock() * 1000000))\n'
    'local n = math.random(1, 1000000000) * 1000\n'
    'request = function()\n'
    '  n = n + 1\n'
    '  return wrk.format(nil, nil, nil, head .. tostring(n) .. tail)\n'
    'end\n')
json.dump(body, open(f"{d}/chat.json", "w"))
PY
prompt_tokens() { # BODY PATH: the worker's prompt token count for the body
    curl -s "http://127.0.0.1:$SIM$2" -H 'Content-Type: application/json' --data-binary "@$WORK/$1.json" \
        | python3 -c 'import json,sys; v=json.load(sys.stdin); print(v.get("usage",{}).get("prompt_tokens") or v.get("meta_info",{}).get("prompt_tokens"))'
}
pct() { awk -v p="$1" '$1==p { v=$2; if (v ~ /us$/) { sub(/us$/,"",v); print v } else if (v ~ /ms$/) { sub(/ms$/,"",v); print v*1000 } else if (v ~ /s$/) { sub(/s$/,"",v); print v*1000000 } }'; }
median() { sort -n | awk '{ a[NR]=$1 } END { if (NR%2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2 }'; }
med() { printf '%s\n' "$@" | median; }
sub() { awk -v a="$1" -v b="$2" 'BEGIN{print a-b}'; }
lat() { taskset -c 1 wrk -t1 -c1 -d"${DURATION}s" --latency -s "$WORK/$2.lua" "http://127.0.0.1:$1$(cat "$WORK/$2.path")"; }
fallbacks() { curl -s "http://127.0.0.1:$GEM/metrics" | awk '/^radixgate_kv_fallback_total\{/ && $2 > 0 { printf "%s %s; ", $1, $2 }'; }

declare -A TOKS
for body in chat ids; do
    TOKS[$body]="$(prompt_tokens "$body" "$(cat "$WORK/$body.path")")"
    echo "warm-up: $body (${TOKS[$body]} prompt tokens)"
    for port in "$SIM" "$GT" "$GE"; do taskset -c 1 wrk -t1 -c1 -d2s -s "$WORK/$body.lua" "http://127.0.0.1:$port$(cat "$WORK/$body.path")" >/dev/null; done
done
FB0="$(fallbacks)"
KP0=$(curl -s "http://127.0.0.1:$GEM/metrics" | awk '$1 == "radixgate_kv_prompt_tokens_total" { print $2 }')

declare -A R
targets=(direct:"$SIM" text:"$GT" events:"$GE")
for i in $(seq "$RUNS"); do
    for body in chat ids; do
        line="run $i $body:"
        declare -A P=()
        # The order rotates run by run, so a drift of the shared worker over a run (it renders
        # and tokenizes every chat itself) is not always charged to the same gateway.
        for k in 0 1 2; do
            t=${targets[$(( (k + i) % 3 ))]}
            out=$(lat "${t#*:}" "$body")
            P[${t%%:*}]="$(pct 50% <<<"$out")"
            R[$body-${t%%:*}-50]+="$(pct 50% <<<"$out") "
            R[$body-${t%%:*}-99]+="$(pct 99% <<<"$out") "
            line+=" ${t%%:*} p50 $(pct 50% <<<"$out")us"
        done
        # This run's events − text, both measured minutes apart at most.
        R[$body-gap]+="$(sub "${P[events]}" "${P[text]}") "
        echo "$line (events − text $(sub "${P[events]}" "${P[text]}") µs)"
    done
done
FB1="$(fallbacks)"
KP1=$(curl -s "http://127.0.0.1:$GEM/metrics" | awk '$1 == "radixgate_kv_prompt_tokens_total" { print $2 }')

echo
echo "worker page size $PAGE_SIZE; $TOK_NOTE; build $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo +dirty); $(nproc) CPUs"
echo
{
echo "| body (one connection, medians of $RUNS runs × ${DURATION}s) | prompt tokens | direct p50 µs | text-tree added p50 / p99 µs | event-mode added p50 / p99 µs | events − text, p50 µs (median of the runs' own differences) |"
echo "|---|---|---|---|---|---|"
for body in chat ids; do
    # shellcheck disable=SC2086
    {
        d50=$(med ${R[$body-direct-50]}); d99=$(med ${R[$body-direct-99]})
        t50=$(med ${R[$body-text-50]}); t99=$(med ${R[$body-text-99]})
        e50=$(med ${R[$body-events-50]}); e99=$(med ${R[$body-events-99]})
    }
    name="turn 10 chat, $(cat "$WORK/$body.path")"
    [[ "$body" == ids ]] && name="/generate input_ids"
    # shellcheck disable=SC2086
    gap=$(med ${R[$body-gap]})
    echo "| $name | ${TOKS[$body]} | $d50 | $(sub "$t50" "$d50") / $(sub "$t99" "$d99") | $(sub "$e50" "$d50") / $(sub "$e99" "$d99") | $gap (per run: ${R[$body-gap]% }) |"
done
echo
echo "event-mode gateway: radixgate_kv_prompt_tokens_total +$(sub "${KP1:-0}" "${KP0:-0}") during the runs; fallbacks before the runs: ${FB0:-none}; after: ${FB1:-none}"
if [[ -z "$TOKENIZER_PATH" ]]; then
    echo "NOTE: no tokenizer — the chat row's event mode fell back to the text tree (no_tokenizer): it does not measure tokenizing."
fi
# shellcheck disable=SC2086
extra=$(med ${R[chat-gap]})
if [[ -z "$TOKENIZER_PATH" ]]; then
    echo "verdict: not judged (no tokenizer: event mode did not tokenize the chat body)"
elif awk -v e="$extra" -v l="$LIMIT_US" 'BEGIN { exit !(e <= l) }'; then
    echo "verdict: PASS — turn 10 in event mode adds ${extra} µs p50 over text-tree mode (limit ${LIMIT_US} µs)"
else
    echo "verdict: FAIL — turn 10 in event mode adds ${extra} µs p50 over text-tree mode (limit ${LIMIT_US} µs)"
fi
} | tee "$WORK/docs.md"

if [[ "$CRITERION" == 1 ]]; then
    # The tokenizer's own figures, beside the latency: criterion on the same machine (the gateways
    # are stopped first so they do not share its CPU).
    cleanup_gateways() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; pids=(); }
    cleanup_gateways
    {
    echo
    echo "Tokenizer (cargo bench --bench tokenize, medians; the simulator's cl100k vocabulary as a HF folder, as scripts/tokenizer-folder.sh writes it):"
    echo
    out=$(timeout 900 cargo bench -q --bench tokenize -- \
        --warm-up-time 1 --measurement-time 3 'chat/cold_4k|chat/warm_turn10_4k|encode/prose_4k$' 2>&1 || true)
    awk '
        /^chat\/cold_4k|^chat\/warm_turn10_4k|^encode\/prose_4k/ { name = $1 }
        name && /time:/ { sub(/.*time: *\[/, ""); split($0, t, " "); printf "- %s: %s %s per prompt\n", name, t[3], t[4] }
        name && /thrpt:/ { sub(/.*thrpt: *\[/, ""); split($0, t, " "); printf "  %s %s\n", t[3], t[4]; name = "" }
    ' <<<"$out"
    echo "(thrpt in elements/s = tokens/s on one core: chat/cold_4k renders the template and encodes the whole 4k-token chat; chat/warm_turn10_4k encodes turn 10 with turns 1-9 in the segment cache; encode/prose_4k is 4k tokens of plain text.)"
    } | tee -a "$WORK/docs.md"
fi
if [[ "$WRITE_DOCS" == 1 ]]; then
    python3 scripts/bench-docs.py write turn-latency "$WORK/docs.md" --command "$COMMAND"
fi
