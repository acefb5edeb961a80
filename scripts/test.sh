#!/usr/bin/env bash
# Runs every test: unit, property and end-to-end (real sockets on 127.0.0.1, simulated SGLang
# workers), first with every end-to-end gateway and sim worker on io_uring, then the end-to-end
# suites again on epoll, so both io drivers stay green.
#
# RADIXGATE_TEST_IO_DRIVER (read by tests/common) makes every gateway the tests start use
# `--io-driver uring` / `--io-driver legacy` and assert, through GET /get_server_info, that it
# runs on that driver; an explicit uring fails to start where io_uring is unavailable, so the
# first pass cannot silently fall back to epoll. One test also checks a child gateway process's
# file descriptors (io_uring rings or none).
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== pass 1: cargo test --workspace, end-to-end gateways on io_uring (RADIXGATE_TEST_IO_DRIVER=uring) =="
env -u MONOIO_FORCE_LEGACY_DRIVER RADIXGATE_TEST_IO_DRIVER=uring cargo test --workspace
echo "== pass 2: end-to-end suites on epoll (RADIXGATE_TEST_IO_DRIVER=epoll, MONOIO_FORCE_LEGACY_DRIVER=1) =="
RADIXGATE_TEST_IO_DRIVER=epoll MONOIO_FORCE_LEGACY_DRIVER=1 \
    cargo test --test data_plane --test routing --test reliability --test hardening_conn --test hardening_upstream
echo "== io drivers covered: pass 1 io_uring (every e2e gateway asserted io_uring), pass 2 epoll (every e2e gateway asserted epoll) =="
