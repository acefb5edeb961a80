#!/usr/bin/env bash
# The text tree's one writer thread at the insert rate of 2, 8 and 32 serving cores (inserts/s
# applied, drops, channel depth, previous-turn staleness, writer CPU), and its ceiling on a
# pre-built queue with the CPU per insert by prompt size (benches/tree_writer.rs says how).
#
#   scripts/bench-tree-writer.sh [--runs N] [--secs S] [--cores 2,8,32] [--per-core R]
#                                [--ceiling N] [--writer-nice N|keep] [--before REV]
#                                [--write-docs] [--out FILE] [--skip-build]
#
# RUNS invocations of the bench (default 5), one run each; every number of the table is the
# median over them. With --before REV the bench is also built from git revision REV (in a
# temporary worktree, its own target directory) and the two builds run alternately, run after
# run; each cell then reads `before → after` (one value when both agree). Name REV by a branch
# or tag when writing the docs: the page refuses commit hashes. --write-docs puts the
# table in docs/benchmarks.md (section tree-writer). Builds with `cargo bench --no-run` first
# and runs nothing else meanwhile; --skip-build runs the newest executables already built.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in -h|--help) sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;; esac
RUNS=5; BEFORE=""; WRITE=0; SKIP_BUILD=0; OUT=""; PASS=(); SHOWN=(scripts/bench-tree-writer.sh "$@")
while [[ $# -gt 0 ]]; do
  case "$1" in
    --runs) RUNS=$2; shift 2 ;;
    --before) BEFORE=$2; shift 2 ;;
    --write-docs) WRITE=1; shift ;;
    --skip-build) SKIP_BUILD=1; shift ;;
    --out) OUT=$2; shift 2 ;;
    --secs|--cores|--per-core|--ceiling|--warmup|--only|--writer-nice|--max-tree-chars) PASS+=("$1" "$2"); shift 2 ;;
    *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
TMP=$(mktemp -d)
WT=""
cleanup() {
  if [[ -n "$WT" ]]; then git worktree remove --force "$WT" >/dev/null 2>&1 || true; fi
  rm -rf "$TMP"
}
trap cleanup EXIT INT TERM

# The bench executable cargo built (the last `executable` line of its JSON messages).
bench_exe() {
  cargo bench --no-run --bench tree_writer --message-format=json "$@" 2>/dev/null |
    python3 -c 'import json,sys
exe=[m["executable"] for m in map(json.loads, sys.stdin) if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]=="tree_writer"]
print(exe[-1])'
}
newest() { ls -t "$1"/release/deps/tree_writer-* 2>/dev/null | grep -v '\.d$' | head -1; }
if [[ $SKIP_BUILD == 1 ]]; then
  AFTER_EXE=$(newest "${CARGO_TARGET_DIR:-$PWD/target}")
else
  echo "building the bench" >&2
  cargo bench --no-run --bench tree_writer -q
  AFTER_EXE=$(bench_exe)
fi
BEFORE_EXE=""
if [[ -n "$BEFORE" ]]; then
  # Kept between invocations (a release build of the crate takes minutes): a worktree per
  # revision, and one target directory seeded from this build's (only the crate rebuilds).
  WT="${TMPDIR:-/tmp}/radixgate-tree-writer-before-$(git rev-parse --short "$BEFORE")"
  BT="${CARGO_TARGET_DIR:-$PWD/target}-before"
  [[ -d "$WT" ]] || git worktree add --detach -q "$WT" "$BEFORE"
  [[ -d "$BT/release" ]] || { mkdir -p "$BT"; cp -a "${CARGO_TARGET_DIR:-$PWD/target}/release" "$BT/"; }
  if [[ $SKIP_BUILD == 1 ]]; then
    BEFORE_EXE=$(newest "$BT")
  else
    echo "building the bench at $BEFORE" >&2
    (cd "$WT" && CARGO_TARGET_DIR="$BT" cargo bench --no-run --bench tree_writer -q)
    BEFORE_EXE=$(cd "$WT" && CARGO_TARGET_DIR="$BT" bench_exe)
  fi
  WT=""
fi
LOADS=()
for i in $(seq "$RUNS"); do
  LOADS+=("$(cut -d' ' -f1 /proc/loadavg)")
  if [[ -n "$BEFORE_EXE" ]]; then
    echo "run $i/$RUNS: before ($BEFORE)" >&2
    "$BEFORE_EXE" --runs 1 "${PASS[@]}" >"$TMP/before.$i"
  fi
  echo "run $i/$RUNS: after" >&2
  "$AFTER_EXE" --runs 1 "${PASS[@]}" >"$TMP/after.$i"
done
LOADS+=("$(cut -d' ' -f1 /proc/loadavg)")
python3 - "$TMP" "$RUNS" "$BEFORE" "${LOADS[*]}" >"$TMP/table.md" <<'PY'
import glob, re, statistics, sys
tmp, runs, before, loads = sys.argv[1], int(sys.argv[2]), sys.argv[3], [float(x) for x in sys.argv[4].split()]
NUM = re.compile(r"\d[\d,]*(?:\.\d+)?")

def median_tables(paths):
    """One table: each number of each cell the median of that number over the tables."""
    tables = [open(p, encoding="utf-8").read().splitlines() for p in paths]
    out = []
    for lines in zip(*tables):
        first = lines[0]
        if not first.startswith("|") or set(first) <= set("|-"):
            out.append(first)
            continue
        cells = [l.split("|") for l in lines]
        row = []
        for k, cell in enumerate(cells[0]):
            nums = [NUM.findall(c[k]) if k < len(c) else [] for c in cells]
            if not nums[0] or any(len(n) != len(nums[0]) for n in nums):
                row.append(cell)
                continue
            meds = []
            for j, tok in enumerate(nums[0]):
                vals = [float(n[j].replace(",", "")) for n in nums]
                m = statistics.median(vals)
                dec = len(tok.split(".")[1]) if "." in tok else 0
                s = f"{m:,.{dec}f}" if "," in tok or m >= 1000 and dec == 0 else f"{m:.{dec}f}"
                meds.append(s)
            it = iter(meds)
            row.append(NUM.sub(lambda _: next(it), cell))
        out.append("|".join(row))
    return out

after = median_tables(sorted(glob.glob(f"{tmp}/after.*")))
if before:
    bef = median_tables(sorted(glob.glob(f"{tmp}/before.*")))
    rows = []
    for b, a in zip(bef, after):
        if not a.startswith("|") or set(a) <= set("|-") or a.startswith("| cores") or a.startswith("| writer alone"):
            rows.append(a)
            continue
        bc, ac = b.split("|"), a.split("|")
        rows.append("|".join(x if x == y or k <= 1 else f"{x.strip()} → {y.strip()}".join("  ") for k, (x, y) in enumerate(zip(bc, ac))))
    after = rows
print("\n".join(after).rstrip())
note = f"Each number is the median of {runs} runs"
if before:
    note += "; `before → after`: the `--before` revision against this build, run alternately"
note += f"; load average (1 min) between runs {min(loads):.1f}–{max(loads):.1f} on {len(__import__('os').sched_getaffinity(0))} CPUs"
print(f"\n{note}.")
PY
cat "$TMP/table.md"
if [[ -n "$OUT" ]]; then cp "$TMP/table.md" "$OUT"; fi
if [[ $WRITE == 1 ]]; then
  scripts/bench-docs.py write tree-writer "$TMP/table.md" --command "${SHOWN[*]}"
fi
