#!/usr/bin/env bash
# See the plugin in a real SGLang server on CPU: DP attention (--tp 2 --dp 2), PD decode (fake transfer backend), NEXTN
# MTP speculative decoding, dummy weights (tests/launch/models). Starts the server with the plugin, sends a few greedy
# requests, prints each process's sglang-dp-mtp-fix lines and the completions, and stops it (whole process group).
# Usage: tools/launch-demo.sh [RELEASE]   (default 0.5.20; the venv comes from tools/mkvenv.sh, ~90 s the first time)
# The server's shape and CPU stand-ins are the launch tier's (tools/launchlib.py says why each is needed).
# Extra environment passes through, e.g. SGLANG_DP_MTP_FIX=off or SGLANG_DP_MTP_FIX_STATS=4.
set -euo pipefail
RELEASE=${1:-0.5.20}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
E=$("$ROOT/tools/mkvenv.sh" "$RELEASE" | tail -1)
exec "$E/bin/python" "$ROOT/tools/launch_demo.py"
