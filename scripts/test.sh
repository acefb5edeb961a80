#!/usr/bin/env bash
# Runs every test: unit, property and end-to-end (real sockets on 127.0.0.1, simulated SGLang
# workers), then the end-to-end suites again on the epoll driver, so both io drivers stay green.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace
echo "== end-to-end tests again on the epoll (legacy) driver =="
MONOIO_FORCE_LEGACY_DRIVER=1 cargo test --test data_plane --test routing --test reliability
