#!/usr/bin/env bash
# Build (or reuse) a lean CPU venv holding one stock SGLang release plus this plugin (editable, --no-deps).
# Usage: tools/mkvenv.sh VERSION      -> prints the venv path on the last line.
#        tools/mkvenv.sh tools        -> the lint/type/packaging tools venv (.ci/run, tools/check-wheel.sh); its path.
#        tools/mkvenv.sh --recipe-id  -> prints the recipe id (tools/test-matrix.sh: which venvs exist already).
#        tools/mkvenv.sh --root       -> prints this checkout's venv root.
# Recipe: the torch 2.13.0 CPU wheel from local disk, sglang --no-deps, ~26 small deps pinned by that release's own
# pins, a torchvision CPU stand-in via a .pth file. Installed by uv (pinned in the tools venv) from pip's own indexes
# and find-links: uv hardlinks each wheel's files from one cache, so the matrix's eight venvs (2.5 GB each) unpack
# torch and triton once, not eight times, on 2 cores. The plugin goes in editable with the venv's own pip.
# Build times: docs/development.md.
#
# One venv root per checkout: the plugin is installed editable, so a venv tests the checkout that installed it last.
# The default root is keyed by this checkout's path; a root (SGLANG_DP_MTP_FIX_VENVS) records its checkout in
# .checkout and refuses any other, so two checkouts never test each other's code or delete each other's venvs.
set -euo pipefail
RECIPE_ID=r5   # bump when the recipe below changes: cached venvs are then rebuilt
TOOLS_ID=tools-r5  # bump when the tools' pins below change
if [[ ${1:-} == --recipe-id ]]; then echo "$RECIPE_ID"; exit 0; fi
V=${1:?usage: mkvenv.sh SGLANG_VERSION|tools|--root|--recipe-id}
ROOT=$(cd "$(dirname "$0")/.." && pwd -P)
VENV_ROOT=${SGLANG_DP_MTP_FIX_VENVS:-$HOME/.cache/sglang-dp-mtp-fix/venvs/${ROOT##*/}-$(printf %s "$ROOT" | sha256sum | cut -c1-10)}
if [[ $V == --root ]]; then echo "$VENV_ROOT"; exit 0; fi
mkdir -p "$VENV_ROOT"
OWNER="$VENV_ROOT/.checkout"
[[ -f $OWNER ]] || echo "$ROOT" > "$OWNER"
if [[ $(cat "$OWNER") != "$ROOT" ]]; then
  echo "!!! venv root $VENV_ROOT belongs to the checkout $(cat "$OWNER"), not to $ROOT: its venvs hold that" \
    "checkout's editable install. Give this checkout a root of its own (unset SGLANG_DP_MTP_FIX_VENVS for the" \
    "per-checkout default, or set it to another directory)." >&2
  exit 2
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_CACHE_DIR=${PIP_CACHE_DIR:-$HOME/.cache/sglang-dp-mtp-fix/pip}
export UV_CACHE_DIR=${UV_CACHE_DIR:-$HOME/.cache/sglang-dp-mtp-fix/uv} UV_NO_PROGRESS=1
quiet() { grep -vE 'is ignored|requires|resolver|incompatible|^\s*$' || true; }
exec 9> "$VENV_ROOT/.lock-$V"  # one build of a venv at a time (a second caller waits, then reuses it)
flock 9

if [[ $V == tools ]]; then
  T="$VENV_ROOT/$TOOLS_ID"
  for old in "$VENV_ROOT"/tools "$VENV_ROOT"/tools-r*; do  # tool venvs of older pins are never used again
    [[ -d $old && $old != "$T" ]] && rm -rf "$old"
  done
  if [[ ! -f "$T/.complete" ]]; then
    rm -rf "$T"; python3 -m venv "$T"
    log=$(mktemp)
    if ! "$T/bin/pip" install -q ruff==0.17.6 mypy==2.4.1 build==1.6.1 packaging==26.4 uv==0.13.9 \
      twine==7.0.0 > "$log" 2>&1; then
      quiet < "$log" >&2; rm -f "$log"; echo "!!! the tools venv's pip install failed (above)" >&2; exit 1
    fi
    rm -f "$log"
    # complete only once every tool answers
    { "$T/bin/ruff" --version && "$T/bin/mypy" --version && "$T/bin/python" -m build --version &&
      "$T/bin/uv" --version && "$T/bin/twine" --version &&
      "$T/bin/python" -c "import packaging; print('packaging', packaging.__version__)"; } >&2 ||
      { echo "!!! a tool of $T does not answer --version" >&2; exit 1; }
    touch "$T/.complete"
  fi
  echo "$T"
  exit 0
fi

E="$VENV_ROOT/sglang-$V-$RECIPE_ID"
# torchvision CPU stand-in (tests/cpu_stubs/torchvision explains why); a .pth so spawned ranks see it too
stubs() { echo "$ROOT/tests/cpu_stubs" > "$("$E/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz_sglang_dp_mtp_fix_cpu_stubs.pth"; }
# Venvs of an older recipe (in this checkout's root) are never used again: remove them, or each recipe bump leaves a
# whole set behind to fill the disk.
for stale in "$VENV_ROOT"/sglang-*-r[0-9]*; do
  [[ -d $stale && ${stale##*-} != "$RECIPE_ID" ]] && { echo "removing a venv of an older recipe: $stale" >&2; rm -rf "$stale"; }
done
if [[ ! -f "$E/.complete" ]]; then
  rm -rf "$E"
  UV="$("$0" tools | tail -1)/bin/uv"
  # pip's index settings (pip.conf, PIP_*: find-links with the torch CPU wheel, local indexes) as uv flags, since uv
  # reads neither; pip's rule across indexes (the best version from any of them) as uv's index strategy
  read -ra SOURCES <<< "$(python3 -m pip config list 2>/dev/null |
    sed -n "s/^[^.]*\.\(find-links\|extra-index-url\|index-url\)='\(.*\)'\$/\1 \2/p" |
    while read -r key vals; do for v in $vals; do printf -- '--%s %s ' "$key" "$v"; done; done)"
  # --compile-bytecode: the .pyc written at install, as pip does; with PYTHONDONTWRITEBYTECODE set (as in this host's
  # shell) Python never writes them, and every process would compile each module it imports again
  uvi() { "$UV" pip install -q --compile-bytecode --python "$E/bin/python" --index-strategy unsafe-best-match \
    ${SOURCES[@]+"${SOURCES[@]}"} "$@"; }
  python3 -m venv "$E"
  uvi torch==2.13.0 packaging
  uvi --no-deps "sglang==$V"
  TORCH_PIN="torch==2.13.0" "$E/bin/python" "$ROOT/tools/sglang_constraints.py" > "$E/constraints.txt"
  uvi -c "$E/constraints.txt" \
    numpy orjson psutil pybase64 requests triton pillow msgspec pyzmq tqdm ipython pydantic aiohttp \
    apache-tvm-ffi transformers dill sentencepiece einops compressed-tensors gguf openai partial-json-parser \
    setproctitle uvicorn fastapi xgrammar wrapt pytest pytest-mock \
    uvloop prometheus-client python-multipart jsonschema soundfile
  stubs
  "$E/bin/python" -c "import sglang, torch, wrapt, pytest" >/dev/null
  [[ $("$E/bin/python" -c "import torch; print(torch.__version__)") == 2.13.0+cpu ]] ||
    { echo "!!! $E: torch is not the 2.13.0 CPU build" >&2; exit 1; }
  touch "$E/.complete"
fi
stubs
"$E/bin/pip" install -q --no-deps --no-build-isolation -e "$ROOT" 2>&1 | quiet
echo "$E"
