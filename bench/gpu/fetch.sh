#!/usr/bin/env bash
# Build the carried folder .gpucarry/ for bench/gpu/run.sh (run here, where PyPI is reachable). ~62 MB < 64 MiB.
# Recipe (bench/gpu/README.md): 27 dependency wheels for the image's Python 3.12 + torch 2.11, SGLang 0.5.17,
# sglang-kernel 0.4.5 trimmed to sm90, a flashinfer stand-in, and this plugin as a wheel.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd); cd "$ROOT"
# The GPU probe kit (its wheels.txt and stubs/) is kept beside the repository, not in it.
R=/work/shared/research/gpu-probe; [[ -d $R ]] || R=../shared/research/gpu-probe
P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp"
for n in 28 27 17 24 31 34 35 39; do P="$P --platform manylinux_2_${n}_x86_64"; done
P="$P --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
rm -rf .gpucarry; mkdir -p .gpucarry/whl .gpucarry/sg .gpucarry/sk .gpucarry/plugin /tmp/gpucarry-sk
python3 -m pip download -q $P -d .gpucarry/whl $(cat $R/wheels.txt)
# SGLang wheels, trimmed so that several fit in one carry: the Rust server/grpc/multimodal extensions, multimodal_gen/
# and test/ are not imported on the scheduler/DP/speculative paths (gpu-feasibility.md, "Trimmed sglang wheels").
for V in ${SGLANG_VERSIONS:-0.5.17}; do
  python3 -m pip download -q $P -d /tmp/gpucarry-sg "sglang==$V"
  python3 - "$V" <<'PY'
import glob, sys, zipfile
v = sys.argv[1]
src = zipfile.ZipFile(glob.glob(f'/tmp/gpucarry-sg/sglang-{v}-*.whl')[0])
dst = zipfile.ZipFile(f'.gpucarry/sg/sglang-{v}-trimmed.zip', 'w', zipfile.ZIP_DEFLATED, compresslevel=9)
# Rust extensions: up to 0.5.17 they are sglang/srt/{server,grpc,multimodal}/_core*.so (the rust_extensions/_* names
# alone matched nothing there: 0.5.17's "trimmed" wheel stayed 19.2 MB instead of 9.2); 0.5.20 has rust_extensions/_*
rust = ('sglang/srt/server/_core', 'sglang/srt/grpc/_core', 'sglang/srt/multimodal/_core', 'sglang/srt/rust_extensions/_')
drop = lambda n: n.startswith(rust + ('sglang/multimodal_gen/', 'sglang/test/'))
for i in src.infolist():
    if not drop(i.filename):
        dst.writestr(i, src.read(i.filename))
dst.close()
PY
done
SK=${SGLANG_KERNEL:-0.4.5}  # 0.5.15.post1 pins 0.4.4, 0.5.16+ pin 0.4.5
python3 -m pip download -q $P -d /tmp/gpucarry-sk sglang-kernel==$SK
python3 - "$SK" <<'PY'
import glob, sys, zipfile
sk = sys.argv[1]
src = zipfile.ZipFile(glob.glob(f'/tmp/gpucarry-sk/sglang_kernel-{sk}-*.whl')[0])
dst = zipfile.ZipFile(f'.gpucarry/sk/sglang_kernel-{sk}-trimmed-sm90.zip', 'w', zipfile.ZIP_DEFLATED, compresslevel=9)
drop = lambda n: n == 'sgl_kernel/flash_ops.abi3.so' or n.startswith('sgl_kernel/sm100/') or 'infllm_ops' in n or 'flashmla_ops' in n
for i in src.infolist():
    if not drop(i.filename):
        dst.writestr(i, src.read(i.filename))
dst.close()
PY
cp -r $R/stubs .gpucarry/stubs   # STAND-IN flashinfer (its dependency set is hundreds of MB; nothing here calls it)
python3 -m pip wheel -q --no-deps -w .gpucarry/plugin .
du -sb .gpucarry
