#!/usr/bin/env bash
# Find or write the offline Llama-3-style tokenizer folder (tokenizer.json + tokenizer_config.json)
# that radixgate --tokenizer-path and sim-worker --tokenizer-path share, so chat prompts are
# measured in the same tokens by the gateway and the simulated workers.
#
#   scripts/tokenizer-folder.sh DIR [--given PATH] [--make "CMD"]
#
# Prints the folder on stdout and exits 0, or prints why not on stderr and exits 3:
# - --given PATH: used as it is (a folder or a tokenizer.json);
# - --make CMD: runs it (`{}` stands for DIR) and expects DIR/tokenizer.json;
# - else DIR as it is when it holds a tokenizer.json, or `sim-worker --write-tokenizer DIR` (the
#   simulator's cl100k BPE with Llama-3's special tokens and chat template, offline).
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
[[ -x "$SIM" ]] || { echo "no target/release/sim-worker (cargo build --release --workspace)" >&2; exit 3; }
mkdir -p "$DIR"
if [[ -n "$MAKE" ]]; then
    # shellcheck disable=SC2086
    timeout 120 ${MAKE//\{\}/$DIR} >>"$DIR/.make.log" 2>&1 || true
elif [[ ! -f "$DIR/tokenizer.json" ]]; then
    # The simulator's own cl100k BPE with Llama-3 specials and chat template, as a HF folder.
    timeout 120 "$SIM" --write-tokenizer "$DIR" >>"$DIR/.make.log" 2>&1 || true
fi
[[ -f "$DIR/tokenizer.json" ]] || { echo "no tokenizer written to $DIR (see $DIR/.make.log)" >&2; exit 3; }
echo "$DIR"
