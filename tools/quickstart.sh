#!/usr/bin/env bash
# The README's first command: a CPU venv with a stock affected SGLang (default 0.5.20) plus this plugin, then the
# main job (doctor) on it. Usage: tools/quickstart.sh [RELEASE]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
V=${1:-0.5.20}
echo "Building a CPU venv with stock SGLang $V + sglang-dp-mtp-fix (first time: ~1.5 min) ..." >&2
E=$("$ROOT/tools/mkvenv.sh" "$V" | tail -1)
echo "venv: $E" >&2
cd "$ROOT"
SGLANG_PLUGINS=${SGLANG_PLUGINS:-dp_mtp_fix} "$E/bin/sglang-dp-mtp-fix" doctor "${@:2}" 2> >(grep -vE "warn|CUDA arch" >&2)
