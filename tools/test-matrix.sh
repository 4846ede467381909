#!/usr/bin/env bash
# The whole test matrix: every supported SGLang release, real and unmodified, on CPU (one lean venv each).
# Usage: tools/test-matrix.sh [RELEASE ...]     (default: all, tests/releases.py MATRIX; SGLANG_RELEASES="..." works too)
# The next release's venv builds in the background while the current release's tests run (one build at a time,
# pip's cache shared across releases). Each release prints its venv build time, how long the tests waited for it,
# its test time and its slowest tests; the closing lines give the whole run's time. After its tests, each release's
# `doctor --json` is left in $OUT for tools/compat_table.py. Each release's passed count must reach its floor
# (tests/releases.py PASS_FLOOR, read from the junit xml): a release below it fails the run, with the numbers.
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
VENV_ROOT=$(tools/mkvenv.sh --root)
mkdir -p "$VENV_ROOT"
RECIPE_ID=$(tools/mkvenv.sh --recipe-id)
# .ci/run's whole-run limit names the phase it stopped in; a SIGTERM (that limit) ends the run once pytest has stopped
# what it started (tests/conftest.py turns SIGTERM into an interrupt).
phase() { [[ -n ${SGLANG_DP_MTP_FIX_CI_PHASE:-} ]] && echo "test matrix: $*" > "$SGLANG_DP_MTP_FIX_CI_PHASE"; return 0; }
trap 'echo "!!! test matrix stopped by a signal"; exit 143' TERM INT
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
  phase "waiting for the SGLang $V venv's build"
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
  phase "SGLang $V tests (pytest; the venv of the next release building beside it)"
  if ! "$E/bin/python" -m pytest tests -q -p no:cacheprovider -W ignore::UserWarning -W ignore::DeprecationWarning \
        --durations=8 --junitxml="$OUT/sglang-$V.xml" -o junit_suite_name="sglang-$V"; then
    failed+=("$V")
  fi
  phase "SGLang $V doctor --json"
  doctor_json "$E" "$OUT/doctor-$V.json"
  test_s=$(( $(date +%s) - t0 ))
  echo "=== SGLang $V: tests done in ${test_s}s"
  timings+=("$V venv=${venv_s}s waited=${waited}s tests=${test_s}s")
done
phase "closing summary"
wait
echo "timings (each venv build overlaps the previous release's tests):"
printf '  %s\n' "${timings[@]}"
floors=0
python3 - "$OUT" "$(( $(date +%s) - run_t0 ))" "${RELEASES[@]}" <<'PY' || floors=1
import glob, sys, xml.etree.ElementTree as ET
sys.path.insert(0, "tests")
from releases import PASS_FLOOR
out, wall, releases = sys.argv[1], sys.argv[2], sys.argv[3:]
tot = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
below = []
print("\nrelease        passed failed skipped  floor")
for rel in releases:
    paths = glob.glob(f"{out}/sglang-{rel}.xml")
    if not paths:
        below.append(f"{rel}: no junit xml (its tests did not run)")
        continue
    root = ET.parse(paths[0]).getroot()
    suite = root if root.tag == "testsuite" else root[0]
    n = {k: int(suite.get(k, 0)) for k in tot}
    for k in tot: tot[k] += n[k]
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    floor = PASS_FLOOR.get(rel)
    print(f"{rel:<14} {passed:>6} {n['failures']+n['errors']:>6} {n['skipped']:>7} {floor if floor is not None else '-':>6}")
    if floor is None:
        below.append(f"{rel}: no pass floor in tests/releases.py PASS_FLOOR")
    elif passed < floor:
        below.append(f"{rel}: {passed} passed, below its floor of {floor} ({floor - passed} fewer; "
                     f"{n['skipped']} skipped, {n['failures'] + n['errors']} failed)")
passed = tot["tests"] - tot["failures"] - tot["errors"] - tot["skipped"]
bad = tot["failures"] + tot["errors"]
parts = ([f"{bad} failed"] if bad else []) + [f"{passed} passed", f"{tot['skipped']} skipped"]
print(f"whole test matrix, all releases, venv builds included: {wall}s")
print(f"===== {', '.join(parts)} in {wall}s =====")
if below:
    print("!!! pass floor (tests/releases.py PASS_FLOOR):\n  " + "\n  ".join(below))
    sys.exit(1)
PY
if (( floors )); then failed+=("pass-floor"); fi
if (( ${#failed[@]} )); then echo "FAILED releases: ${failed[*]}"; exit 1; fi
