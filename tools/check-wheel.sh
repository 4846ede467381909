#!/usr/bin/env bash
# The wheel a user installs: build the sdist and, from it, the wheel (tools/check_dist.py checks their metadata and
# files), install that wheel with --no-deps into one release venv in place of the editable checkout, and run
# `doctor --json` from the installed console script, outside the checkout; the editable install is put back after.
# Usage: tools/check-wheel.sh [RELEASE]   (default 0.5.20)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
V=${1:-0.5.20}
TOOLS=$(tools/mkvenv.sh tools)
DIST=$(mktemp -d)
RUN=$(mktemp -d)
E=$(tools/mkvenv.sh "$V" | tail -1)
restore() { "$E/bin/pip" install -q --no-deps --no-build-isolation -e "$ROOT" 2>&1 | grep -vE "is ignored" || true; rm -rf "$DIST" "$RUN"; }
trap restore EXIT
"$TOOLS/bin/python" -m build -q --outdir "$DIST" . > "$DIST/build.log" 2>&1 || { cat "$DIST/build.log"; exit 1; }
"$TOOLS/bin/python" tools/check_dist.py "$DIST"
"$E/bin/pip" uninstall -q -y sglang-dp-mtp-fix
"$E/bin/pip" install -q --no-deps "$DIST"/*.whl 2>&1 | grep -vE "is ignored" || true
cd "$RUN"  # nothing of the checkout on the path: the installed wheel answers
rc=0; "$E/bin/sglang-dp-mtp-fix" doctor --json > doctor.json 2> doctor.err || rc=$?
(( rc == 0 )) || { echo "check-wheel: doctor exited $rc"; cat doctor.json; tail -20 doctor.err; exit 1; }
"$E/bin/python" - "$E" <<'PY'
import json, sys
import sglang_dp_mtp_fix
venv = sys.argv[1]
where = sglang_dp_mtp_fix.__file__
assert where.startswith(venv) and "site-packages" in where, f"imported from {where}, not from the installed wheel"
data = json.load(open("doctor.json"))
assert data["patches"] and all(p["status"] and p["reason"] for p in data["patches"]), data
assert data["entry_point_selected"], data
print(f"check-wheel: doctor --json from the installed wheel ({where}) on SGLang {data['sglang_version']}: "
      + ", ".join(f"{p['id']}={p['status']}" for p in data["patches"]))
PY
