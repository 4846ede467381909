#!/usr/bin/env bash
# Build (or reuse) a lean CPU venv holding one stock SGLang release plus this plugin (editable, --no-deps).
# Usage: tools/mkvenv.sh VERSION   -> prints the venv path on the last line.
#        tools/mkvenv.sh --recipe-id  -> prints the recipe id (tools/test-matrix.sh: which venvs exist already).
# Recipe: the torch 2.13.0 CPU wheel from local disk, sglang --no-deps, ~26 small deps pinned by that release's own
# pins, a torchvision CPU stand-in via a .pth file. Build times: docs/development.md.
set -euo pipefail
RECIPE_ID=r4   # bump when the recipe below changes: cached venvs are then rebuilt
if [[ ${1:-} == --recipe-id ]]; then echo "$RECIPE_ID"; exit 0; fi
V=${1:?usage: mkvenv.sh SGLANG_VERSION}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV_ROOT=${SGLANG_DP_MTP_FIX_VENVS:-$HOME/.cache/sglang-dp-mtp-fix/venvs}
E="$VENV_ROOT/sglang-$V-$RECIPE_ID"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_CACHE_DIR=${PIP_CACHE_DIR:-$HOME/.cache/sglang-dp-mtp-fix/pip}
quiet() { grep -vE 'is ignored|requires|resolver|incompatible|^\s*$' || true; }
# torchvision CPU stand-in (tests/cpu_stubs/torchvision explains why); a .pth so spawned ranks see it too
stubs() { echo "$ROOT/tests/cpu_stubs" > "$("$E/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz_sglang_dp_mtp_fix_cpu_stubs.pth"; }
# Venvs of an older recipe are never used again: remove them (2.5 GB each), or each recipe bump leaves a whole set
# behind to fill the disk.
for stale in "$VENV_ROOT"/sglang-*-r[0-9]*; do
  [[ -d $stale && ${stale##*-} != "$RECIPE_ID" ]] && { echo "removing a venv of an older recipe: $stale" >&2; rm -rf "$stale"; }
done
if [[ ! -f "$E/.complete" ]]; then
  rm -rf "$E"; mkdir -p "$VENV_ROOT"
  python3 -m venv "$E"
  "$E/bin/pip" install -q torch==2.13.0 packaging 2>&1 | quiet
  "$E/bin/pip" install -q --no-deps "sglang==$V" 2>&1 | quiet
  TORCH_PIN="torch==2.13.0" "$E/bin/python" "$ROOT/tools/sglang_constraints.py" > "$E/constraints.txt"
  PIP_CONSTRAINT="$E/constraints.txt" "$E/bin/pip" install -q \
    numpy orjson psutil pybase64 requests triton pillow msgspec pyzmq tqdm ipython pydantic aiohttp \
    apache-tvm-ffi transformers dill sentencepiece einops compressed-tensors gguf openai partial-json-parser \
    setproctitle uvicorn fastapi xgrammar wrapt pytest pytest-mock \
    uvloop prometheus-client python-multipart jsonschema soundfile 2>&1 | quiet
  stubs
  "$E/bin/python" -c "import sglang, torch, wrapt, pytest" >/dev/null
  touch "$E/.complete"
fi
stubs
"$E/bin/pip" install -q --no-deps --no-build-isolation -e "$ROOT" 2>&1 | quiet
echo "$E"
