#!/usr/bin/env bash
# Build the carried folder (git-ignored) for bench/gpu/server/run.sh: .gpuserver/ (TIER=qwen, default) or .gpudsa/
# (TIER=dsa). Run HERE (PyPI reachable), from
# anywhere in the checkout. On demand only: nothing of CI calls it. Limit: the carry plus the working tree <= 64 MiB.
#   whl/     the image's missing Python packages (Python 3.12, torch 2.11 there): bench/gpu/server/wheels.txt
#   sg/      sglang wheels trimmed (their Rust _core extensions, multimodal_gen/, test/ dropped; LZMA, 8.8 MB for 0.5.17)
#   sk/      sglang-kernel trimmed to sm90 common_ops (flash_ops, sm100/, infllm/flashmla dropped; LZMA, 13.8 MB)
#   plugin/  this plugin as a wheel, built from `git archive HEAD` (the commit is written to plugin/COMMIT)
#   model/   tiny-qwen3-moe-gpu: bench/gpu/server/model/config.json + the launch tier's tokenizer files
#            (TIER=dsa: model-dsa/config.json, a tiny GlmMoeDsaForCausalLM with MTP IndexShare, README of the tier)
#   dg/      TIER=dsa only: sgl-deep-gemm (DG_VERSION, 0.5.17's pin 0.1.5.post1), the DSA indexer's paged MQA logits,
#            JIT-compiled on the device by its nvcc; only the headers those sm90 kernels include (DG_TRIM=0: all)
#   cache/   JIT caches returned by an earlier run (CACHE=path/to/jit-cache.tgz): SGLang's tvm-ffi kernels + Triton
#   mc/      MOONCAKE=1 only (stage pd): mooncake-transfer-engine-cuda13 (MC_VERSION, 0.3.14: libcudart 13, as the
#            device's torch 2.11+cu130) trimmed to what `mooncake.engine` loads (LZMA, 6.5 MB); engine.so also needs
#            libibverbs, libmlx5, libnuma and libcurl from the image (all there on the lent H100, 2026-12-07)
# Knobs: TIER, CARRY_DIR (another folder name, e.g. one carry per release), SGLANG_VERSIONS (default 0.5.17), SGLANG_KERNEL (0.4.5; 0.5.15.post1 pins 0.4.4), NO_PYSPY=1, MOONCAKE=1.
# TIER=dsa keeps sglang-kernel's flashmla_ops (FlashMLA sparse/FP8 kernels, +3.2 MB).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd); cd "$ROOT"
HERE=bench/gpu/server
DL=${DL:-/tmp/gpuserver-dl}
P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp"
for n in 28 27 17 24 26 31 34 35 39; do P="$P --platform manylinux_2_${n}_x86_64"; done
P="$P --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
quiet() { grep -vE 'is ignored|^\s*$' || true; }
TIER=${TIER:-qwen}
case $TIER in qwen) C=${CARRY_DIR:-.gpuserver}; MODEL_DIR=$HERE/model ;; dsa) C=${CARRY_DIR:-.gpudsa}; MODEL_DIR=$HERE/model-dsa ;;
  *) echo "TIER must be qwen or dsa, not '$TIER'"; exit 2 ;; esac
KEEP_CACHE=""; [[ -f $C/cache/jit-cache.tgz ]] && KEEP_CACHE=$(mktemp) && cp $C/cache/jit-cache.tgz "$KEEP_CACHE"
rm -rf $C; mkdir -p $C/{whl,sg,sk,plugin,model,cache} "$DL"/{whl,sg,sk,dg}
W=$(grep -vE '^\s*(#|$)' $HERE/wheels.txt | tr '\n' ' ')
[[ ${NO_PYSPY:-0} == 1 ]] && W=$(echo "$W" | tr ' ' '\n' | grep -v '^py[-_]spy' | tr '\n' ' ')
python3 -m pip download -q $P -d "$DL/whl" $W 2>&1 | quiet
for w in $W; do cp "$DL"/whl/"$(echo "${w%%==*}" | tr '-' '_')"-"${w##*==}"-*.whl $C/whl/; done
for V in ${SGLANG_VERSIONS:-0.5.17}; do python3 -m pip download -q $P -d "$DL/sg" "sglang==$V" 2>&1 | quiet; done
SK=${SGLANG_KERNEL:-0.4.5}
python3 -m pip download -q $P -d "$DL/sk" "sglang-kernel==$SK" 2>&1 | quiet
DG=${DG_VERSION:-0.1.5.post1}
if [[ $TIER == dsa ]]; then mkdir -p $C/dg; python3 -m pip download -q $P -d "$DL/dg" "sgl-deep-gemm==$DG" 2>&1 | quiet; fi
MC=${MC_VERSION:-0.3.14}
if [[ ${MOONCAKE:-0} == 1 ]]; then
  mkdir -p $C/mc "$DL/mc"; python3 -m pip download -q $P -d "$DL/mc" "mooncake-transfer-engine-cuda13==$MC" 2>&1 | quiet
