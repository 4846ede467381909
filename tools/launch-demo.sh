#!/usr/bin/env bash
# See the plugin in a real SGLang server on CPU: DP attention (--tp 2 --dp 2), PD decode (fake transfer backend), NEXTN
# MTP speculative decoding, dummy weights (tests/launch/models). Starts the server with the plugin, sends a few greedy
# requests, prints each process's sglang-dp-mtp-fix lines and the completions, and stops it (whole process group).
# Usage: tools/launch-demo.sh [RELEASE]   (default 0.5.20; the venv comes from tools/mkvenv.sh, ~90 s the first time)
# CPU stand-ins (tests/launch/stubs/sgl_kernel, tests/launch/cpu_gaps): see tests/launch/launchlib.py for why.
# Extra environment passes through, e.g. SGLANG_DP_MTP_FIX=off or SGLANG_DP_MTP_FIX_STATS=4.
set -euo pipefail
RELEASE=${1:-0.5.20}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
E=$("$ROOT/tools/mkvenv.sh" "$RELEASE" | tail -1)
WORK=$(mktemp -d); PORT=$((30000 + RANDOM % 20000)); LOG=$WORK/server.log
mkdir -p "$WORK/ep/launch_cpu_gaps-0.0.0.dist-info"
printf 'Metadata-Version: 2.1\nName: launch-cpu-gaps\nVersion: 0.0.0\n' > "$WORK/ep/launch_cpu_gaps-0.0.0.dist-info/METADATA"
printf '[sglang.srt.plugins]\nlaunch_cpu_gaps = launch_cpu_gaps:register\n' \
  > "$WORK/ep/launch_cpu_gaps-0.0.0.dist-info/entry_points.txt"
export PYTHONPATH="$ROOT/tests/launch/stubs:$ROOT/tests/launch/cpu_gaps:$WORK/ep" HF_HUB_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 SGLANG_USE_CPU_ENGINE=1 SGLANG_CPU_OMP_THREADS_BIND='0|1' \
  LAUNCH_CPU_ATTN_OPS=1 SGLANG_PLUGINS=${SGLANG_PLUGINS:-dp_mtp_fix,launch_cpu_gaps} \
  SGLANG_DP_MTP_FIX_STATS=${SGLANG_DP_MTP_FIX_STATS:-4}
echo "SGLang $RELEASE on CPU, 127.0.0.1:$PORT, log $LOG"
setsid "$E/bin/python" -m sglang.launch_server --model-path "$ROOT/tests/launch/models/tiny-qwen3-moe" \
  --load-format dummy --device cpu --host 127.0.0.1 --port "$PORT" --tp 2 --dp 2 --enable-dp-attention \
  --attention-backend torch_native --disable-cuda-graph --max-total-tokens 2048 --disaggregation-mode decode \
  --disaggregation-transfer-backend fake --disaggregation-decode-retraction-backup cpu_tensor \
  --no-enable-tp-lm-head-all-to-all --speculative-algorithm NEXTN --speculative-num-steps 2 \
  --speculative-eagle-topk 1 --speculative-num-draft-tokens 3 > "$LOG" 2>&1 &
PID=$!
stop() { kill -TERM "$PID" 2>/dev/null || true; for _ in $(seq 30); do kill -0 "$PID" 2>/dev/null || break; sleep 0.5; done
         kill -KILL -- "-$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true; }
trap stop EXIT
for _ in $(seq 600); do
  grep -q "fired up and ready" "$LOG" && break
  kill -0 "$PID" 2>/dev/null || { tail -30 "$LOG"; echo "server exited"; exit 1; }
  sleep 0.5
done
grep -q "fired up and ready" "$LOG" || { tail -30 "$LOG"; echo "not ready after 300 s"; exit 1; }
echo "--- completions (greedy, 8 tokens; bootstrap_host 2.2.2.2 is SGLang's fake-transfer marker, never contacted)"
for k in 1 2 3 4; do
  curl -s -m 120 "http://127.0.0.1:$PORT/generate" -H 'Content-Type: application/json' -d \
    "{\"bootstrap_host\": \"2.2.2.2\", \"bootstrap_room\": $k, \"input_ids\": [1, 5, 6, $((6 + k))],
      \"sampling_params\": {\"max_new_tokens\": 8, \"temperature\": 0, \"ignore_eos\": true}}" > "$WORK/gen$k.json" &
done
wait $(jobs -p | grep -v "^$PID$")
for k in 1 2 3 4; do
  "$E/bin/python" -c "import json,sys; d=json.load(open(sys.argv[1])); m=d['meta_info']
print(f\"request {sys.argv[2]}: DP rank {m.get('dp_rank')}, output_ids {d['output_ids']}\")" "$WORK/gen$k.json" "$k"
done
sleep 1
echo "--- sglang-dp-mtp-fix lines (launcher unprefixed, schedulers with SGLang's DP/TP prefix)"
grep -E "sglang-dp-mtp-fix|PeerStateMismatch" "$LOG" | grep -v "stats (" || true
echo "--- first counter line per rank"
for r in 0 1; do grep -m1 "DP$r TP$r\] sglang-dp-mtp-fix stats" "$LOG" || true; done
