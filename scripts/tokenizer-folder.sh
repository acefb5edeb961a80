#!/usr/bin/env bash
# Find or write the offline Llama-3-style tokenizer folder (tokenizer.json + tokenizer_config.json)
# that radixgate --tokenizer-path and sim-worker --tokenizer-path share, so chat prompts are
# measured in the same tokens by the gateway and the simulated workers.
#
#   scripts/tokenizer-folder.sh DIR [--given PATH] [--make "CMD"]
#
# Prints the folder on stdout and exits 0, or prints why not on stderr and exits 3:
# - --given PATH: used as it is (a folder or a tokenizer.json);
# - else, only when target/release/sim-worker has --tokenizer-path (the tokenizer merge): runs
#   --make CMD (`{}` stands for DIR), then any tokenizer writer the build has —
#   `sim-worker --write-tokenizer|--export-tokenizer|--save-tokenizer|--dump-tokenizer DIR`, or
#   `target/release/*tokenizer* DIR` / `... --out DIR` — until DIR/tokenizer.json exists.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[[ $# -ge 1 ]] || { sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//' >&2; exit 2; }
DIR="$1"
shift
GIVEN=""
MAKE=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --given) GIVEN="$2"; shift 2 ;;
        --make) MAKE="$2"; shift 2 ;;
        *) echo "unknown option: $1" >&2; exit 2 ;;
    esac
done
if [[ -n "$GIVEN" ]]; then
    [[ -e "$GIVEN" ]] || { echo "no such tokenizer: $GIVEN" >&2; exit 3; }
    echo "$GIVEN"
    exit 0
fi
SIM="$ROOT/target/release/sim-worker"
[[ -x "$SIM" ]] || { echo "no target/release/sim-worker" >&2; exit 3; }
HELP="$("$SIM" --help 2>&1 || true)"
grep -q -- '--tokenizer-path' <<<"$HELP" \
    || { echo "sim-worker has no --tokenizer-path yet (tokenizer not merged): no tokenizer folder" >&2; exit 3; }
mkdir -p "$DIR"
cands=()
[[ -n "$MAKE" ]] && cands+=("${MAKE//\{\}/$DIR}")
while read -r f; do
    [[ -n "$f" ]] && cands+=("$SIM $f $DIR")
done < <(grep -oE -- '--(write|export|save|dump)-tokenizer[a-z-]*' <<<"$HELP" | sort -u || true)
for b in "$ROOT"/target/release/*tokenizer*; do
    [[ -x "$b" && -f "$b" ]] && cands+=("$b $DIR" "$b --out $DIR")
done
for c in "${cands[@]}"; do
    # shellcheck disable=SC2086
    if timeout 120 $c >>"$DIR/.make.log" 2>&1 && [[ -f "$DIR/tokenizer.json" ]]; then
        echo "wrote $DIR with: $c" >&2
        echo "$DIR"
        exit 0
    fi
done
echo "sim-worker has --tokenizer-path but no tokenizer writer was found (tried: ${cands[*]:-nothing}); pass --given or --make" >&2
exit 3