fi
python3 - "$DL" "$SK" "$C" "$TIER" "$DG" "${DG_TRIM:-1}" ${SGLANG_VERSIONS:-0.5.17} <<'PY'
import glob, os, posixpath, re, sys, zipfile
dl, sk, carry, tier, dg, dg_trim, versions = *sys.argv[1:5], sys.argv[5], sys.argv[6] == "1", sys.argv[7:]
def trim(src: str, dst: str, drop) -> None:
    # LZMA: a quarter smaller than the wheels' deflate for sglang-kernel (18.2 -> 13.8 MB); run.sh extracts with zipfile
    s, d = zipfile.ZipFile(src), zipfile.ZipFile(dst, "w", zipfile.ZIP_LZMA)
    dropped = [i.filename for i in s.infolist() if drop(i.filename)]
    for i in s.infolist():
        if i.filename not in dropped:
            d.writestr(i, s.read(i.filename), compress_type=zipfile.ZIP_LZMA)  # a ZipInfo keeps its own otherwise
    d.close()
    print(f"{dst}: dropped {len(dropped)} files, e.g. {[n for n in dropped if n.endswith('.so')][:4]}")
# SGLang's Rust extensions: up to 0.5.17 sglang/srt/{server,grpc,multimodal}/_core*.so, in 0.5.20
# sglang/srt/rust_extensions/_*; used only with SGLANG_RUST_SERVER, gRPC or a multimodal model, none of which runs here.
RUST = ("sglang/srt/server/_core", "sglang/srt/grpc/_core", "sglang/srt/multimodal/_core", "sglang/srt/rust_extensions/_")
for v in versions:
    trim(glob.glob(f"{dl}/sg/sglang-{v}-*.whl")[0], f"{carry}/sg/sglang-{v}-trimmed.zip",
         lambda n: n.startswith(RUST + ("sglang/multimodal_gen/", "sglang/test/")))
trim(glob.glob(f"{dl}/sk/sglang_kernel-{sk}-*.whl")[0], f"{carry}/sk/sglang_kernel-{sk}-trimmed-sm90.zip",
     lambda n: n == "sgl_kernel/flash_ops.abi3.so" or n.startswith("sgl_kernel/sm100/") or "infllm_ops" in n
     or ("flashmla_ops" in n and tier != "dsa"))
if tier == "dsa":
    # sgl-deep-gemm JIT-compiles its kernels from headers in the wheel: keep the #include closure of the sm90 MQA-logits
    # kernels SGLang's DSA indexer reaches (80 of 859 headers for 0.1.5.post1)
    src = glob.glob(f"{dl}/dg/sgl_deep_gemm-{dg}-*.whl")[0]
    z = zipfile.ZipFile(src)
    names, pre, keep = set(z.namelist()), "deep_gemm/include/", set()
    roots = ("impls/sm90_fp8_paged_mqa_logits.cuh", "scheduler/sm90_paged_mqa_logits.cuh", "impls/sm90_fp8_mqa_logits.cuh",
             "impls/smxx_clean_logits.cuh", "impls/smxx_layout.cuh")
    todo = [f"{pre}deep_gemm/{r}" for r in roots] if dg_trim else []
    include = re.compile(r'^\s*#\s*include\s*[<"]([^">]+)[">]', re.M)
    while todo:
        path = todo.pop()
        if path in keep or path not in names:
            continue
        keep.add(path)
        for inc in include.findall(z.read(path).decode("utf-8", "replace")):
            here = posixpath.normpath(posixpath.join(posixpath.dirname(path), inc))
            todo += [c for c in (here, pre + inc) if c in names][:1]
    trim(src, f"{carry}/dg/sgl_deep_gemm-{dg}.zip", lambda n: dg_trim and n.startswith(pre) and n not in keep)
if os.environ.get("MOONCAKE") == "1":
    # what `from mooncake.engine import TransferEngine` loads: engine.so with its RPATH'd libraries (readelf -d)
    mc = os.environ.get("MC_VERSION", "0.3.14")
    keep_mc = ("mooncake/__init__.py", "mooncake/engine.so", "mooncake/libetcd_wrapper.so", "mooncake/libasio.so")
    libs = ("libglog-", "libgflags-", "libyaml-cpp-", "libjsoncpp-")
    trim(glob.glob(f"{dl}/mc/mooncake_transfer_engine_cuda13-{mc}-*.whl")[0], f"{carry}/mc/mooncake-{mc}-trimmed.zip",
         lambda n: not (n in keep_mc or (n.split("/")[0].endswith(".libs") and n.split("/")[-1].startswith(libs))))
PY
T=$(mktemp -d); git archive HEAD | tar x -C "$T"
python3 -m pip wheel -q --no-deps -w $C/plugin "$T" 2>&1 | quiet; rm -rf "$T"
git rev-parse HEAD > $C/plugin/COMMIT
M=tests/launch/models/tiny-qwen3-moe
cp $M/tokenizer.json $M/tokenizer_config.json $M/generation_config.json $MODEL_DIR/config.json $C/model/
if [[ -n ${CACHE:-} && -f ${CACHE:-} ]]; then cp "$CACHE" $C/cache/jit-cache.tgz
elif [[ -n $KEEP_CACHE ]]; then mv "$KEEP_CACHE" $C/cache/jit-cache.tgz; fi
du -sb $C/* | sort -n
CARRY=$(du -sb $C | cut -f1); TREE=$(git archive HEAD | wc -c)
echo "carry $C: $CARRY bytes + tracked tree ~$TREE = $((CARRY + TREE)) of 67108864 (64 MiB)"
(( CARRY + TREE <= 67108864 )) || echo "OVER THE 64 MiB LIMIT: NO_PYSPY=1 or a smaller CACHE"
