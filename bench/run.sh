#!/usr/bin/env bash
# Run the benchmarks against one stock SGLang release (default 0.5.20) in its CPU venv.
# Usage: bench/run.sh [RELEASE] [--activation]   (--activation: only the activation figures)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
E=$("$ROOT/tools/mkvenv.sh" "${1:-0.5.20}" | tail -1)
source "$ROOT/tools/sglang-noise.sh"
cd "$ROOT" && "$E/bin/python" bench/bench.py "${@:2}" 2> >(drop_sglang_noise >&2)
