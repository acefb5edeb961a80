# Process bookkeeping and measuring for the bench scripts (sourced, not run): find a process
# tree, stop only what a script started (by PID), read a tree's CPU time and memory, find a
# free port on 127.0.0.1, wait for a server to answer.

# PID and its descendants (nginx's workers, anything a launcher forks), the PID itself first.
tree_pids() {
    ps -e -o pid=,ppid= | awk -v r="$1" '
        { parent[$1] = $2 }
        END {
            print r
            for (x in parent) {
                if (x == r) continue
                y = x
                for (d = 0; d < 64 && (y in parent) && y != r && y > 1; d++) y = parent[y]
                if (y == r) print x
            }
        }'
}

# Stop PID (TERM, then KILL after 5 s) and the descendants it started.
stop_pid() {
    local pid="$1" kids i
    [[ -n "$pid" ]] || return 0
    kill -0 "$pid" 2>/dev/null || return 0
    kids="$(tree_pids "$pid" | tail -n +2 | tr '\n' ' ')"
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 1 50); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    # Descendants that outlived their parent (started by us through it).
    for i in $kids; do kill -KILL "$i" 2>/dev/null || true; done
}

# utime+stime (clock ticks) summed over the process tree of PID (0 without a PID).
ticks() {
    local p t=0 v
    [[ -z "$1" ]] && { echo 0; return; }
    for p in $(tree_pids "$1"); do
        v="$(sed 's/^.*) //' "/proc/$p/stat" 2>/dev/null | awk '{print $12 + $13}' || true)"
        t=$((t + ${v:-0}))
    done
    echo "$t"
}

# kb_sum PID FIELD: FIELD of /proc/PID/status (VmRSS, VmHWM) summed over the tree, kB.
kb_sum() {
    local p t=0 v
    [[ -z "$1" ]] && { echo 0; return; }
    for p in $(tree_pids "$1"); do
        v="$(awk -v f="$2:" '$1 == f {print $2}' "/proc/$p/status" 2>/dev/null || true)"
        t=$((t + ${v:-0}))
    done
    echo "$t"
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# free_port_in LO HI: a free port in [LO, HI) on 127.0.0.1, tried at random. For listeners of a
# process that dials thousands of connections: one of those can take an ephemeral port picked
# for a listener before the listener binds it, so such a port is chosen below that range.
free_port_in() {
    python3 - "$1" "$2" <<'PY'
import random, socket, sys
lo, hi = int(sys.argv[1]), int(sys.argv[2])
for _ in range(200):
    p = random.randrange(lo, hi)
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p))
    except OSError:
        continue
    finally:
        s.close()
    print(p)
    break
PY
}

# Wait until BASE/readiness or BASE/health answers 200, at most SECS seconds or until PID dies.
wait_ready() {
    local base="$1" secs="$2" pid="${3:-}" i path
    for i in $(seq 1 $((secs * 5))); do
        for path in readiness health; do
            [[ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$base/$path" || true)" == 200 ]] && return 0
        done
        if [[ -n "$pid" ]] && ! kill -0 "$pid" 2>/dev/null; then return 1; fi
        sleep 0.2
    done
    return 1
}
