#!/usr/bin/env bash
# Device side of the GPU server tier (on demand; never CI). From the repo root, with the carry of fetch.sh:
#   NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
#     STAGES="hang" bash bench/gpu/server/run.sh 2>&1 | tee $OUT/log            # Qwen tier, carry .gpuserver
#   G=.gpudsa STAGES="trim hang" bash bench/gpu/server/run.sh ...               # DSA tier, carry .gpudsa
# Refuses to start unless NVLink multicast is off in NCCL, PyTorch and NVSHMEM (a program that uses it can put a
# shared host's GPUs out of service). Installs the carried wheels under /tmp, restores the carried JIT cache, runs
# drive.py per release carried in $G/sg (or RELEASES), and leaves under $OUT: env.txt, summary-<release>.json,
# logs-<release>.tgz (node logs + observer records; committed results keep them as .tar.xz, without the observer's
# rank*.jsonl, which the soak JSON sums up: the tree and a carry share 64 MiB), jit-cache.tgz (carry it next time:
# fetch.sh CACHE=...).
# DSA tier (the carry has dg/): sgl-deep-gemm is unpacked beside the wheels, CUDA_HOME comes from nvcc (DeepGEMM
# JIT-compiles with it), and preflight_dsa.py (PREFLIGHT=0 skips it) calls the DSA kernels against torch references
# before any server starts; the JIT cache then keeps only what a later run reuses (tvm-ffi *.so, ~/.deep_gemm,
# Triton's cache).
set -u
for v in NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1; do
  [[ "$(printenv "${v%%=*}")" == "${v#*=}" ]] || { echo "refusing to start: ${v%%=*} must be ${v#*=} (is '$(printenv "${v%%=*}")')"; exit 3; }
