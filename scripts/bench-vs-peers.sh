#!/usr/bin/env bash
# radixgate against its peers in one run: peak requests/s, latency at one connection, CPU per
# request and resident memory, every proxy on the same single CPU.
#
#   scripts/bench-vs-peers.sh [--duration S] [--rounds N] [--bodies 1k,16k,400k]
#       [--body-kinds fixed,conversation] [--sessions N] [--turns N] [--candidates a,b,...]
#       [--connections C] [--skip-build] [--radixgate-bin PATH] [--sim-bin PATH]
#       [--no-sglang-router] [--upstream sim|static] [--busy-poll-us N]
#       [--out DIR] [--write-docs [--docs-section NAME]] [--help]
#
# Candidates (default: all):
#   direct                     wrk straight to the upstream (no proxy)
#   radixgate-cache_aware      radixgate --policy cache_aware --cpu-list 0
#   radixgate-round_robin      radixgate --policy round_robin --cpu-list 0
#   radixgate-cache_aware-busy_poll
#                              radixgate cache_aware with --busy-poll-us N (--busy-poll-us, default
#                              50): the core polls for I/O that long after each request event
#                              instead of halting its CPU at once (not in the default list: name it)
#   sglang-router-cache_aware  sglang-router 0.3.2 (PyPI, installed into .venv/ as
#   sglang-router-round_robin  scripts/compare-policies.sh does), TOKIO_WORKER_THREADS=1
#   nginx-round_robin          nginx, worker_processes 1, round robin to a keep-alive upstream group
#                              (apt-get installed when missing; run as the current user with its own
#                              prefix, pid, logs and temp paths under the results folder)
#
# Placement (a 2-core machine): every proxy is pinned with taskset to CPU 0 (the whole process, so
# radixgate's tree writer and sglang-router's Tokio threads too); the load generator (wrk, one
# thread) and the upstream share CPU 1. The upstream is one simulated SGLang worker
# (sim-worker --token-interval-ms 0 --tokenizer approx: answers at once, one output token), a
# single monoio thread; "direct" therefore measures wrk and the worker together on CPU 1. The
# report gives each CPU's busy share during the peak runs, so a run bound by CPU 1 (wrk plus the
# upstream) rather than by the proxy shows as a proxy below ~90 % busy.
#
# --upstream static: instead of the simulated worker, a second nginx (one worker process, CPU 1)
# answers every request with the simulated worker's own answers, captured at start-up (health,
# model and server info, the chat completion), without looking at the body. The simulated worker
# tokenizes every prompt (most of its time at 16 KiB and 400 KiB bodies), so with it CPU 1
# saturates before any proxy does and peak ratios crowd towards 1; the static upstream lifts that
# ceiling (on this 2-core machine direct reached ~50-60k/35-50k/2.6-4k req/s at 1/16/400 KiB
# against ~41k/9k/240 with the simulated worker).
#
# Bodies: OpenAI chat-completion requests (POST /v1/chat/completions, max_tokens 1, not streamed)
# whose `messages` are generated multi-turn English-like text, at each size of --bodies (1k, 16k,
# 400k, 2m, ...), of two kinds (--body-kinds, default both, measured in the same run):
#   fixed          exactly that size, the same bytes on every request: after the first request a
#                  cache-aware tree matches the whole prompt and inserts nothing (its best path)
#   conversation   --sessions (default 64) conversations side by side, each growing turn by turn:
#                  request k goes to conversation k mod --sessions, whose request is its earlier
#                  turns (user and assistant) plus one new user message. 4 system prompts, each
#                  shared by a quarter of the conversations; each conversation's first user
#                  message begins with a tag unique to this wrk run and conversation, so nothing
#                  is ever sent twice.
#                  After --turns (default 8) turns a conversation starts over as a new one (new
#                  tag). Turn t's request is (0.5 + (t-1)/(turns-1)) × the size (0.5× to 1.5×,
#                  mean 1×), conversations start staggered across turns so every window sees the
#                  mean. A tree sees partial matches (the system prompt, or the conversation up to
#                  the previous user message: the assistant's answer is new to it) and inserts.
#                  The texts are written before any run. Where every request stays under
#                  120 KiB, wrk's Lua joins each request from them as it sends it (one copy, no
#                  formatting, only the tag new): nothing ever repeats. Larger ones (400k) would
#                  cost wrk a fresh mapping per request (~0.4 ms of page faults at 400 KiB, more
#                  than nginx spends proxying it), so wrk joins 512 MiB of them in its init,
#                  before its clock starts (1,310 requests at 400k, a run's worth against the
#                  simulated worker), and cycles through them: the report says how many of a
#                  run's requests repeated. wrk's CPU is in the report (CPU-seconds per 1,000
#                  requests beside the proxy's), without what its init took.
# The same bytes (fixed) and the same sequence (conversation) for every candidate.
#
# Method: all candidates start once and stay up; after a warm-up pass (1 s each at --connections,
# which also fills the cache-aware trees with the fixed prompt and the system prompts), each round
# runs, for every body (kind and size), every candidate once in an order rotated round by round,
# so machine drift hits all alike:
#   peak     wrk -t1 -c32 for --duration seconds: req/s; the proxy's utime+stime from /proc
#            (summed over its process tree) before and after: CPU-seconds per 1,000 requests
#   latency  wrk -t1 -c1 --latency for --duration seconds: p50 and p99
# Figures are medians over rounds. Resident memory (VmRSS, and the peak VmHWM, summed over the
# process tree) is read after the last round. Ratios: radixgate cache_aware against its own
# round_robin, nginx, direct and sglang-router cache_aware; added p99 = p99 - direct's p99.
#
# Writes results/bench-vs-peers-<stamp>/report.md (printed at the end), raw.json (every run and
# the medians), raw.tsv and docs.md (the short table; --write-docs puts it into
# docs/benchmarks.md, section vs-peers-sim or vs-peers-static, or --docs-section NAME; one table
# per body kind). Defaults (5 s, 3 rounds, 6 candidates, 3 sizes × 2 kinds) take about 25
# minutes; every step has a time bound and the script stops by itself. Only 127.0.0.1; every
# process started here is stopped by PID on exit.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

ALL_CANDIDATES="direct,radixgate-cache_aware,radixgate-round_robin,sglang-router-cache_aware,sglang-router-round_robin,nginx-round_robin"
DURATION=5
ROUNDS=3
BODIES="1k,16k,400k"
BODY_KINDS="fixed,conversation"
SESSIONS=64
TURNS=8
CANDIDATES="$ALL_CANDIDATES"
# Known beyond the default list (named with --candidates).
EXTRA_CANDIDATES="radixgate-cache_aware-busy_poll"
BUSY_POLL_US=50
CONNECTIONS=32
BUILD=1
RG_BIN=""
SIM_BIN=""
SGLANG=1
UPSTREAM_KIND=sim
OUT=""
SGLANG_ROUTER_VERSION=0.3.2
PROXY_CPU=0
LOAD_CPU=1
WRITE_DOCS=0
DOCS_SECTION=""

usage() { sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --duration) DURATION="$2"; shift 2 ;;
        --rounds) ROUNDS="$2"; shift 2 ;;
        --bodies) BODIES="$2"; shift 2 ;;
        --body-kinds) BODY_KINDS="$2"; shift 2 ;;
        --sessions) SESSIONS="$2"; shift 2 ;;
        --turns) TURNS="$2"; shift 2 ;;
        --candidates) CANDIDATES="$2"; shift 2 ;;
        --connections) CONNECTIONS="$2"; shift 2 ;;
        --skip-build) BUILD=0; shift ;;
        --radixgate-bin) RG_BIN="$2"; shift 2 ;;
        --sim-bin) SIM_BIN="$2"; shift 2 ;;
        --no-sglang-router) SGLANG=0; shift ;;
        --upstream) UPSTREAM_KIND="$2"; shift 2 ;;
        --busy-poll-us) BUSY_POLL_US="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --write-docs) WRITE_DOCS=1; shift ;;
        --docs-section) DOCS_SECTION="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown option: $1 (see --help)" >&2; exit 2 ;;
    esac
done
[[ "$DURATION" =~ ^[1-9][0-9]*$ ]] || { echo "--duration: whole seconds >= 1" >&2; exit 2; }
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || { echo "--rounds: a whole number >= 1" >&2; exit 2; }
[[ "$CONNECTIONS" =~ ^[1-9][0-9]*$ ]] || { echo "--connections: a whole number >= 1" >&2; exit 2; }
[[ "$UPSTREAM_KIND" == sim || "$UPSTREAM_KIND" == static ]] || { echo "--upstream sim|static" >&2; exit 2; }
[[ "$BUSY_POLL_US" =~ ^[0-9]+$ ]] || { echo "--busy-poll-us: whole microseconds" >&2; exit 2; }

