#!/usr/bin/env bash
# Device side of the GPU server tier (on demand; never CI). From the repo root, with .gpuserver/ carried:
#   NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
#     STAGES="hang" DRIVE_BUDGET_S=470 bash bench/gpu/server/run.sh 2>&1 | tee $OUT/log
# Refuses to start unless NVLink multicast is off in NCCL, PyTorch and NVSHMEM (a program that uses it can put a
# shared host's GPUs out of service). Installs the carried wheels under /tmp, restores the carried JIT cache, runs
# drive.py per release carried in .gpuserver/sg (or RELEASES), and leaves under $OUT: env.txt, summary-<release>.json,
# logs-<release>.tgz (node logs + trigger records), jit-cache.tgz (carry it next time: fetch.sh CACHE=...).
set -u
for v in NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1; do
  [[ "$(printenv "${v%%=*}")" == "${v#*=}" ]] || { echo "refusing to start: ${v%%=*} must be ${v#*=} (is '$(printenv "${v%%=*}")')"; exit 3; }
done
export PYTHONUNBUFFERED=1
ROOT=$PWD; HERE=$ROOT/bench/gpu/server; export G=$ROOT/.gpuserver
L=${OUT:-/tmp/out}; mkdir -p "$L"; T0=$(date +%s); el() { echo "[run +$(( $(date +%s) - T0 ))s] $*"; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; python3 -V
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())"
  nvcc --version 2>/dev/null | tail -1; nproc; echo "plugin commit $(cat "$G/plugin/COMMIT")"; } 2>&1 | tee "$L/env.txt"
el install
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$G"/whl/*.whl "$G"/plugin/*.whl > /tmp/install.log 2>&1 \
  || { echo "install failed"; tail -5 /tmp/install.log; }
mkdir -p /tmp/sk && python3 -c "import zipfile,sys; zipfile.ZipFile(sys.argv[1]).extractall('/tmp/sk')" "$G"/sk/*.zip
for c in "$G"/cache/*.tgz; do [[ -f $c ]] && tar xzf "$c" -C / && el "restored JIT cache $(basename "$c")"; done
export PATH=/tmp/site/bin:$PATH   # py-spy: drive.py's evidence and SGLang's soft watchdog
RELEASES=${RELEASES:-$(ls "$G"/sg | sed 's/^sglang-//; s/-trimmed.zip$//' | sort -V | tr '\n' ' ')}
for V in $RELEASES; do
  rm -rf /tmp/sg /tmp/gslogs && mkdir -p /tmp/sg /tmp/gslogs
  python3 -c "import zipfile,sys; zipfile.ZipFile(sys.argv[1]).extractall('/tmp/sg')" "$G/sg/sglang-$V-trimmed.zip"
  export PYTHONPATH=/tmp/sg:/tmp/site:/tmp/sk:$HERE/stubs:$ROOT/bench/gpu/stubs SGLANG_RELEASE=$V
  el "sglang $V: $(python3 -c 'import sglang, sglang_dp_mtp_fix as p; print(sglang.__version__, "plugin", p.__version__)' 2>&1 | tail -1)"
  DRIVE_LOGS=/tmp/gslogs timeout "${DRIVE_TIMEOUT_S:-540}" python3 "$HERE/drive.py" ${STAGES:-hang}
  el "drive $V rc=$?"
  for g in $(cat /tmp/gslogs/pgids 2>/dev/null); do kill -KILL -- "-$g" 2>/dev/null && echo "killed group $g"; done
  tar czf "$L/logs-$V.tgz" -C /tmp gslogs
done
nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
tar czf /tmp/jit-cache.tgz -C / "${HOME#/}/.cache/tvm-ffi" "${HOME#/}/.triton/cache" 2>/dev/null
(( $(stat -c %s /tmp/jit-cache.tgz) < 16000000 )) && cp /tmp/jit-cache.tgz "$L/"
el end; ls -la "$L"
