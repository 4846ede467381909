#!/usr/bin/env bash
# Device side: install the carried wheels into /tmp, then per release dp_vote_gpu.py (2 GPUs; SKIP_DP_VOTE=1 on one),
# padding_ops_gpu.py (SKIP_PADDING=1 skips it) and cuda_context_probe.py (1 GPU each). Multicast stays off.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
G=$PWD/.gpucarry; L=${OUT:-/tmp/out}; mkdir -p "$L"
{ nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -V; } 2>&1 | tee "$L/env.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $G/whl/*.whl $G/plugin/*.whl > "$L/install.log" 2>&1; echo "deps rc=$?"
mkdir -p /tmp/sk && python3 -c "import zipfile,sys; zipfile.ZipFile(sys.argv[1]).extractall('/tmp/sk')" $G/sk/*.zip
for Z in $G/sg/sglang-*-trimmed.zip; do
  V=$(basename "$Z" | sed 's/^sglang-//; s/-trimmed.zip$//')
  rm -rf /tmp/sg && mkdir -p /tmp/sg && python3 -c "import zipfile,sys; zipfile.ZipFile(sys.argv[1]).extractall('/tmp/sg')" "$Z"
  export PYTHONPATH=/tmp/sg:/tmp/site:/tmp/sk:$G/stubs/fi:$PWD/bench/gpu/stubs SGLANG_VERSION_LABEL=$V
  echo "=== sglang $V"; python3 -m sglang_dp_mtp_fix.cli doctor 2>&1 | grep -vE "warn|Warn" | tail -5
  [[ ${SKIP_DP_VOTE:-0} == 1 ]] || timeout 200 python3 bench/gpu/dp_vote_gpu.py 2>&1 | grep -vE "Warn|warn|^\s*$|DEEPEP|chunked prefill" | cut -c1-600 | tee "$L/dp_vote_gpu-$V.log" | grep -E "^MSG|PARENT" | tail -20
  # the DP-padding patches' tensor operations: no host sync, CUDA-graph capture and replay (1 GPU)
  [[ ${SKIP_PADDING:-0} == 1 ]] || timeout 120 python3 bench/gpu/padding_ops_gpu.py 2>&1 | grep -E "^RESULT|Error|error" | cut -c1-1500 | tee "$L/padding_ops_gpu-$V.log"
  # does loading the plugin create a CUDA context (stock vs patched, with and without the DSA modules; control)
  timeout 300 python3 bench/gpu/cuda_context_probe.py 2>&1 | grep -E "^RESULT|^SUMMARY|^CASE" | cut -c1-3000 | tee "$L/cuda_context_probe-$V.log"
done