IFS=',' read -r -a CAND_LIST <<<"$CANDIDATES"
for c in "${CAND_LIST[@]}"; do
    [[ ",$ALL_CANDIDATES,$EXTRA_CANDIDATES," == *",$c,"* ]] || { echo "unknown candidate: $c (known: $ALL_CANDIDATES,$EXTRA_CANDIDATES)" >&2; exit 2; }
done
[[ "$SESSIONS" =~ ^[1-9][0-9]*$ ]] || { echo "--sessions: a whole number >= 1" >&2; exit 2; }
[[ "$TURNS" =~ ^[1-9][0-9]*$ ]] || { echo "--turns: a whole number >= 1" >&2; exit 2; }
IFS=',' read -r -a KIND_LIST <<<"$BODY_KINDS"
for k in "${KIND_LIST[@]}"; do
    [[ "$k" == fixed || "$k" == conversation ]] || { echo "--body-kinds: fixed, conversation or both, not $k" >&2; exit 2; }
done
IFS=',' read -r -a SIZE_LIST <<<"$BODIES"
# BODY_LIST: one key per kind and size, fixed first: "1k" (fixed), "1k-conv" (conversation).
BODY_LIST=()
declare -A BODY_BYTES=() BODY_KIND=() SIZE_BYTES=()
for b in "${SIZE_LIST[@]}"; do
    case "$b" in
        *[kK]) n=${b%[kK]}; mult=1024 ;;
        *[mM]) n=${b%[mM]}; mult=1048576 ;;
        *) n=$b; mult=1 ;;
    esac
    if ! [[ "$n" =~ ^[0-9]+$ ]] || (( n * mult < 512 )); then
        echo "body size: e.g. 1k, 16k, 400k (at least 512 bytes), not $b" >&2; exit 2
    fi
    [[ ",$BODY_KINDS," == *",conversation,"* ]] && (( n * mult < 1024 )) \
        && { echo "conversation bodies: sizes of at least 1k, not $b" >&2; exit 2; }
    SIZE_BYTES[$b]=$((n * mult))
done
for k in fixed conversation; do
    [[ ",$BODY_KINDS," == *",$k,"* ]] || continue
    for b in "${SIZE_LIST[@]}"; do
        key="$b"; [[ "$k" == conversation ]] && key="$b-conv"
        BODY_LIST+=("$key")
        BODY_BYTES[$key]="${SIZE_BYTES[$b]}"
        BODY_KIND[$key]="$k"
    done
done

STAMP="$(date +%Y%m%d-%H%M%S)"
OUT="${OUT:-results/bench-vs-peers-$STAMP}"
mkdir -p "$OUT/logs" "$OUT/bodies"
OUT="$(cd "$OUT" && pwd)"
LOGS="$OUT/logs"

