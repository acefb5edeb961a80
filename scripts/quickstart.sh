#!/usr/bin/env bash
# Quickstart: build radixgate, start 4 simulated SGLang workers and the gateway, replay a
# ~60-second chat workload (the reference chat generator, think times compressed 20x, simulated
# GPUs 20x faster) under round_robin and then cache_aware, and print the hit-rate / TTFT table.
#
# Every process it starts is stopped by PID when it ends, fails or is interrupted (Ctrl-C).
# Results land in results/<timestamp>-quickstart/. Extra options are passed to
# scripts/compare-policies.sh (e.g. --duration 30, --workers 8, --tokenizer bpe, and
# --engine vllm for simulated vLLM workers instead of SGLang ones).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# zmq-sys compiles the bundled libzmq (the KV-event intake): the build needs a C++ compiler.
command -v c++ >/dev/null 2>&1 || { apt-get update -q && apt-get install -y -q g++; }
exec scripts/compare-policies.sh \
    --workload chat --workers 4 --duration 60 \
    --policies round_robin,cache_aware --no-chart \
    --out "results/$(date +%Y%m%d-%H%M%S)-quickstart" "$@"
