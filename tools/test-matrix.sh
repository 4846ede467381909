#!/usr/bin/env bash
# The whole test matrix: every supported SGLang release, real and unmodified, on CPU (one lean venv each).
# Usage: tools/test-matrix.sh [RELEASE ...]     (default: all; SGLANG_RELEASES="..." works too)
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
DEFAULT="0.5.15.post1 0.5.16 0.5.17 0.5.18 0.5.19 0.5.20 0.5.23 0.5.15"
RELEASES=${*:-${SGLANG_RELEASES:-$DEFAULT}}
OUT=${SGLANG_DP_MTP_FIX_TEST_OUT:-$ROOT/build/test-results}
mkdir -p "$OUT"; rm -f "$OUT"/*.xml
failed=()
for V in $RELEASES; do
  echo "=== SGLang $V: building the CPU venv"
  t0=$(date +%s)
  if ! E=$(tools/mkvenv.sh "$V" | tail -1); then echo "!!! venv for $V failed"; failed+=("$V(venv)"); continue; fi
  echo "=== SGLang $V: venv ready in $(( $(date +%s) - t0 ))s; running the tests"
  if ! "$E/bin/python" -m pytest tests -q -p no:cacheprovider -W ignore::UserWarning -W ignore::DeprecationWarning \
        --junitxml="$OUT/sglang-$V.xml" -o junit_suite_name="sglang-$V"; then
    failed+=("$V")
  fi
  echo "=== SGLang $V: done in $(( $(date +%s) - t0 ))s"
done
python3 - "$OUT" <<'PY'
import glob, sys, xml.etree.ElementTree as ET
tot = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
print("\nrelease        passed failed skipped")
for path in sorted(glob.glob(f"{sys.argv[1]}/sglang-*.xml")):
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root[0]
    n = {k: int(suite.get(k, 0)) for k in tot}
    for k in tot: tot[k] += n[k]
    rel = path.rsplit("sglang-", 1)[1][:-4]
    print(f"{rel:<14} {n['tests']-n['failures']-n['errors']-n['skipped']:>6} {n['failures']+n['errors']:>6} {n['skipped']:>7}")
passed = tot["tests"] - tot["failures"] - tot["errors"] - tot["skipped"]
print(f"{passed} passed, {tot['failures'] + tot['errors']} failed, {tot['skipped']} skipped")
PY
if (( ${#failed[@]} )); then echo "FAILED releases: ${failed[*]}"; exit 1; fi
