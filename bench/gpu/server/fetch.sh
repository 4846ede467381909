#!/usr/bin/env bash
# Build the carried folder .gpuserver/ (git-ignored) for bench/gpu/server/run.sh. Run HERE (PyPI reachable), from
# anywhere in the checkout. On demand only: nothing of CI calls it. Limit: the carry plus the working tree <= 64 MiB.
#   whl/     the image's missing Python packages (Python 3.12, torch 2.11 there): bench/gpu/server/wheels.txt
#   sg/      sglang wheels trimmed (their Rust _core extensions, multimodal_gen/, test/ dropped; ~9 MB each)
#   sk/      sglang-kernel trimmed to sm90 common_ops (flash_ops, sm100/, infllm/flashmla dropped; ~15 MB)
#   plugin/  this plugin as a wheel, built from `git archive HEAD` (the commit is written to plugin/COMMIT)
#   model/   tiny-qwen3-moe-gpu: bench/gpu/server/model/config.json + the launch tier's tokenizer files
#   cache/   JIT caches returned by an earlier run (CACHE=path/to/jit-cache.tgz): SGLang's tvm-ffi kernels + Triton
# Knobs: SGLANG_VERSIONS (default 0.5.17), SGLANG_KERNEL (0.4.5; 0.5.15.post1 pins 0.4.4), NO_PYSPY=1.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd); cd "$ROOT"
HERE=bench/gpu/server
DL=${DL:-/tmp/gpuserver-dl}
P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp"
for n in 28 27 17 24 26 31 34 35 39; do P="$P --platform manylinux_2_${n}_x86_64"; done
P="$P --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
quiet() { grep -vE 'is ignored|^\s*$' || true; }
C=.gpuserver
KEEP_CACHE=""; [[ -f $C/cache/jit-cache.tgz ]] && KEEP_CACHE=$(mktemp) && cp $C/cache/jit-cache.tgz "$KEEP_CACHE"
rm -rf $C; mkdir -p $C/{whl,sg,sk,plugin,model,cache} "$DL"/{whl,sg,sk}
W=$(grep -vE '^\s*(#|$)' $HERE/wheels.txt | tr '\n' ' ')
[[ ${NO_PYSPY:-0} == 1 ]] && W=$(echo "$W" | tr ' ' '\n' | grep -v '^py-spy' | tr '\n' ' ')
python3 -m pip download -q $P -d "$DL/whl" $W 2>&1 | quiet
for w in $W; do cp "$DL"/whl/"$(echo "${w%%==*}" | tr '-' '_')"-"${w##*==}"-*.whl $C/whl/; done
for V in ${SGLANG_VERSIONS:-0.5.17}; do python3 -m pip download -q $P -d "$DL/sg" "sglang==$V" 2>&1 | quiet; done
SK=${SGLANG_KERNEL:-0.4.5}
python3 -m pip download -q $P -d "$DL/sk" "sglang-kernel==$SK" 2>&1 | quiet
python3 - "$DL" "$SK" ${SGLANG_VERSIONS:-0.5.17} <<'PY'
import glob, sys, zipfile
dl, sk, versions = sys.argv[1], sys.argv[2], sys.argv[3:]
def trim(src: str, dst: str, drop) -> None:
    s, d = zipfile.ZipFile(src), zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9)
    dropped = [i.filename for i in s.infolist() if drop(i.filename)]
    for i in s.infolist():
        if i.filename not in dropped:
            d.writestr(i, s.read(i.filename))
    d.close()
    print(f"{dst}: dropped {len(dropped)} files, e.g. {[n for n in dropped if n.endswith('.so')][:4]}")
# SGLang's Rust extensions: up to 0.5.17 sglang/srt/{server,grpc,multimodal}/_core*.so, in 0.5.20
# sglang/srt/rust_extensions/_*; used only with SGLANG_RUST_SERVER, gRPC or a multimodal model, none of which runs here.
RUST = ("sglang/srt/server/_core", "sglang/srt/grpc/_core", "sglang/srt/multimodal/_core", "sglang/srt/rust_extensions/_")
for v in versions:
    trim(glob.glob(f"{dl}/sg/sglang-{v}-*.whl")[0], f".gpuserver/sg/sglang-{v}-trimmed.zip",
         lambda n: n.startswith(RUST + ("sglang/multimodal_gen/", "sglang/test/")))
trim(glob.glob(f"{dl}/sk/sglang_kernel-{sk}-*.whl")[0], f".gpuserver/sk/sglang_kernel-{sk}-trimmed-sm90.zip",
     lambda n: n == "sgl_kernel/flash_ops.abi3.so" or n.startswith("sgl_kernel/sm100/") or "infllm_ops" in n
     or "flashmla_ops" in n)
PY
T=$(mktemp -d); git archive HEAD | tar x -C "$T"
python3 -m pip wheel -q --no-deps -w $C/plugin "$T" 2>&1 | quiet; rm -rf "$T"
git rev-parse HEAD > $C/plugin/COMMIT
M=tests/launch/models/tiny-qwen3-moe
cp $M/tokenizer.json $M/tokenizer_config.json $M/generation_config.json $HERE/model/config.json $C/model/
if [[ -n ${CACHE:-} && -f ${CACHE:-} ]]; then cp "$CACHE" $C/cache/jit-cache.tgz
elif [[ -n $KEEP_CACHE ]]; then mv "$KEEP_CACHE" $C/cache/jit-cache.tgz; fi
du -sb $C/* | sort -n; du -sb $C
