#!/usr/bin/env bash
# The whole test matrix: every supported SGLang release, real and unmodified, on CPU (one lean venv each).
# Usage: tools/test-matrix.sh [RELEASE ...]     (default: all, tests/releases.py MATRIX; SGLANG_RELEASES="..." works too)
# The next release's venv builds in the background while the current release's tests run (one build at a time,
# pip's cache shared across releases). Each release prints its venv build time, how long the tests waited for it,
# its test time and its slowest tests; the closing lines give the whole run's time. After its tests, each release's
# `doctor --json` is left in $OUT for tools/compat_table.py.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
DEFAULT=$(python3 -c 'import sys; sys.path.insert(0, "tests"); from releases import MATRIX; print(*MATRIX)') || {
  echo "!!! could not read the release matrix from tests/releases.py"; exit 1; }
read -ra RELEASES <<< "${*:-${SGLANG_RELEASES:-$DEFAULT}}"
OUT=${SGLANG_DP_MTP_FIX_TEST_OUT:-$ROOT/build/test-results}
VLOG="$OUT/venv-logs"
mkdir -p "$OUT" "$VLOG"; rm -f "$OUT"/*.xml "$OUT"/doctor-*.json "$VLOG"/*
run_t0=$(date +%s)
failed=()
timings=()

# Free space first: each release's venv takes ~2.6 GB. A full disk would otherwise show up as an ensurepip error in
# the middle of the run, with the releases before it green.
VENV_ROOT=${SGLANG_DP_MTP_FIX_VENVS:-$HOME/.cache/sglang-dp-mtp-fix/venvs}
mkdir -p "$VENV_ROOT"
RECIPE_ID=$(tools/mkvenv.sh --recipe-id)
to_build=0
for v in "${RELEASES[@]}"; do [[ -f "$VENV_ROOT/sglang-$v-$RECIPE_ID/.complete" ]] || to_build=$((to_build + 1)); done
need_mb=$(( to_build * 2700 + 2000 ))
free_mb=$(df -Pm "$VENV_ROOT" | awk 'NR == 2 {print $4}')
echo "=== disk: ${free_mb} MB free at $VENV_ROOT; ${to_build} venv(s) to build need about ${need_mb} MB"
if (( free_mb < need_mb )); then
  echo "!!! not enough free disk for the test matrix: ${free_mb} MB free, about ${need_mb} MB needed (see du -sh $VENV_ROOT/*)"
  exit 1
fi

build() {  # build one release's venv; leaves its path (on success) and its build time next to its log
  local v=$1 t0
  t0=$(date +%s)
  if tools/mkvenv.sh "$v" > "$VLOG/$v.log" 2>&1; then tail -1 "$VLOG/$v.log" > "$VLOG/$v.path"; fi
  echo $(( $(date +%s) - t0 )) > "$VLOG/$v.secs"
}

doctor_json() {  # doctor --json of the venv $1 into $2, run as from an operator's clean shell (no SGLANG_* variable)
  local e=$1 out=$2 name rc
  local -a clean=()
  for name in $(compgen -e); do [[ $name == SGLANG_* ]] && clean+=(-u "$name"); done
  env ${clean[@]+"${clean[@]}"} "$e/bin/sglang-dp-mtp-fix" doctor --json > "$out.tmp" 2> "$out.err"
  rc=$?
  if [[ $rc -le 1 && $(tr -d ' \t\n' < "$out.tmp" | head -c 1) == "{" ]]; then
    mv "$out.tmp" "$out"
  else
    echo "doctor --json failed (rc=$rc); $out not written:"; tail -c 2000 "$out.err"; rm -f "$out.tmp"
  fi
  rm -f "$out.err"
}

build "${RELEASES[0]}" &
builder=$!
for i in "${!RELEASES[@]}"; do
  V=${RELEASES[$i]}
  w0=$(date +%s)
  wait "$builder"
  waited=$(( $(date +%s) - w0 ))
  NEXT=${RELEASES[$((i + 1))]:-}
  if [[ -n $NEXT ]]; then build "$NEXT" & builder=$!; fi
  venv_s=$(cat "$VLOG/$V.secs" 2>/dev/null || echo "?")
  if [[ ! -s "$VLOG/$V.path" ]]; then
    echo "!!! SGLang $V: venv build failed after ${venv_s}s; its log ends:"; tail -25 "$VLOG/$V.log"
    failed+=("$V(venv)"); timings+=("$V venv=FAILED"); continue
  fi
  E=$(cat "$VLOG/$V.path")
  echo "=== SGLang $V: venv built in ${venv_s}s (the tests waited ${waited}s for it); running the tests"
  t0=$(date +%s)
  if ! "$E/bin/python" -m pytest tests -q -p no:cacheprovider -W ignore::UserWarning -W ignore::DeprecationWarning \
        --durations=8 --junitxml="$OUT/sglang-$V.xml" -o junit_suite_name="sglang-$V"; then
    failed+=("$V")
  fi
  doctor_json "$E" "$OUT/doctor-$V.json"
  test_s=$(( $(date +%s) - t0 ))
  echo "=== SGLang $V: tests done in ${test_s}s"
  timings+=("$V venv=${venv_s}s waited=${waited}s tests=${test_s}s")
done
wait
echo "timings (each venv build overlaps the previous release's tests):"
printf '  %s\n' "${timings[@]}"
python3 - "$OUT" "$(( $(date +%s) - run_t0 ))" <<'PY'
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
bad = tot["failures"] + tot["errors"]
parts = ([f"{bad} failed"] if bad else []) + [f"{passed} passed", f"{tot['skipped']} skipped"]
print(f"whole test matrix, all releases, venv builds included: {sys.argv[2]}s")
print(f"===== {', '.join(parts)} in {sys.argv[2]}s =====")
PY
if (( ${#failed[@]} )); then echo "FAILED releases: ${failed[*]}"; exit 1; fi
