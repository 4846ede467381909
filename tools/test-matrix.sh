#!/usr/bin/env bash
# The whole test matrix: every supported SGLang release, real and unmodified, on CPU (one lean venv each).
# Usage: tools/test-matrix.sh [RELEASE ...]     (default: all, tests/releases.py MATRIX; SGLANG_RELEASES="..." works too)
# Two lanes run side by side, so both cores stay busy: the unit lane takes each release's unit job (everything but
# tests/launch) in order; the launch lane runs tests/launch on the releases that launch here (tests/releases.py
# LAUNCHES_HERE), then takes the unit jobs not yet taken, from the last release back (tools: claim, job).
# They hand out ports from disjoint ranges (SGLANG_DP_MTP_FIX_PORTS), each pytest has its own --basetemp. The venvs
# build one at a time ahead of both lanes (uv: tools/mkvenv.sh). Each lane prints its release's venv wait and test
# time and its slowest tests; the closing lines give the whole run's time. After its unit tests, each release's
# `doctor --json` is left in $OUT for tools/compat_table.py. Each release's passed count (both lanes' junit xml) must
# reach its floor (tests/releases.py PASS_FLOOR): a release below it fails the run, with the numbers.
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

# Free space first: the first venv takes ~2.6 GB in uv's cache, each further one ~0.2 GB (hardlinks, its sglang,
# .pyc). A full disk would otherwise show up as an ensurepip error in the middle of the run, with the releases before
# it green.
VENV_ROOT=$(tools/mkvenv.sh --root)
mkdir -p "$VENV_ROOT"
RECIPE_ID=$(tools/mkvenv.sh --recipe-id)
# .ci/run's whole-run limit names the phase it stopped in; a SIGTERM (that limit) ends the run once pytest has stopped
# what it started (tests/conftest.py turns SIGTERM into an interrupt).
phase() {  # phase LANE WHAT: each lane's own line; the phase file holds all of them
  [[ -n ${SGLANG_DP_MTP_FIX_CI_PHASE:-} ]] || return 0
  echo "$2" > "$VLOG/phase-$1"
  { echo "test matrix:"; for f in "$VLOG"/phase-*; do echo "  ${f##*/phase-}: $(cat "$f")"; done; } \
    > "$SGLANG_DP_MTP_FIX_CI_PHASE.tmp.$1" && mv "$SGLANG_DP_MTP_FIX_CI_PHASE.tmp.$1" "$SGLANG_DP_MTP_FIX_CI_PHASE"
  return 0
}
to_build=0
for v in "${RELEASES[@]}"; do [[ -f "$VENV_ROOT/sglang-$v-$RECIPE_ID/.complete" ]] || to_build=$((to_build + 1)); done
need_mb=$(( to_build * 500 + 5000 ))
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

LAUNCHING=$(python3 -c 'import sys; sys.path.insert(0, "tests"); from releases import LAUNCHES_HERE as L; print(*L)')
launches_here() { [[ " $LAUNCHING " == *" $1 "* ]]; }

claim() {  # claim RELEASE: take that release's unit job (once, whichever lane asks first: mkdir is atomic)
  mkdir "$VLOG/claimed-unit-$1" 2>/dev/null
}

job() {  # job LANE PORTS KIND RELEASE: one release's unit or launch tests; failures in $VLOG/failed-LANE
  local name=$1 ports=$2 kind=$3 v=$4 e w0 waited t0 xml status
  local -a paths
  w0=$(date +%s)
  phase "$name" "waiting for the SGLang $v venv's build"
  until [[ -f "$VLOG/$v.secs" ]]; do sleep 1; done
  waited=$(( $(date +%s) - w0 ))
  if [[ ! -s "$VLOG/$v.path" ]]; then
    echo "!!! [$name] SGLang $v: venv build failed after $(cat "$VLOG/$v.secs")s; its log ends:"
    tail -25 "$VLOG/$v.log"
    echo "$v(venv)" >> "$VLOG/failed-$name"; return
  fi
  e=$(cat "$VLOG/$v.path")
  if [[ $kind == launch ]]; then paths=(tests/launch); xml="$OUT/sglang-$v-launch.xml"
  elif launches_here "$v"; then paths=(tests --ignore=tests/launch); xml="$OUT/sglang-$v.xml"
  else paths=(tests); xml="$OUT/sglang-$v.xml"; fi  # no launch job here: its skips (and why) are reported here
  echo "=== [$name] SGLang $v: venv ready (waited ${waited}s); running ${paths[*]}"
  t0=$(date +%s) status=ok
  phase "$name" "SGLang $v: pytest ${paths[*]}"
  if ! SGLANG_DP_MTP_FIX_PORTS=$ports "$e/bin/python" -m pytest "${paths[@]}" -q -p no:cacheprovider \
        -W ignore::UserWarning -W ignore::DeprecationWarning --basetemp="$TMPS/$kind-$v" --durations=8 \
        --junitxml="$xml" -o junit_suite_name="sglang-$v-$kind"; then
    echo "$v" >> "$VLOG/failed-$name"; status=FAILED
  fi
  if [[ $kind == unit ]]; then phase "$name" "SGLang $v doctor --json"; doctor_json "$e" "$OUT/doctor-$v.json"; fi
  echo "$v $kind (lane $name): waited=${waited}s tests=$(( $(date +%s) - t0 ))s $status" >> "$VLOG/timings"
  echo "=== [$name] SGLang $v $kind: done in $(( $(date +%s) - t0 ))s ($status)"
}