log() { printf '[bench-vs-peers %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# ---- process bookkeeping: stop only what we started, by PID --------------------------------
PIDS=()
# shellcheck source=lib/procs.sh
source "$ROOT/scripts/lib/procs.sh"
cleanup() {
    local rc=$? p
    trap - EXIT INT TERM
    for p in "${PIDS[@]}"; do stop_pid "$p"; done
    exit "$rc"
}
trap cleanup EXIT
trap 'echo; echo "interrupted" >&2; exit 130' INT TERM



has() { [[ " ${CAND_LIST[*]} " == *" $1 "* ]]; }
drop_candidate() {
    local keep=() c
    for c in "${CAND_LIST[@]}"; do [[ "$c" == "$1" ]] || keep+=("$c"); done
    CAND_LIST=("${keep[@]}")
    NOTES+=("$1 left out: $2")
    log "$1 left out: $2"
}
NOTES=()
PLACEMENT=()

# ---- tools and binaries --------------------------------------------------------------------
command -v wrk >/dev/null || { log "installing wrk (apt-get)"; timeout 300 apt-get install -y -q wrk >"$LOGS/apt-wrk.log" 2>&1 || true; }
command -v wrk >/dev/null || { echo "wrk is missing and could not be installed" >&2; exit 1; }
if { has nginx-round_robin || [[ "$UPSTREAM_KIND" == static ]]; } && ! command -v nginx >/dev/null; then
    log "installing nginx (apt-get)"
    timeout 300 apt-get install -y -q nginx >"$LOGS/apt-nginx.log" 2>&1 || true
    if ! command -v nginx >/dev/null; then
        [[ "$UPSTREAM_KIND" == static ]] && { echo "--upstream static needs nginx, which could not be installed" >&2; exit 1; }
        drop_candidate nginx-round_robin "nginx could not be installed (see logs/apt-nginx.log)"
    fi
fi
# nginx run as the current user: when that is root, its workers must not switch to nobody.
NGINX_USER_LINE=""
[[ "$(id -u)" == 0 ]] && NGINX_USER_LINE="user $(id -un) $(id -gn);"
if [[ "$BUILD" == 1 && ( -z "$RG_BIN" || -z "$SIM_BIN" ) ]]; then
    log "building release binaries (cargo build --release -p radixgate -p loadtest)"
    cargo build --release -p radixgate -p loadtest >"$LOGS/build.log" 2>&1 || { tail -30 "$LOGS/build.log" >&2; exit 1; }
fi
RG_BIN="$(realpath "${RG_BIN:-target/release/radixgate}")"
SIM_BIN="$(realpath "${SIM_BIN:-target/release/sim-worker}")"
[[ -x "$SIM_BIN" ]] || { echo "missing $SIM_BIN (build it, or pass --sim-bin)" >&2; exit 1; }
if has radixgate-cache_aware || has radixgate-round_robin || has radixgate-cache_aware-busy_poll; then
    [[ -x "$RG_BIN" ]] || { echo "missing $RG_BIN (build it, or pass --radixgate-bin)" >&2; exit 1; }
fi

# sglang-router: the pinned version in .venv/ (the venv scripts/compare-policies.sh creates).
SGL_PY="$ROOT/.venv/bin/python"
if has sglang-router-cache_aware || has sglang-router-round_robin; then
    reason=""
    if [[ "$SGLANG" == 0 ]]; then
        reason="--no-sglang-router"
    else
        have="$("$SGL_PY" -c 'import importlib.metadata as m; print(m.version("sglang-router"))' 2>/dev/null || true)"
        if [[ "$have" != "$SGLANG_ROUTER_VERSION" ]]; then
            log "installing sglang-router==$SGLANG_ROUTER_VERSION into .venv/ (at most 5 minutes)"
            [[ -x "$SGL_PY" ]] || timeout 120 python3 -m venv .venv >"$LOGS/venv.log" 2>&1 || true
            if [[ -x "$SGL_PY" ]]; then
                timeout 300 "$SGL_PY" -m pip install -q "sglang-router==$SGLANG_ROUTER_VERSION" >>"$LOGS/venv.log" 2>&1 || true
            fi
            have="$("$SGL_PY" -c 'import importlib.metadata as m; print(m.version("sglang-router"))' 2>/dev/null || true)"
        fi
        [[ "$have" == "$SGLANG_ROUTER_VERSION" ]] \
            || reason="sglang-router==$SGLANG_ROUTER_VERSION could not be installed from PyPI (unreachable? see logs/venv.log)"
    fi
    if [[ -n "$reason" ]]; then
        for c in sglang-router-cache_aware sglang-router-round_robin; do has "$c" && drop_candidate "$c" "$reason"; done
    fi
fi
[[ ${#CAND_LIST[@]} -gt 0 ]] || { echo "no candidates left" >&2; exit 1; }

# ---- request bodies --------------------------------------------------------------------------
for b in "${BODY_LIST[@]}"; do
    [[ "${BODY_KIND[$b]}" == fixed ]] || continue
    python3 - "${BODY_BYTES[$b]}" "$OUT/bodies/$b.json" <<'PY'
import json, random, sys

target, path = int(sys.argv[1]), sys.argv[2]
rng = random.Random(11)
words = ("the a of to and in that is for it as with was on be by this are from or at an which "
         "have not but they we can their has were more one all there been if would will when so "
         "cache prefix request worker router gateway model token prompt latency throughput memory "
         "conversation answer question system user assistant context window batch queue schedule "
         "server client network socket buffer kernel thread process core pool connection stream "
         "result value function return error retry timeout health policy balance load tree node "
         "edge match insert evict text byte string vector matrix layer attention decode prefill "
         "please explain how why what where could should might describe compare summarize list "
         "example detail step first second then finally because however therefore also only").split()

def sentence():
    n = rng.randint(6, 22)
    s = " ".join(rng.choice(words) for _ in range(n))
    return s[0].upper() + s[1:] + rng.choice([".", ".", ".", "?", "!", ":"])

def paragraph():
    return " ".join(sentence() for _ in range(rng.randint(2, 6)))

def turn_text():
    return "\n\n".join(paragraph() for _ in range(rng.randint(1, 3)))

def body(messages):
    return json.dumps({"model": "meta-llama/Llama-3.1-8B-Instruct", "messages": messages,
                       "max_tokens": 1, "temperature": 0, "stream": False},
                      separators=(",", ":")).encode()

messages = [{"role": "system", "content": "You are a helpful assistant. " + paragraph()}]
role = "user"
while len(body(messages)) < target:
    messages.append({"role": role, "content": turn_text()})
    role = "assistant" if role == "user" else "user"
# Back under the size with an assistant turn last, then one user turn cut to the exact size.
messages.pop()
while len(messages) > 1 and messages[-1]["role"] != "assistant":
    messages.pop()
text = ""
while len(text) < target:
    text += turn_text() + "\n\n"
messages.append({"role": "user", "content": text})
# Trim the last turn to the exact size (pad with spaces where an escape made it one short).
last = messages[-1]["content"]
lo, hi = 0, len(last)
while lo < hi:
    mid = (lo + hi + 1) // 2
    messages[-1]["content"] = last[:mid]
    if len(body(messages)) <= target:
        lo = mid
    else:
        hi = mid - 1
messages[-1]["content"] = last[:lo].rstrip()
while len(body(messages)) < target:
    messages[-1]["content"] += " "
data = body(messages)
if len(data) != target:
    sys.exit(f"body is {len(data)} bytes, wanted {target}")
open(path, "wb").write(data)
PY
    cat >"$OUT/bodies/$b.lua" <<LUA
local f = assert(io.open("$OUT/bodies/$b.json", "rb"))
wrk.body = f:read("*a")
f:close()
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
LUA
done
# Conversations: every session's text written once, cut into the pieces wrk's Lua joins.
CONV_STATS=()
declare -A CONV_POOL=()
for b in "${BODY_LIST[@]}"; do
    [[ "${BODY_KIND[$b]}" == conversation ]] || continue
    stats="$(python3 - "${BODY_BYTES[$b]}" "$SESSIONS" "$TURNS" "$OUT/bodies/$b" <<'PY'
import json, random, statistics, sys

target, sessions, turns, base = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
TAGLEN = 21  # "<12 digits of the wrk run>-<8 digits of the conversation>", set by the Lua per request
PLACE = "#" * TAGLEN  # no '#' anywhere else in the text
SYSTEM_PROMPTS = min(4, sessions)
words = ("the a of to and in that is for it as with was on be by this are from or at an which "
         "have not but they we can their has were more one all there been if would will when so "
         "cache prefix request worker router gateway model token prompt latency throughput memory "
         "conversation answer question system user assistant context window batch queue schedule "
         "server client network socket buffer kernel thread process core pool connection stream "
         "result value function return error retry timeout health policy balance load tree node "
         "edge match insert evict text byte string vector matrix layer attention decode prefill "
         "please explain how why what where could should might describe compare summarize list "
         "example detail step first second then finally because however therefore also only").split()

def text(rng, chars):
    """At least `chars` characters of paragraphs."""
    out = []
    n = 0
    while n < chars:
        sents = []
        for _ in range(rng.randint(2, 6)):
            s = " ".join(rng.choices(words, k=rng.randint(6, 22)))
            sents.append(s[0].upper() + s[1:] + rng.choice([".", ".", ".", "?", "!", ":"]))
        p = " ".join(sents)
        out.append(p)
        n += len(p) + 2
    return "\n\n".join(out)

def body(messages):
    return json.dumps({"model": "meta-llama/Llama-3.1-8B-Instruct", "messages": messages,
                       "max_tokens": 1, "temperature": 0, "stream": False},
                      separators=(",", ":"))

def fit(messages, role, lead, rng, size):
    """Append a `role` message (`lead` + text) making the body exactly `size` bytes."""
    messages.append({"role": role, "content": lead})
    need = size - len(body(messages))  # bytes of JSON-escaped text to add
    if need < 0:
        sys.exit(f"conversation at {target} bytes: a {role} turn does not fit in {size} bytes "
                 f"(fewer --turns, or a larger size)")
    src = text(rng, need)
    # The text is ASCII with newlines (escaped as two bytes) as its only escaped character.
    n = min(len(src), need - src.count("\n", 0, need))
    content = src[:n].rstrip()
    content += " " * (need - (len(content) + content.count("\n")))
    messages[-1]["content"] = lead + content
    assert len(body(messages)) == size

# Turn t's request: (0.5 + (t-1)/(turns-1)) × target bytes; the mean over turns is the target.
sizes = [target] if turns == 1 else [round(target * (0.5 + t / (turns - 1))) for t in range(turns)]
systems = []
for k in range(SYSTEM_PROMPTS):
    rng = random.Random(500 + k)
    s = "You are a helpful assistant. " + text(rng, target // 8)
    systems.append(s[:max(40, target // 8)].rstrip() + ".")

tail = None
data, index, all_sizes = [], [], []
for s in range(sessions):
    rng = random.Random(1000 + s)
    msgs = [{"role": "system", "content": systems[s % SYSTEM_PROMPTS]}]
    bodies = []
    for t, size in enumerate(sizes):
        if t == 0:
            fit(msgs, "user", f"Conversation {PLACE}. ", rng, size)
        else:
            fit(msgs, "assistant", "", rng, sizes[t - 1] + round(0.6 * (size - sizes[t - 1])))
            fit(msgs, "user", "", rng, size)
        bodies.append(body(msgs))
    full = bodies[-1]
    cut = full.index('],"max_tokens":')
    tail = full[cut:]
    tag = full.index(PLACE)
    assert full.count(PLACE) == 1
    head = full[:tag]
    ends = [len(x) - len(tail) for x in bodies]
    pieces = [full[tag + TAGLEN:ends[0]]] + [full[ends[i - 1]:ends[i]] for i in range(1, turns)]
    for t, x in enumerate(bodies):  # what the Lua will join is the body we built
        assert head + PLACE + "".join(pieces[:t + 1]) + tail == x and x.endswith(tail)
        all_sizes.append(len(x))
    data.append(head)
    data.extend(pieces)
    index.append("{head=%d,pieces={%s}}" % (len(head), ",".join(str(len(p)) for p in pieces)))
    if s == 0:  # the largest request of the first conversation: the 200 check before the runs
        json.loads(full)
        open(base + ".json", "w").write(full.replace(PLACE, "000000000000-00000000"))
data.append(tail)
# Joining a request per request is cheap while it stays under LuaJIT's direct-mmap size (128 KiB):
# above it every new string is a fresh mapping whose page faults cost wrk ~0.4 ms per 400 KiB
# request, more than nginx spends proxying it. Larger mixes are joined in init instead, POOL
# requests (POOL_BYTES of them, at least one pass of every conversation's turns) that the run
# then cycles through: requests beyond POOL in one run repeat an earlier one of that run.
POOL_BYTES = 512 << 20
pool = 0 if max(all_sizes) + 200 < (120 << 10) else max(sessions * turns, POOL_BYTES // target)
open(base + ".data", "w").write("".join(data))
open(base + ".index.lua", "w").write(
    "return {turns=%d,taglen=%d,tail=%d,sessions={\n%s}}\n" % (turns, TAGLEN, len(tail), ",\n".join(index)))
# Lua for wrk: the pieces read and the headers built in init (before the clock starts); request()
# only joins the pieces of the next conversation's next turn with its tag.
open(base + ".lua", "w").write(r'''-- Written by scripts/bench-vs-peers.sh: the conversation mix (see its --help).
local DATA, INDEX, POOL = %s, %s, %d
local sessions, turn, tag = {}, {}, {}
local S, T, tail, run, conv, k = 0, 0, "", "", 0, 0
local buf = {}

local function new_tag(i)
    conv = conv + 1
    tag[i] = run .. "-" .. string.format("%%08d", conv %% 100000000)
end

function init(args)
    local f = assert(io.open(DATA, "rb"))
    local data = f:read("*a")
    f:close()
    local index = dofile(INDEX)
    local pos = 1
    local function take(n)
        local s = data:sub(pos, pos + n - 1)
        pos = pos + n
        return s
    end
    T = index.turns
    local host = wrk.headers["Host"]
    for i, e in ipairs(index.sessions) do
        local ses = {head = take(e.head), pieces = {}, hdr = {}}
        for t = 1, T do ses.pieces[t] = take(e.pieces[t]) end
        sessions[i] = ses
    end
    tail = take(index.tail)
    assert(pos == #data + 1, "index and data disagree")
    for _, ses in ipairs(sessions) do
        local n = #ses.head + index.taglen + #tail
        for t = 1, T do
            n = n + #ses.pieces[t]
            ses.hdr[t] = "POST " .. wrk.path .. " HTTP/1.1\r\nHost: " .. host ..
                "\r\nContent-Type: application/json\r\nContent-Length: " .. n .. "\r\n\r\n"
        end
    end
    S = #sessions
    -- Unique per wrk run (the script sets it per run), so no run repeats an earlier one's text.
    run = ("000000000000" .. (os.getenv("BENCH_RUN_ID") or tostring(os.time()))):sub(-12)
    for i = 1, S do
        turn[i] = (i - 1) %% T  -- staggered: every window sees every turn alike
        new_tag(i)
    end
    if POOL > 0 then  -- large requests: all joined here, before the clock starts
        local pool, p = {}, 0
        for i = 1, POOL do pool[i] = build() end
        request = function()
            p = p %% POOL + 1
            return pool[p]
        end
    end
    -- The CPU spent so far (reading, joining) and the time it ended: the run starts after it,
    -- and the script leaves it out of wrk's CPU and the run's wall time.
    local out = os.getenv("BENCH_INIT_CPU_FILE")
    if out then
        local now = "0"
        local ok, ffi = pcall(require, "ffi")
        if ok and pcall(ffi.cdef, "typedef struct { long s, ns; } bench_ts; int clock_gettime(int, bench_ts *);") then
            local ts = ffi.new("bench_ts")
            if ffi.C.clock_gettime(0, ts) == 0 then
                now = string.format("%%d.%%09d", tonumber(ts.s), tonumber(ts.ns))
            end
        end
        local h = io.open(out, "w")
        if h then
            h:write(string.format("%%.3f %%s\n", os.clock(), now))
            h:close()
        end
    end
end

function build()
    k = k %% S + 1
    local t = turn[k] + 1
    if t > T then
        t = 1
        new_tag(k)
    end
    turn[k] = t
    local ses = sessions[k]
    buf[1] = ses.hdr[t]
    buf[2] = ses.head
    buf[3] = tag[k]
    local pieces = ses.pieces
    for i = 1, t do buf[3 + i] = pieces[i] end
    buf[4 + t] = tail
    return table.concat(buf, "", 1, 4 + t)
end

request = build
''' % (json.dumps(base + ".data"), json.dumps(base + ".index.lua"), pool))
print(f"{pool}\t{min(all_sizes)}..{max(all_sizes)} B, mean {statistics.mean(all_sizes):.0f} B, "
      f"{sessions} sessions x {turns} turns, {SYSTEM_PROMPTS} system prompts of {len(systems[0])} chars, "
      + (f"{pool:,} requests joined before each run, then repeated" if pool else "joined per request"))
PY
)" || exit 1
    CONV_POOL[$b]="${stats%%$'\t'*}"
    stats="${stats#*$'\t'}"
    CONV_STATS+=("$b: $stats")
    log "conversation $b: $stats"
done
log "bodies: $(for b in "${BODY_LIST[@]}"; do printf '%s=%s B%s ' "$b" "${BODY_BYTES[$b]}" "$([[ "${BODY_KIND[$b]}" == conversation ]] && echo ' mean')"; done)"

# ---- upstream and candidates -----------------------------------------------------------------
declare -A PORT=() PID_OF=()
SIM_PORT="$(free_port)"
taskset -c "$LOAD_CPU" "$SIM_BIN" --ports "$SIM_PORT" --tokenizer approx --token-interval-ms 0 \
    >"$LOGS/sim-worker.log" 2>&1 &
SIM_PID=$!
PIDS+=("$SIM_PID")
wait_ready "http://127.0.0.1:$SIM_PORT" 30 "$SIM_PID" || { echo "sim-worker did not come up:" >&2; tail -20 "$LOGS/sim-worker.log" >&2; exit 1; }
UPSTREAM_DESC="sim-worker, one monoio thread, answers at once"
if [[ "$UPSTREAM_KIND" == static ]]; then
    # The simulated worker's answers, captured once and served by nginx on the load CPU.
    up="$OUT/upstream"
    mkdir -p "$up/tmp"
    for path in health health_generate get_model_info get_server_info model_info server_info v1/models; do
        code="$(curl -s -o "$up/answer-${path//\//__}" -w '%{http_code}' --max-time 10 "http://127.0.0.1:$SIM_PORT/$path" || true)"
        [[ "$code" == 200 ]] || rm -f "$up/answer-${path//\//__}"
    done
    curl -sf --max-time 20 -o "$up/answer-chat" -H 'Content-Type: application/json' \
        --data-binary "@$OUT/bodies/${BODY_LIST[0]}.json" "http://127.0.0.1:$SIM_PORT/v1/chat/completions" \
        || { echo "the simulated worker did not answer a chat completion" >&2; exit 1; }
    stop_pid "$SIM_PID"
    SIM_PORT="$(free_port)"
    python3 - "$up" "$SIM_PORT" "$NGINX_USER_LINE" <<'PY'
import os, sys
up, port, user = sys.argv[1], sys.argv[2], sys.argv[3]
def q(path):  # an nginx single-quoted string
    return "'" + open(path).read().replace("\\", "\\\\").replace("'", "\\'") + "'"
locs = []
for name in sorted(os.listdir(up)):
    if name.startswith("answer-") and name != "answer-chat":
        path = "/" + name[len("answer-"):].replace("__", "/")
        locs.append(f"        location = {path} {{ return 200 {q(os.path.join(up, name))}; }}")
locs.append(f"        location / {{ return 200 {q(os.path.join(up, 'answer-chat'))}; }}")
conf = f"""# Written by scripts/bench-vs-peers.sh --upstream static: the simulated worker's answers, served
# without reading more of a request than nginx must (the body is discarded).
{user}
worker_processes 1;
pid {up}/nginx.pid;
error_log {up}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {up}/tmp/client_body;
    proxy_temp_path {up}/tmp/proxy;
    fastcgi_temp_path {up}/tmp/fastcgi;
    uwsgi_temp_path {up}/tmp/uwsgi;
    scgi_temp_path {up}/tmp/scgi;
    server {{
        listen 127.0.0.1:{port};
        keepalive_requests 1000000;
        client_max_body_size 64m;
        default_type application/json;
{chr(10).join(locs)}
    }}
}}
"""
open(os.path.join(up, "nginx.conf"), "w").write(conf)
PY
    taskset -c "$LOAD_CPU" nginx -p "$up/" -e "$up/error.log" -c "$up/nginx.conf" -g 'daemon off;' >"$LOGS/upstream.log" 2>&1 &
    SIM_PID=$!
    PIDS+=("$SIM_PID")
    wait_ready "http://127.0.0.1:$SIM_PORT" 30 "$SIM_PID" || { echo "the static upstream did not come up:" >&2; cat "$LOGS/upstream.log" "$up/error.log" >&2; exit 1; }
    UPSTREAM_DESC="nginx answering the simulated worker's captured answers, one worker process"
fi
UPSTREAM="http://127.0.0.1:$SIM_PORT"

start_candidate() {
    local c="$1" port pid="" mport
    port="$(free_port)"
    case "$c" in
        direct) PORT[$c]="$SIM_PORT"; PID_OF[$c]=""; return 0 ;;
        radixgate-*)
            local policy="${c#radixgate-}" extra=()
            if [[ "$policy" == *-busy_poll ]]; then
                policy="${policy%-busy_poll}"
                extra=(--busy-poll-us "$BUSY_POLL_US")
            fi
            taskset -c "$PROXY_CPU" "$RG_BIN" --host 127.0.0.1 --port "$port" --prometheus-port 0 \
                --cpu-list "$PROXY_CPU" --worker-urls "$UPSTREAM" --policy "$policy" --log-level warn \
                "${extra[@]}" >"$LOGS/$c.log" 2>&1 &
            pid=$! ;;
        sglang-router-*)
            mport="$(free_port)"
            # No worker-thread flag in 0.3.2: TOKIO_WORKER_THREADS sizes its Tokio runtime (the
            # CPU mask alone would too: Tokio counts the CPUs it may use).
            TOKIO_WORKER_THREADS=1 taskset -c "$PROXY_CPU" "$SGL_PY" -m sglang_router.launch_router \
                --worker-urls "$UPSTREAM" --policy "${c#sglang-router-}" --host 127.0.0.1 --port "$port" \
                --prometheus-host 127.0.0.1 --prometheus-port "$mport" --log-level warn \
                >"$LOGS/$c.log" 2>&1 &
            pid=$! ;;
        nginx-round_robin)
            local run="$OUT/nginx" user_line=""
            mkdir -p "$run/tmp"
            user_line="$NGINX_USER_LINE"
            cat >"$run/nginx.conf" <<NGINX
# Written by scripts/bench-vs-peers.sh: one worker process, round robin (nginx's default) to a
# keep-alive upstream group. client_body_buffer_size keeps request bodies up to 1 MiB in memory
# (the default, 16 KiB, would write the larger ones to a temp file); everything else default.
$user_line
worker_processes 1;
pid $run/nginx.pid;
error_log $run/error.log warn;
events { worker_connections 4096; }
http {
    access_log off;
    client_body_temp_path $run/tmp/client_body;
    proxy_temp_path $run/tmp/proxy;
    fastcgi_temp_path $run/tmp/fastcgi;
    uwsgi_temp_path $run/tmp/uwsgi;
    scgi_temp_path $run/tmp/scgi;
    upstream sim {
        server 127.0.0.1:$SIM_PORT;
        keepalive 64;
        keepalive_requests 1000000;
    }
    server {
        listen 127.0.0.1:$port;
        keepalive_requests 1000000;
        client_max_body_size 64m;
        client_body_buffer_size 1m;
        location / {
            proxy_pass http://sim;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }
    }
}
NGINX
            taskset -c "$PROXY_CPU" nginx -p "$run/" -e "$run/error.log" -c "$run/nginx.conf" -g 'daemon off;' \
                >"$LOGS/$c.log" 2>&1 &
            pid=$! ;;
    esac
    PIDS+=("$pid")
    PORT[$c]="$port"; PID_OF[$c]="$pid"
}

for c in "${CAND_LIST[@]}"; do start_candidate "$c"; done
for c in "${CAND_LIST[@]}"; do
    [[ "$c" == direct ]] && continue
    if ! wait_ready "http://127.0.0.1:${PORT[$c]}" 60 "${PID_OF[$c]}"; then
        stop_pid "${PID_OF[$c]}"
        drop_candidate "$c" "did not become ready in 60 s (see logs/$c.log)"
    fi
done
# Every candidate must answer every body with 200 before the clock starts.
for c in "${CAND_LIST[@]}"; do
    for b in "${BODY_LIST[@]}"; do
        code="$(curl -s -o "$LOGS/check-$c-$b.out" -w '%{http_code}' --max-time 20 -H 'Content-Type: application/json' \
            --data-binary "@$OUT/bodies/$b.json" "http://127.0.0.1:${PORT[$c]}/v1/chat/completions" || true)"
        if [[ "$code" != 200 ]]; then
            [[ -n "${PID_OF[$c]}" ]] && stop_pid "${PID_OF[$c]}"
            drop_candidate "$c" "answered $b body with HTTP ${code:-none} (see logs/check-$c-$b.out)"
            continue 2
        fi
    done
done
[[ ${#CAND_LIST[@]} -gt 0 ]] || { echo "no candidates left" >&2; exit 1; }
threads() { local p; for p in $(tree_pids "$1"); do awk '/^Threads:/ {print $2}' "/proc/$p/status" 2>/dev/null; done | awk '{t += $1} END {print t + 0}'; }
for c in "${CAND_LIST[@]}"; do
    [[ -z "${PID_OF[$c]}" ]] && continue
    what="$(tree_pids "${PID_OF[$c]}" | wc -l) process(es), $(threads "${PID_OF[$c]}") threads, all on CPU $PROXY_CPU"
    log "$c: port ${PORT[$c]}, PID ${PID_OF[$c]}: $what"
    PLACEMENT+=("$c: $what")
done

# ---- measurement helpers (ticks and kb_sum are in lib/procs.sh) ---------------------------
# "busy idle irq" jiffies of one CPU from /proc/stat (irq: hard and soft interrupts, where the
# kernel does loopback TCP work that is charged to no process).
cpu_jiffies() { awk -v c="cpu$1" '$1 == c { idle = $5 + $6; busy = 0; for (i = 2; i <= 9; i++) busy += $i; print busy - idle, idle, $7 + $8 }' /proc/stat; }
share() { awk -v x="$1" -v b="$2" -v i="$3" 'BEGIN {printf "%.3f", (b + i) ? x / (b + i) : 0}'; } # share PART BUSY IDLE
# wrk prints percentiles as "50%  112.00us"; to microseconds.
pct() { awk -v p="$1" '$1==p { v=$2; if (v ~ /us$/) { sub(/us$/,"",v); print v } else if (v ~ /ms$/) { sub(/ms$/,"",v); print v*1000 } else if (v ~ /s$/) { sub(/s$/,"",v); print v*1000000 } }'; }
wrk_errors() { # non-2xx responses + socket errors
    awk '/Non-2xx or 3xx responses:/ { n += $NF } /Socket errors:/ { for (i = 1; i <= NF; i++) if ($i ~ /^[0-9]+,?$/) { v = $i; sub(/,/, "", v); n += v } } END { print n + 0 }'
}
run_wrk() { # run_wrk CONNS SECS URL LUA [--latency]
    local conns="$1" secs="$2" url="$3" lua="$4"; shift 4
    # BENCH_RUN_ID: the conversation mix's tags differ from one wrk run to the next.
    # BENCH_INIT_CPU_FILE: where it writes the CPU its init took (before the clock starts).
    BENCH_RUN_ID="$(date +%s%N)" BENCH_INIT_CPU_FILE="$LOGS/.wrk-init" timeout $((secs + 60)) taskset -c "$LOAD_CPU" wrk -t1 -c"$conns" -d"${secs}s" --timeout 10s "$@" -s "$lua" "$url" 2>&1 || true
}

RAW="$OUT/raw.tsv"
printf 'round\tcandidate\tbody\tkind\trps\trequests\tp50_us\tp99_us\tproxy_cpu_s\tupstream_cpu_s\twrk_cpu_s\twall_s\tcpu%s_busy\tcpu%s_busy\tcpu%s_irq\tcpu%s_irq\terrors\twrk_init_cpu_s\n' \
    "$PROXY_CPU" "$LOAD_CPU" "$PROXY_CPU" "$LOAD_CPU" >"$RAW"
CLK_TCK="$(getconf CLK_TCK)"
TIMEFORMAT='%3U %3S'

# One wrk run with the CPU it cost around it: the proxy's process tree, the upstream, and both
# CPUs as a whole (other tenants' load included). Appends a row to raw.tsv; prints wrk's output.
measured_run() { # measured_run ROUND CANDIDATE BODY KIND CONNS [wrk flags]
    local r="$1" c="$2" b="$3" kind="$4" conns="$5" out t0 t1 s0 s1 w0 w1 p0 p1 l0 l1 p0i p1i l0i l1i p0q p1q l0q l1q
    local tf="$LOGS/.wrk-time" init
    shift 5
    rm -f "$LOGS/.wrk-init"
    read -r p0 p0i p0q < <(cpu_jiffies "$PROXY_CPU"); read -r l0 l0i l0q < <(cpu_jiffies "$LOAD_CPU")
    t0="$(ticks "${PID_OF[$c]}")"; s0="$(ticks "$SIM_PID")"; w0="$(date +%s.%N)"
    # wrk's own CPU (user + system, from the time keyword: TIMEFORMAT above).
    out="$( { time run_wrk "$conns" "$DURATION" "http://127.0.0.1:${PORT[$c]}/v1/chat/completions" "$OUT/bodies/$b.lua" "$@"; } 2>"$tf")"
    w1="$(date +%s.%N)"; t1="$(ticks "${PID_OF[$c]}")"; s1="$(ticks "$SIM_PID")"
    # What wrk's Lua init spent before its clock started (the conversation mix joins its large
    # requests there): not the run's, so out of wrk's CPU, and the wall time starts when it
    # ended. (The per-CPU busy shares still span it.)
    read -r init init_end < <(awk 'NR == 1 && $1 ~ /^[0-9.]+$/ {print $1, ($2 ~ /^[0-9.]+$/ ? $2 : 0)}' "$LOGS/.wrk-init" 2>/dev/null || true) || true
    init="${init:-0}"; init_end="${init_end:-0}"
    w0="$(awk -v a="$w0" -v e="$init_end" 'BEGIN {printf "%.6f", (e > a && e < a + 600) ? e : a}')"
    read -r p1 p1i p1q < <(cpu_jiffies "$PROXY_CPU"); read -r l1 l1i l1q < <(cpu_jiffies "$LOAD_CPU")
    echo "$out" >"$LOGS/wrk-r$r-$c-$b-$kind.txt"
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$r" "$c" "$b" "$kind" \
        "$(awk '/Requests\/sec/ {print $2}' <<<"$out")" "$(awk '/requests in/ {print $1}' <<<"$out")" \
        "$(pct 50% <<<"$out")" "$(pct 99% <<<"$out")" \
        "$(awk -v a="$t0" -v b="$t1" -v h="$CLK_TCK" 'BEGIN {printf "%.3f", (b - a) / h}')" \
        "$(awk -v a="$s0" -v b="$s1" -v h="$CLK_TCK" 'BEGIN {printf "%.3f", (b - a) / h}')" \
        "$(awk -v i="$init" '{v = $1 + $2 - i; if (v < 0) v = 0; printf "%.3f", v}' "$tf")" \
        "$(awk -v a="$w0" -v b="$w1" 'BEGIN {printf "%.3f", b - a}')" \
        "$(share "$((p1 - p0))" "$((p1 - p0))" "$((p1i - p0i))")" "$(share "$((l1 - l0))" "$((l1 - l0))" "$((l1i - l0i))")" \
        "$(share "$((p1q - p0q))" "$((p1 - p0))" "$((p1i - p0i))")" "$(share "$((l1q - l0q))" "$((l1 - l0))" "$((l1i - l0i))")" \
        "$(wrk_errors <<<"$out")" "$init" >>"$RAW"
    echo "$out"
}

measure() { # measure ROUND CANDIDATE BODY: peak at --connections, then latency at one connection
    local r="$1" c="$2" b="$3" peak lat errs
    peak="$(measured_run "$r" "$c" "$b" peak "$CONNECTIONS")"
    lat="$(measured_run "$r" "$c" "$b" latency 1 --latency)"
    errs="$(( $(wrk_errors <<<"$peak") + $(wrk_errors <<<"$lat") ))"
    log "round $r $c $b: peak $(awk '/Requests\/sec/ {print $2}' <<<"$peak") req/s; one connection p50 $(pct 50% <<<"$lat") us, p99 $(pct 99% <<<"$lat") us$( [[ "$errs" != 0 ]] && echo "; $errs failed requests")"
}

# ---- run -------------------------------------------------------------------------------------
n=${#CAND_LIST[@]}
est=$(( (n * ${#BODY_LIST[@]} * (2 * DURATION + 1) * ROUNDS + n * ${#BODY_LIST[@]} * 2) / 60 + 1 ))
log "candidates: ${CAND_LIST[*]}; bodies: ${BODY_LIST[*]}; ${ROUNDS} rounds x ${DURATION} s; about $est minutes"
log "warm-up (1 s per candidate and body)"
for c in "${CAND_LIST[@]}"; do
    for b in "${BODY_LIST[@]}"; do
        run_wrk "$CONNECTIONS" 1 "http://127.0.0.1:${PORT[$c]}/v1/chat/completions" "$OUT/bodies/$b.lua" >/dev/null
    done
done
for r in $(seq 1 "$ROUNDS"); do
    bi=0
    for b in "${BODY_LIST[@]}"; do
        for k in $(seq 0 $((n - 1))); do
            measure "$r" "${CAND_LIST[$(( (k + r - 1 + bi) % n ))]}" "$b"
        done
        bi=$((bi + 1))
    done
done

MEM="$OUT/memory.tsv"
printf 'candidate\tvmrss_kb\tvmhwm_kb\tprocesses\n' >"$MEM"
for c in "${CAND_LIST[@]}"; do
    [[ -z "${PID_OF[$c]}" ]] && continue
    printf '%s\t%s\t%s\t%s\n' "$c" "$(kb_sum "${PID_OF[$c]}" VmRSS)" "$(kb_sum "${PID_OF[$c]}" VmHWM)" \
        "$(tree_pids "${PID_OF[$c]}" | wc -l)" >>"$MEM"
done
printf 'upstream (%s, for scale)\t%s\t%s\t1\n' "$UPSTREAM_KIND" "$(kb_sum "$SIM_PID" VmRSS)" "$(kb_sum "$SIM_PID" VmHWM)" >>"$MEM"

for p in "${PIDS[@]}"; do stop_pid "$p"; done
PIDS=()

# ---- report ----------------------------------------------------------------------------------
MACHINE="$(nproc) CPUs, $(awk -F': ' '/^model name/ {print $2; exit}' /proc/cpuinfo), kernel $(uname -r)"
VERSIONS="radixgate $("$RG_BIN" --version 2>/dev/null | awk '{print $NF}' || echo '?') ($RG_BIN, built $(date -u -r "$RG_BIN" +%Y-%m-%dT%H:%MZ)), $(wrk --version 2>&1 | head -1 | awk '{print $1, $2}'), $(nginx -v 2>&1 | sed 's/^nginx version: //' || true), sglang-router $("$SGL_PY" -c 'import importlib.metadata as m; print(m.version("sglang-router"))' 2>/dev/null || echo 'not installed')"
CMDLINE="scripts/bench-vs-peers.sh --upstream $UPSTREAM_KIND --duration $DURATION --rounds $ROUNDS --bodies $BODIES --body-kinds $BODY_KINDS"
[[ ",$BODY_KINDS," == *",conversation,"* ]] && CMDLINE+=" --sessions $SESSIONS --turns $TURNS"
CMDLINE+=" --connections $CONNECTIONS --candidates $(IFS=,; echo "${CAND_LIST[*]}")"
[[ ",$(IFS=,; echo "${CAND_LIST[*]}")," == *",radixgate-cache_aware-busy_poll,"* ]] && CMDLINE+=" --busy-poll-us $BUSY_POLL_US"
NOTES_TEXT="$(printf '%s\n' "${NOTES[@]+"${NOTES[@]}"}" "${PLACEMENT[@]+"${PLACEMENT[@]}"}")"
M_MACHINE="$MACHINE" M_VERSIONS="$VERSIONS" M_CMD="$CMDLINE" M_NOTES="$NOTES_TEXT" \
M_BODIES="$(IFS=,; echo "${BODY_LIST[*]}")" M_SIZES="$BODIES" M_KINDS="$BODY_KINDS" \
M_SESSIONS="$SESSIONS" M_TURNS="$TURNS" M_POOL="$(for b in "${!CONV_POOL[@]}"; do printf '%s=%s,' "$b" "${CONV_POOL[$b]}"; done)" M_CONV_STATS="$(printf '%s\n' "${CONV_STATS[@]+"${CONV_STATS[@]}"}")" \
M_CANDS="$(IFS=,; echo "${CAND_LIST[*]}")" M_ROUNDS="$ROUNDS" M_DUR="$DURATION" M_CONNS="$CONNECTIONS" \
M_PCPU="$PROXY_CPU" M_LCPU="$LOAD_CPU" M_STAMP="$STAMP" M_BUSY_POLL_US="$BUSY_POLL_US" M_UPSTREAM="$UPSTREAM_DESC" \
python3 - "$OUT" <<'PY'
import csv, json, os, statistics, sys

out = sys.argv[1]
env = os.environ
cands = env["M_CANDS"].split(",")
bodies = env["M_BODIES"].split(",")  # one key per kind and size: "1k" (fixed), "1k-conv" (conversation)
sizes = env["M_SIZES"].split(",")
kinds = [k for k in ("fixed", "conversation") if k in env["M_KINDS"].split(",")]
def bkey(kind, size):
    return size if kind == "fixed" else f"{size}-conv"
label = {bkey(k, z): f"{z} {k}" for k in kinds for z in sizes}
pool = {k: int(v) for k, v in (x.split("=") for x in env.get("M_POOL", "").split(",") if x)}
rows = list(csv.DictReader(open(f"{out}/raw.tsv"), delimiter="\t"))
mem = {r["candidate"]: r for r in csv.DictReader(open(f"{out}/memory.tsv"), delimiter="\t")}
pcpu, lcpu = env["M_PCPU"], env["M_LCPU"]

def num(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return None

def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None

agg = {}
for c in cands:
    for b in bodies:
        pk = [r for r in rows if r["candidate"] == c and r["body"] == b and r["kind"] == "peak"]
        lt = [r for r in rows if r["candidate"] == c and r["body"] == b and r["kind"] == "latency"]
        cpu_per_k = [num(r["proxy_cpu_s"]) / num(r["requests"]) * 1000
                     for r in pk if c != "direct" and num(r["requests"])]
        wrk_per_k = [num(r["wrk_cpu_s"]) / num(r["requests"]) * 1000 for r in pk if num(r["requests"])]
        agg[(c, b)] = {
            "peak_rps": med(num(r["rps"]) for r in pk),
            "p50_us": med(num(r["p50_us"]) for r in lt),
            "p99_us": med(num(r["p99_us"]) for r in lt),
            "cpu_s_per_1k": med(cpu_per_k) if cpu_per_k else None,
            "wrk_cpu_s_per_1k": med(wrk_per_k) if wrk_per_k else None,
            "proxy_busy": med(num(r["proxy_cpu_s"]) / num(r["wall_s"]) for r in pk) if c != "direct" else None,
            "upstream_busy": med(num(r["upstream_cpu_s"]) / num(r["wall_s"]) for r in pk),
            "wrk_busy": med(num(r["wrk_cpu_s"]) / num(r["wall_s"]) for r in pk),
            "load_side_busy": med((num(r["upstream_cpu_s"]) + num(r["wrk_cpu_s"])) / num(r["wall_s"]) for r in pk),
            "others_on_proxy_cpu": med(max(0.0, num(r[f"cpu{pcpu}_busy"]) - num(r[f"cpu{pcpu}_irq"])
                                           - num(r["proxy_cpu_s"]) / num(r["wall_s"])) for r in pk),
            "others_on_load_cpu": med(max(0.0, num(r[f"cpu{lcpu}_busy"]) - num(r[f"cpu{lcpu}_irq"])
                                          - (num(r["upstream_cpu_s"]) + num(r["wrk_cpu_s"])) / num(r["wall_s"])) for r in pk),
            "irq_proxy_cpu": med(num(r[f"cpu{pcpu}_irq"]) for r in pk),
            "irq_load_cpu": med(num(r[f"cpu{lcpu}_irq"]) for r in pk),
            "cpu_proxy_busy": med(num(r[f"cpu{pcpu}_busy"]) for r in pk),
            "cpu_load_busy": med(num(r[f"cpu{lcpu}_busy"]) for r in pk),
            "errors": sum(int(num(r["errors"]) or 0) for r in pk + lt),
            "lat_proxy_busy": med(num(r["proxy_cpu_s"]) / num(r["wall_s"])
                                  for r in lt if num(r["wall_s"])) if c != "direct" else None,
            "foreign_lat": med(max(0.0, num(r[f"cpu{pcpu}_busy"]) - num(r[f"cpu{pcpu}_irq"])
                                   - num(r["proxy_cpu_s"]) / num(r["wall_s"]))
                               for r in lt if num(r["wall_s"])),
        }

def f_rps(v):
    return "—" if v is None else (f"{v / 1000:.1f}k" if v >= 10000 else f"{v:,.0f}")
def f_us(v):
    return "—" if v is None else f"{v:,.0f}"
def f_x(a, b):
    return "—" if a is None or not b else f"{a / b:.2f}×"
def f_pct(v):
    return "—" if v is None else f"{v * 100:.0f} %"

names = {"direct": "direct", "radixgate-cache_aware": "radixgate cache_aware",
         "radixgate-round_robin": "radixgate round_robin",
         "radixgate-cache_aware-busy_poll": f"radixgate cache_aware, busy poll {env['M_BUSY_POLL_US']} µs",
         "sglang-router-cache_aware": "sglang-router cache_aware",
         "sglang-router-round_robin": "sglang-router round_robin",
         "nginx-round_robin": "nginx round robin"}
proxies = [c for c in cands if c != "direct"]
L = []
L.append(f"# radixgate vs peers, {env['M_STAMP']}")
L.append("")
L.append(f"`{env['M_CMD']}`")
L.append("")
L.append(f"Machine: {env['M_MACHINE']}. {env['M_VERSIONS']}.")
L.append(f"Every proxy pinned to CPU {pcpu} (taskset, whole process); wrk (1 thread) and the upstream "
         f"({env['M_UPSTREAM']}) share CPU {lcpu}. Chat-completion bodies "
         f"(POST /v1/chat/completions, max_tokens 1); medians of {env['M_ROUNDS']} interleaved rounds "
         f"× {env['M_DUR']} s per run.")
L.append("")
if "fixed" in kinds:
    L.append("Fixed: the same bytes on every request, exactly the size.")
if "conversation" in kinds:
    L.append(f"Conversation: {env['M_SESSIONS']} conversations side by side, each growing turn by turn "
             f"({env['M_TURNS']} turns, then a new conversation): each request is its conversation's earlier "
             "turns plus a new user message, 0.5× to 1.5× the size (mean 1×), 4 shared system prompts, "
             "every conversation tagged unique per wrk run. Request sizes as generated: "
             + "; ".join(x for x in env["M_CONV_STATS"].split("\n") if x) + ".")
L.append("")
def table(title, key, fmt, cs):
    L.append(f"**{title}**")
    L.append("")
    L.append("| body | " + " | ".join(names[c] for c in cs) + " |")
    L.append("|---" * (len(cs) + 1) + "|")
    for b in bodies:
        L.append(f"| {label[b]} | " + " | ".join(fmt(agg[(c, b)][key]) for c in cs) + " |")
    L.append("")
table(f"Peak req/s (wrk -c{env['M_CONNS']})", "peak_rps", f_rps, cands)
table("p50 latency at one connection (µs)", "p50_us", f_us, cands)
table("p99 latency at one connection (µs)", "p99_us", f_us, cands)
if "direct" in cands and proxies:
    L.append("**Added p99 at one connection (p99 − direct's p99, µs)**")
    L.append("")
    L.append("| body | " + " | ".join(names[c] for c in proxies) + " |")
    L.append("|---" * (len(proxies) + 1) + "|")
    for b in bodies:
        d = agg[("direct", b)]["p99_us"]
        L.append(f"| {label[b]} | " + " | ".join(
            "—" if agg[(c, b)]["p99_us"] is None or d is None else f"{agg[(c, b)]['p99_us'] - d:+,.0f}"
            for c in proxies) + " |")
    L.append("")
if proxies:
    table(f"Proxy CPU-seconds per 1,000 requests (at peak)", "cpu_s_per_1k",
          lambda v: "—" if v is None else f"{v:.3f}", proxies)
table(f"wrk's own CPU-seconds per 1,000 requests (at peak, on CPU {lcpu}: the load generator, which "
      "must stay below the proxy's; the conversation mix joins each request in Lua)", "wrk_cpu_s_per_1k",
      lambda v: "—" if v is None else f"{v:.3f}", cands)
if proxies:
    table(f"Proxy's share of CPU {pcpu} at one connection (what the latency runs cost it; busy polling "
          "spends idle time here)", "lat_proxy_busy", f_pct, proxies)
L.append("**What limited the peak runs: shares of each CPU, medians over rounds**")
L.append("")
L.append(f"Each cell: CPU {pcpu} as proxy / interrupts / other processes, then CPU {lcpu} as wrk + upstream / "
         "interrupts / other processes, in % of the run (interrupts: hard and soft IRQ time, where the kernel "
         "does loopback TCP work charged to no process; other processes: everything else busy, other tenants "
         "of a shared machine; shares are approximate, the kernel may charge some interrupt time to the "
         "process it interrupted). The proxy is the limit when its share is near 100 %; otherwise it waited on "
         f"CPU {lcpu} or behind other processes. CPU-seconds per 1,000 requests compares the proxies either way.")
L.append("")
L.append("| body | " + " | ".join(names[c] for c in cands) + " |")
L.append("|---" * (len(cands) + 1) + "|")
def share(v):
    return "—" if v is None else f"{v * 100:.0f}"
for b in bodies:
    L.append(f"| {label[b]} | " + " | ".join(
        f"{share(agg[(c, b)]['proxy_busy'])} / {share(agg[(c, b)]['irq_proxy_cpu'])} / "
        f"{share(agg[(c, b)]['others_on_proxy_cpu'])} · {share(agg[(c, b)]['load_side_busy'])} / "
        f"{share(agg[(c, b)]['irq_load_cpu'])} / {share(agg[(c, b)]['others_on_load_cpu'])}" for c in cands) + " |")
L.append("")
table(f"Other processes on CPU {pcpu} during the one-connection runs (CPU {pcpu} busy minus interrupts and "
      f"the proxy's own share; the proxy waits behind them, which shows in p99)", "foreign_lat", f_pct, cands)

ca, rr = "radixgate-cache_aware", "radixgate-round_robin"
ratio_cols = [("cache_aware / round_robin", rr), ("cache_aware / nginx", "nginx-round_robin"),
              ("cache_aware / direct", "direct"),
              ("radixgate cache_aware / sglang-router cache_aware", "sglang-router-cache_aware"),
              ("radixgate round_robin / nginx", "nginx-round_robin") if rr in cands else None]
ratio_cols = [x for x in ratio_cols if x and x[1] in cands]
num_c = {"radixgate round_robin / nginx": rr}
if ca in cands and ratio_cols:
    L.append("**Peak req/s ratios (radixgate cache_aware unless named)**")
    L.append("")
    L.append("| body | " + " | ".join(t for t, _ in ratio_cols) + " |")
    L.append("|---" * (len(ratio_cols) + 1) + "|")
    for b in bodies:
        L.append(f"| {label[b]} | " + " | ".join(
            f_x(agg[(num_c.get(t, ca), b)]["peak_rps"], agg[(d, b)]["peak_rps"]) for t, d in ratio_cols) + " |")
    L.append("")
if proxies:
    L.append("**Resident memory after the runs (MiB, summed over the process tree; peak VmHWM in brackets)**")
    L.append("")
    L.append("| " + " | ".join(names[c] for c in proxies) + " |")
    L.append("|---" * len(proxies) + "|")
    def mib(c, k):
        m = mem.get(c)
        return None if not m else int(m[k]) / 1024
    L.append("| " + " | ".join(
        "—" if mib(c, "vmrss_kb") is None else f"{mib(c, 'vmrss_kb'):.1f} ({mib(c, 'vmhwm_kb'):.1f})"
        for c in proxies) + " |")
    L.append("")
errs = [(c, b, agg[(c, b)]["errors"]) for c in cands for b in bodies if agg[(c, b)]["errors"]]
notes = [n for n in env["M_NOTES"].split("\n") if n]
def limit(c, b):
    a = agg[(c, b)]
    if c != "direct" and (a["proxy_busy"] or 0) >= 0.9:
        return "proxy"
    if (a["load_side_busy"] or 0) >= 0.85:
        return "load"
    return "others"
for b in bodies:
    by_load = [names[c] for c in proxies if limit(c, b) == "load"]
    by_others = [names[c] for c in proxies if limit(c, b) == "others"]
    if by_load:
        notes.append(f"{label[b]}: wrk + upstream filled CPU {lcpu} before the proxy filled CPU {pcpu} for "
                     f"{', '.join(by_load)}: those peaks are the load side's limit, not the proxy's")
    if by_others:
        notes.append(f"{label[b]}: {', '.join(by_others)} got less than 90 % of CPU {pcpu} at peak with wrk + upstream "
                     f"below 85 % of CPU {lcpu}: interrupts and other processes took the rest (see the shares)")
    if "direct" in cands:
        a = agg[("direct", b)]
        notes.append(f"{label[b]}: direct used {f_pct(a['load_side_busy'])} of CPU {lcpu} (upstream "
                     f"{f_pct(a['upstream_busy'])}, wrk {f_pct(a['wrk_busy'])}): direct's peak is "
                     f"{'the one-core limit of wrk and the upstream together' if (a['load_side_busy'] or 0) >= 0.85 else 'bounded by interrupts and other processes on CPU ' + lcpu}")
# The load generator must not be what limits: wrk's CPU per request below each proxy's.
for b in bodies:
    over = [names[c] for c in proxies if agg[(c, b)]["wrk_cpu_s_per_1k"] is not None
            and agg[(c, b)]["cpu_s_per_1k"] is not None
            and agg[(c, b)]["wrk_cpu_s_per_1k"] >= agg[(c, b)]["cpu_s_per_1k"]]
    if over:
        notes.append(f"{label[b]}: wrk spent at least as much CPU per request as the proxy for "
                     f"{', '.join(over)} (see wrk's CPU-seconds): there the load generator weighs as much as the proxy")
# Large conversation mixes cycle through a pool joined before the run: what share repeated.
for b in bodies:
    if not pool.get(b):
        continue
    reqs = [num(r["requests"]) for r in rows if r["body"] == b and r["kind"] == "peak" and num(r["requests"])]
    if reqs:
        most = max(reqs)
        head = (f"{label[b]}: wrk joins {pool[b]:,} requests before each run and then cycles through them; "
                f"peak runs sent {min(reqs):,.0f} to {most:,.0f} requests, ")
        if most <= pool[b]:
            notes.append(head + "so no request repeated an earlier one of its run")
        else:
            notes.append(head + f"so up to {(1 - pool[b] / most) * 100:.0f} % of a run's requests repeated an "
                         "earlier one of its run (a full match, as with the fixed body)")
for c, b, e in errs:
    notes.append(f"{names[c]} at {label[b]}: {e} failed requests (non-2xx or socket errors) over its runs; see logs/")
if notes:
    L.append("Notes:")
    L.append("")
    L.extend(f"- {n}" for n in notes)
    L.append("")
open(f"{out}/report.md", "w").write("\n".join(L))
# The short version docs/benchmarks.md shows: one table per body kind, one row per measure, the
# sizes in each cell; then memory (the same processes served both kinds) and the ratios.
D = []
kind_title = {"fixed": "Fixed body: the same bytes on every request",
              "conversation": "Conversation mix: conversations growing turn by turn, every request new "
                              "(0.5× to 1.5× the size, mean 1×)"}
def cells(fmt):
    return " | ".join(fmt(c) for c in cands)
for kind in kinds:
    kb = [bkey(kind, z) for z in sizes]
    if len(kinds) > 1:
        D.append(f"**{kind_title[kind]}**")
        D.append("")
    D.append("| body " + " / ".join(sizes) + " | " + " | ".join(names[c] for c in cands) + " |")
    D.append("|---" * (len(cands) + 1) + "|")
    D.append("| peak req/s | " + cells(lambda c: " / ".join(f_rps(agg[(c, b)]["peak_rps"]) for b in kb)) + " |")
    D.append("| p50 at one connection (µs) | " + cells(lambda c: " / ".join(f_us(agg[(c, b)]["p50_us"]) for b in kb)) + " |")
    if "direct" in cands:
        def added(c):
            if c == "direct":
                return "—"
            return " / ".join("—" if agg[(c, b)]["p99_us"] is None or agg[("direct", b)]["p99_us"] is None
                              else f"{agg[(c, b)]['p99_us'] - agg[('direct', b)]['p99_us']:+,.0f}" for b in kb)
        D.append("| added p99 at one connection (µs) | " + cells(added) + " |")
    else:
        D.append("| p99 at one connection (µs) | " + cells(lambda c: " / ".join(f_us(agg[(c, b)]["p99_us"]) for b in kb)) + " |")
    D.append("| CPU-s per 1,000 requests | " + cells(lambda c: "—" if c == "direct" else " / ".join(
        "—" if agg[(c, b)]["cpu_s_per_1k"] is None else f"{agg[(c, b)]['cpu_s_per_1k']:.3f}" for b in kb)) + " |")
    D.append("| wrk's CPU-s per 1,000 requests | " + cells(lambda c: " / ".join(
        "—" if agg[(c, b)]["wrk_cpu_s_per_1k"] is None else f"{agg[(c, b)]['wrk_cpu_s_per_1k']:.3f}" for b in kb)) + " |")
    if ca in cands and ratio_cols:
        D.append("")
        D.append("Peak ratios: " + "; ".join(
            f"{t} " + " / ".join(f_x(agg[(num_c.get(t, ca), b)]["peak_rps"], agg[(d, b)]["peak_rps"]).rstrip("×")
                                 for b in kb) + "×" for t, d in ratio_cols) + ".")
    D.append("")
if len(kinds) > 1:
    D.append("Conversation / fixed peak req/s at " + " / ".join(sizes) + ": " + "; ".join(
        f"{names[c]} " + " / ".join(f_x(agg[(c, bkey('conversation', z))]["peak_rps"],
                                        agg[(c, bkey('fixed', z))]["peak_rps"]).rstrip("×") for z in sizes) + "×"
        for c in cands) + ".")
    D.append("")
def resident(c):
    m = mem.get(c)
    if not m:
        return "—"
    return f"{int(m['vmrss_kb']) / 1024:.1f} ({int(m['vmhwm_kb']) / 1024:.1f})"
if proxies:
    D.append("Resident MiB after all runs (peak): " + "; ".join(f"{names[c]} {resident(c)}" for c in proxies) + ".")
limits = [n for n in notes if ": wrk + upstream filled" in n or ": wrk spent at least" in n
          or "repeated an earlier one" in n]
if limits:
    D.append("")
    D.extend(f"- {n}" for n in limits)
open(f"{out}/docs.md", "w").write("\n".join(D) + "\n")
json.dump({"command": env["M_CMD"], "machine": env["M_MACHINE"], "versions": env["M_VERSIONS"],
           "rounds": int(env["M_ROUNDS"]), "duration_s": int(env["M_DUR"]),
           "connections": int(env["M_CONNS"]), "proxy_cpu": int(pcpu), "load_cpu": int(lcpu),
           "candidates": cands, "bodies": bodies, "body_labels": label, "sizes": sizes, "body_kinds": kinds,
           "sessions": int(env["M_SESSIONS"]), "turns": int(env["M_TURNS"]), "notes": notes,
           "medians": {c: {b: agg[(c, b)] for b in bodies} for c in cands},
           "memory_kb": mem, "runs": rows}, open(f"{out}/raw.json", "w"), indent=1)
PY
cat "$OUT/report.md"
log "report: $OUT/report.md (raw numbers: raw.json, raw.tsv; wrk outputs and logs: logs/)"
if [[ "$WRITE_DOCS" == 1 ]]; then
    python3 scripts/bench-docs.py write "${DOCS_SECTION:-vs-peers-$UPSTREAM_KIND}" "$OUT/docs.md" --command "$CMDLINE"
fi
