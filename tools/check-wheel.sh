#!/usr/bin/env bash
# The wheel a user installs: build the sdist and, from it (no git there), the wheel; check both with `twine check` and
# tools/check_dist.py (metadata, files, the version the build named); then install the wheel, with the README's own
# command, into a clean venv beside stock SGLang and run `doctor --json` there from the installed console script,
# outside the checkout.
# Beside stock SGLang: the clean venv sees one release venv's packages through a .pth of plain paths (read, never
# changed; that venv's editable plugin stays out, its .pth files are not run), so nothing is installed twice.
# Usage: tools/check-wheel.sh [RELEASE]   (default 0.5.20)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
V=${1:-0.5.20}
TOOLS=$(tools/mkvenv.sh tools)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
DIST="$WORK/dist" CLEAN="$WORK/venv" RUN="$WORK/run"
mkdir -p "$RUN"
E=$(tools/mkvenv.sh "$V" | tail -1)
# README: python -m build
"$TOOLS/bin/python" -m build -q --outdir "$DIST" . > "$WORK/build.log" 2>&1 || { cat "$WORK/build.log"; exit 1; }
"$TOOLS/bin/twine" check --strict "$DIST"/*
"$TOOLS/bin/python" tools/check_dist.py "$DIST"
python3 -m venv "$CLEAN"
stock=$("$E/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
clean=$("$CLEAN/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
printf '%s\n' "$stock" "$ROOT/tests/cpu_stubs" > "$clean/zz_stock_sglang.pth"
# README: pip install dist/sglang_dp_mtp_fix-*.whl
"$CLEAN/bin/pip" install -q "$DIST"/sglang_dp_mtp_fix-*.whl 2>&1 | grep -vE "is ignored" || true
cd "$RUN"  # nothing of the checkout on the path: the installed wheel answers
# README: SGLANG_PLUGINS=dp_mtp_fix sglang-dp-mtp-fix doctor
rc=0; SGLANG_PLUGINS=dp_mtp_fix "$CLEAN/bin/sglang-dp-mtp-fix" doctor > doctor.txt 2> doctor.err || rc=$?
(( rc == 0 )) || { echo "check-wheel: doctor exited $rc"; cat doctor.txt; tail -20 doctor.err; exit 1; }
SGLANG_PLUGINS=dp_mtp_fix "$CLEAN/bin/sglang-dp-mtp-fix" doctor --json > doctor.json 2> doctor.err
# README: sglang-dp-mtp-fix --version
"$CLEAN/bin/sglang-dp-mtp-fix" --version > version.txt
"$CLEAN/bin/python" - "$CLEAN" "$ROOT" <<'PY'
import json, sys
from importlib.metadata import version
import sglang, sglang_dp_mtp_fix
venv, root = sys.argv[1:]
sys.path.insert(0, f"{root}/buildsys")
import version_backend
where = sglang_dp_mtp_fix.__file__
assert where.startswith(venv) and "site-packages" in where, f"imported from {where}, not from the installed wheel"
assert not sglang.__file__.startswith(venv), f"SGLang from {sglang.__file__}: not the stock release's"
built = version("sglang-dp-mtp-fix")
from_git = version_backend.from_git(__import__("pathlib").Path(root))
assert from_git in (None, built), f"the wheel says {built}, the checkout is {from_git}"
data = json.load(open("doctor.json"))
assert data["plugin_version"] == built == open("version.txt").read().strip(), (data["plugin_version"], built)
assert f"sglang-dp-mtp-fix {built} doctor" in open("doctor.txt").read(), "doctor's text names another build"
assert data["patches"] and all(p["status"] and p["reason"] for p in data["patches"]), data
assert data["entry_point_selected"], data
print(f"check-wheel: sglang-dp-mtp-fix {built}, doctor --json from the wheel installed in a clean venv ({where}) "
      f"beside stock SGLang {data['sglang_version']}: " + ", ".join(f"{p['id']}={p['status']}" for p in data["patches"]))
PY
