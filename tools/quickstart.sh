#!/usr/bin/env bash
# The README's first command: a CPU venv with a stock affected SGLang (default 0.5.20) plus this plugin, then the main
# job on the embedded default: `doctor` (what the plugin does here) and `simulate` (the hang reproduced on CPU ranks
# and fixed, stock vs patched). Usage: tools/quickstart.sh [RELEASE] [simulate options, e.g. --ranks 8 --json]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
V=${1:-0.5.20}
echo "Building a CPU venv with stock SGLang $V + sglang-dp-mtp-fix (first time: ~1.5 min) ..." >&2
E=$("$ROOT/tools/mkvenv.sh" "$V" | tail -1)
echo "venv: $E" >&2
cd "$ROOT"
source tools/sglang-noise.sh
SGLANG_PLUGINS=${SGLANG_PLUGINS:-dp_mtp_fix} "$E/bin/sglang-dp-mtp-fix" doctor 2> >(drop_sglang_noise >&2) || true
echo
"$E/bin/sglang-dp-mtp-fix" simulate "${@:2}" 2> >(drop_sglang_noise >&2)