done
export PYTHONUNBUFFERED=1
ROOT=$PWD; HERE=$ROOT/bench/gpu/server; G=${G:-.gpuserver}; [[ $G == /* ]] || G=$ROOT/$G; export G
L=${OUT:-/tmp/out}; mkdir -p "$L"; T0=$(date +%s); el() { echo "[run +$(( $(date +%s) - T0 ))s] $*"; }
# BASE=<folder>: a carry of one release (sg/, plugin/, model/, and dg/ or sk/ where its pins differ) borrows the
# missing whl/, sk/, dg/, mc/ from a full carry left on the warm machine by an earlier call (64 MiB fit one full carry)
if [[ -n ${BASE:-} ]]; then
  [[ $BASE == /* ]] || BASE=$ROOT/$BASE
  for d in whl sk dg mc; do [[ -e $G/$d || ! -d $BASE/$d ]] || ln -s "$BASE/$d" "$G/$d"; done
fi
[[ -d $G/whl && -d $G/sk ]] || { echo "no $G/whl or $G/sk, and no BASE carry (${BASE:-unset}) on this machine: carry a full folder"; exit 4; }
DSA=0; [[ -d $G/dg ]] && DSA=1
if (( DSA )); then
  NVCC=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc 2>/dev/null | head -1)
  [[ -n $NVCC ]] && export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$NVCC")")} PATH=$(dirname "$NVCC"):$PATH
  export DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-$HOME/.deep_gemm} FLASHINFER_STUB_REFUSE=flashinfer.fused_moe
  # as drive.py sets them per node, for the preflight's SGLang imports
  export SGLANG_IS_FLASHINFER_AVAILABLE=false SGLANG_ENABLE_JIT_DEEPGEMM=false
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; python3 -V
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())"
  nvcc --version 2>/dev/null | tail -1; nproc; echo "plugin commit $(cat "$G/plugin/COMMIT")"; echo "carry $G:"
  du -sb "$G"/* | sort -n; } 2>&1 | tee "$L/env.txt"
el install
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$G"/whl/*.whl "$G"/plugin/*.whl > /tmp/install.log 2>&1 \
  || { echo "install failed"; tail -5 /tmp/install.log; }
unzip_to() { python3 -c "import zipfile,sys; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$1" "$2"; }
for z in "$G"/dg/*.zip; do [[ -f $z ]] && unzip_to "$z" /tmp/site && el "unpacked $(basename "$z")"; done
rm -rf /tmp/sk && mkdir -p /tmp/sk && unzip_to "$G"/sk/*.zip /tmp/sk
MC=""  # stage pd's real KV transfer (fetch.sh MOONCAKE=1): mooncake's engine on the servers' path
for z in "$G"/mc/*.zip; do
  [[ -f $z ]] || continue
  rm -rf /tmp/mc && mkdir -p /tmp/mc && unzip_to "$z" /tmp/mc && MC=:/tmp/mc
  el "mooncake $(basename "$z"): $(PYTHONPATH=/tmp/mc python3 -c 'import mooncake.engine as e; print("imports", e.TransferEngine.__name__)' 2>&1 | tail -1)" | tee -a "$L/env.txt"
done
for c in "$G"/cache/*.tgz; do [[ -f $c ]] && tar xzf "$c" -C / && el "restored JIT cache $(basename "$c")"; done
export PATH=/tmp/site/bin:$PATH   # py-spy: drive.py's evidence and SGLang's soft watchdog
# MPS=1: the servers' processes share the GPU through one CUDA MPS daemon of this run (pipe and log under /tmp,
# quit at the end) instead of N contexts the GPU time-slices between (bench/gpu/nccl_one_gpu.py measures both)
# (the variables are exported only once the daemon runs: the servers and their JSON's gpu_sharing read them)
MPS_UP=0
if [[ ${MPS:-0} == 1 ]]; then
  mkdir -p /tmp/mps/pipe /tmp/mps/log
  if CUDA_MPS_PIPE_DIRECTORY=/tmp/mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps/log nvidia-cuda-mps-control -d; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps/log; MPS_UP=1
    el "MPS daemon up" | tee -a "$L/env.txt"
  else
    el "MPS daemon did not start: the ranks share the GPU time-sliced" | tee -a "$L/env.txt"
  fi
fi
RELEASES=${RELEASES:-$(ls "$G"/sg | sed 's/^sglang-//; s/-trimmed.zip$//' | sort -V | tr '\n' ' ')}
for V in $RELEASES; do
  rm -rf /tmp/sg /tmp/gslogs && mkdir -p /tmp/sg /tmp/gslogs
  unzip_to "$G/sg/sglang-$V-trimmed.zip" /tmp/sg
  export PYTHONPATH=/tmp/sg:/tmp/site:/tmp/sk:$HERE/stubs:$ROOT/bench/gpu/stubs$MC SGLANG_RELEASE=$V
  (( DSA )) && export PYTHONPATH=/tmp/sg:/tmp/site:/tmp/sk:$HERE/stubs$MC  # the real deep_gemm, not the stand-in
  # 0.5.15.post1 imports its SM100-only CuTe DSL kernel eagerly; its package does not fit the carry (stubs_sm100/)
  (( DSA )) && [[ $V == 0.5.15.post1 ]] && ! python3 -c 'import cutlass' 2>/dev/null && export PYTHONPATH=$PYTHONPATH:$HERE/stubs_sm100
  el "sglang $V: $(python3 -c 'import sglang, sglang_dp_mtp_fix as p; print(sglang.__version__, "plugin", p.__version__)' 2>&1 | tail -1)"
  if (( DSA )) && [[ ${PREFLIGHT:-1} == 1 ]]; then
    timeout "${PREFLIGHT_TIMEOUT_S:-180}" python3 "$HERE/preflight_dsa.py" > "$L/preflight-$V.jsonl" 2> /tmp/preflight.err
    el "preflight $V rc=$? $(tail -1 "$L/preflight-$V.jsonl")"; tail -3 /tmp/preflight.err
  fi
  DRIVE_LOGS=/tmp/gslogs timeout "${DRIVE_TIMEOUT_S:-540}" python3 "$HERE/drive.py" ${STAGES:-hang}
  el "drive $V rc=$?"
  for g in $(cat /tmp/gslogs/pgids 2>/dev/null); do kill -KILL -- "-$g" 2>/dev/null && echo "killed group $g"; done
  tar czf "$L/logs-$V.tgz" -C /tmp gslogs
done
nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
if (( MPS_UP )); then
  echo "MPS clients seen: $(grep -c 'NEW CLIENT' $CUDA_MPS_LOG_DIRECTORY/control.log 2>/dev/null)" | tee -a "$L/env.txt"
  echo quit | nvidia-cuda-mps-control
fi
H=${HOME#/}
if (( DSA )); then  # a cached tvm-ffi .so loads without ninja (SGLang's load_jit); the build folders are not needed
  { (cd / && find "$H/.cache/tvm-ffi" -name '*.so' 2>/dev/null); [[ -d $DG_JIT_CACHE_DIR ]] && echo "${DG_JIT_CACHE_DIR#/}"
    [[ -d $HOME/.triton/cache ]] && echo "$H/.triton/cache"
    [[ -d $HOME/.cache/sglang ]] && echo "$H/.cache/sglang"; } > /tmp/jit-cache.list  # 0.5.18+: SGLANG_CACHE_DIR
  tar czf /tmp/jit-cache.tgz -C / -T /tmp/jit-cache.list 2>/dev/null
else
  tar czf /tmp/jit-cache.tgz -C / "$H/.cache/tvm-ffi" "$H/.triton/cache" 2>/dev/null
fi
(( $(stat -c %s /tmp/jit-cache.tgz) < ${JIT_CACHE_MAX:-16000000} )) && cp /tmp/jit-cache.tgz "$L/"
el "end: jit cache $(stat -c %s /tmp/jit-cache.tgz) bytes"; ls -la "$L"
