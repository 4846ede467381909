#!/usr/bin/env bash
# The GPU tier's driver against CPU launches, here, before device time: DRIVE_CPU=1 with the launch tier's stand-ins
# (tests/launch/stubs, cpu_gaps), its tiny Qwen3-MoE and a CPU venv of one release. Any driver knob passes through.
#   NODES=4 SOAK_BATCHES=60 bash bench/gpu/server/drive-cpu.sh 0.5.17 soak
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd); cd "$ROOT"
V=${1:?usage: drive-cpu.sh RELEASE STAGE...}; shift
PY=$(tools/mkvenv.sh "$V" | tail -1)/bin/python
TMP=$(mktemp -d)
stop_all() {  # every node's process group, however the driver ended (an interrupt included), then the temp folder
  for g in $(cat "$DRIVE_LOGS/pgids" 2>/dev/null); do kill -KILL -- "-$g" 2>/dev/null || true; done
  rm -rf "$TMP"
}
trap stop_all EXIT
INFO=$TMP/launch_cpu_gaps-0.0.0.dist-info; mkdir -p "$INFO"
printf 'Metadata-Version: 2.1\nName: launch-cpu-gaps\nVersion: 0.0.0\n' > "$INFO/METADATA"
printf '[sglang.srt.plugins]\nlaunch_cpu_gaps = launch_cpu_gaps:register\n' > "$INFO/entry_points.txt"
export DRIVE_CPU=1 DRIVE_CPU_PATH=$ROOT/tests/launch/stubs:$ROOT/tests/launch/cpu_gaps:$ROOT/bench/gpu/server/stubs_cpu:$TMP DRIVE_MODEL=$ROOT/tests/launch/models/tiny-qwen3-moe
export OUT=${OUT:-$TMP/out} DRIVE_LOGS=${DRIVE_LOGS:-$TMP/logs} SGLANG_RELEASE=$V G=${G:-$TMP/no-carry}
mkdir -p "$DRIVE_LOGS" "$OUT"
rc=0; timeout "${DRIVE_TIMEOUT_S:-900}" "$PY" bench/gpu/server/drive.py "$@" || rc=$?
if [[ -n ${KEEP:-} ]]; then mkdir -p "$KEEP" && cp -r "$OUT" "$DRIVE_LOGS" "$KEEP"/; fi
exit $rc
