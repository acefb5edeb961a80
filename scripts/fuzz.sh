#!/usr/bin/env bash
# Fuzz the pure HTTP/1.1 framing (src/http), the routing-text extraction (src/route/extract.rs)
# and the KV-event decoder (src/kv/wire.rs) with cargo-fuzz / libFuzzer.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]     default: 30 s each for every target in fuzz/fuzz_targets
#
# Toolchain: libFuzzer's sanitizer flags (-Zsanitizer=address) need nightly rustc. A local
# nightly toolchain is used when rustup has one; otherwise the stable compiler is unlocked with
# RUSTC_BOOTSTRAP=1 (no download needed). If the AddressSanitizer build still fails, the run
# falls back to `--sanitizer none` (coverage-guided, safe Rust needs no ASan to catch panics).
#
# New corpus entries go to fuzz/corpus/<target> (git-ignored); fuzz/seeds/<target> is the
# committed starting corpus. A crash leaves its input in fuzz/artifacts/<target>/ and makes
# this script exit non-zero; turn it into a unit test next to the code it broke.
set -euo pipefail

SECONDS_PER_TARGET="${1:-30}"
shift || true
TARGETS=("$@")
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# Every target by default (head, chunked, extract, kv_wire, and any added later).
if [ ${#TARGETS[@]} -eq 0 ]; then
    for f in fuzz/fuzz_targets/*.rs; do
        TARGETS+=("$(basename "$f" .rs)")
    done
fi

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz.sh: installing cargo-fuzz" >&2
    cargo install cargo-fuzz --locked
fi

# Choose how to get a compiler that accepts -Z flags (FUZZ_STABLE=1 forces the stable path).
CARGO=(cargo)
if [ "${FUZZ_STABLE:-0}" != 1 ] && command -v rustup >/dev/null 2>&1 \
    && rustup run nightly rustc --version >/dev/null 2>&1; then
    CARGO=(cargo +nightly)
    echo "fuzz.sh: using $(rustup run nightly rustc --version)" >&2
else
    export RUSTC_BOOTSTRAP=1
    echo "fuzz.sh: no nightly toolchain; using $(rustc --version) with RUSTC_BOOTSTRAP=1" >&2
fi

# FUZZ_TARGET_DIR: build elsewhere than fuzz/target (e.g. to keep two toolchains' builds).
EXTRA=()
[ -n "${FUZZ_TARGET_DIR:-}" ] && EXTRA=(--target-dir "$FUZZ_TARGET_DIR")

SANITIZER=(--sanitizer address)
if ! "${CARGO[@]}" fuzz build "${EXTRA[@]}" "${SANITIZER[@]}" >/tmp/radixgate-fuzz-build.log 2>&1; then
    echo "fuzz.sh: ASan build failed (see /tmp/radixgate-fuzz-build.log); using --sanitizer none" >&2
    SANITIZER=(--sanitizer none)
    "${CARGO[@]}" fuzz build "${EXTRA[@]}" "${SANITIZER[@]}"
fi

failed=()
for target in "${TARGETS[@]}"; do
    mkdir -p "fuzz/corpus/$target"
    echo "fuzz.sh: $target for ${SECONDS_PER_TARGET}s" >&2
    # -max_len: a head may be up to 64 KiB (bodies for `extract` likewise); -rss_limit_mb keeps
    # a leak from eating the box.
    if ! "${CARGO[@]}" fuzz run "${EXTRA[@]}" "${SANITIZER[@]}" "$target" \
        "fuzz/corpus/$target" "fuzz/seeds/$target" -- \
        -max_total_time="$SECONDS_PER_TARGET" -max_len=70000 -rss_limit_mb=2048 \
        -print_final_stats=1; then
        failed+=("$target")
    fi
done

if [ ${#failed[@]} -gt 0 ]; then
    echo "fuzz.sh: FAILED targets: ${failed[*]} (inputs in fuzz/artifacts/)" >&2
    exit 1
fi
echo "fuzz.sh: all targets ran ${SECONDS_PER_TARGET}s without a crash" >&2