TMPS=$(mktemp -d /tmp/sdmf-matrix.XXXXXX)
# a signal (.ci/run's whole-run limit reaches the whole process group): the lanes' pytests turn it into an interrupt
# and stop what they started (tests/conftest.py); wait for them, then end
trap 'echo "!!! test matrix stopped by a signal"; wait; rm -rf "$TMPS"; exit 143' TERM INT
( for v in "${RELEASES[@]}"; do phase builder "building the SGLang $v venv"; build "$v"; done ) &
LAUNCH_RELEASES=()
for v in "${RELEASES[@]}"; do launches_here "$v" && LAUNCH_RELEASES+=("$v"); done
# Each lane's output goes to its own log, printed whole when the lane ends: interleaved lines would be unreadable.
# Balanced: the unit lane takes the releases' unit jobs from the front; the launch lane runs every launch job (never
# two launches at once: each wants both cores), then takes the unit jobs still unclaimed from the back.
( for v in "${RELEASES[@]}"; do claim "$v" && job unit 10000-20999 unit "$v"; done ) > "$VLOG/lane-unit.log" 2>&1 &
unit_lane=$!
(
  for v in ${LAUNCH_RELEASES[@]+"${LAUNCH_RELEASES[@]}"}; do job launch 21000-32767 launch "$v"; done
  for (( i = ${#RELEASES[@]} - 1; i >= 0; i-- )); do
    claim "${RELEASES[i]}" && job launch 21000-32767 unit "${RELEASES[i]}"
  done
) > "$VLOG/lane-launch.log" 2>&1 &
launch_lane=$!
wait "$unit_lane"; echo "############ unit lane"; cat "$VLOG/lane-unit.log"
wait "$launch_lane"; echo "############ launch lane"; cat "$VLOG/lane-launch.log"
phase main "closing summary"
wait
rm -rf "$TMPS"
echo "timings (lanes side by side; venvs built ahead of them):"
for v in "${RELEASES[@]}"; do echo "  $v venv=$(cat "$VLOG/$v.secs" 2>/dev/null || echo ?)s"; done
sed 's/^/  /' "$VLOG/timings" 2>/dev/null
for f in "$VLOG"/failed-*; do [[ -f $f ]] && failed+=($(cat "$f")); done
floors=0
python3 - "$OUT" "$(( $(date +%s) - run_t0 ))" "${RELEASES[@]}" <<'PY' || floors=1
import glob, sys, xml.etree.ElementTree as ET
sys.path.insert(0, "tests")
from releases import LAUNCHES_HERE, PASS_FLOOR
out, wall, releases = sys.argv[1], sys.argv[2], sys.argv[3:]
tot = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
below = []
print("\nrelease        passed failed skipped  floor")
for rel in releases:
    n = dict.fromkeys(tot, 0)
    lanes = ("", "-launch") if rel in LAUNCHES_HERE else ("",)
    missing = [f"sglang-{rel}{lane}.xml" for lane in lanes if not glob.glob(f"{out}/sglang-{rel}{lane}.xml")]
    if missing:
        below.append(f"{rel}: no junit xml {', '.join(missing)} (those tests did not run)")
        continue
    for lane in lanes:
        root = ET.parse(f"{out}/sglang-{rel}{lane}.xml").getroot()
        suite = root if root.tag == "testsuite" else root[0]
        for k in n:
            n[k] += int(suite.get(k, 0))
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
