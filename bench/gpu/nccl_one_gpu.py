#!/usr/bin/env python3
"""What one collective costs when N processes share ONE GPU, as the server tier's DP ranks do (on demand; never CI).

The tier runs ``--tp N --dp N --nnodes N`` on one GPU: N "nodes", each with its own ``NCCL_HOSTID``, so NCCL links
them through its socket transport over loopback. A decode round there took 115 ms at DP4 and 847 ms at DP8 against
5.2 ms for ``--tp 1``. This script isolates the collective: N processes, the tier's NCCL environment, a 4 KiB
all-reduce timed one at a time (launch + sync) and in a burst of 50 (as a graph replay issues them), and the host's
busy cores over the window. Variants (VARIANTS, default "plain mps"):
  plain  as the tier runs today: N CUDA contexts on the GPU, which time-slices between them
  mps    the same under CUDA MPS (one daemon for this run, its pipe under /tmp, quit at the end): the N processes'
         kernels share the GPU at once, so a rank's spinning NCCL kernel no longer holds the GPU while its peers wait
  1sock  plain with NCCL_SOCKET_NTHREADS=1 NCCL_NSOCKS_PERTHREAD=1 (fewer socket threads per peer)
Usage: ``python3 bench/gpu/nccl_one_gpu.py [N ...]`` (default 2 4 8); one JSON line per (variant, N) on stdout.
``--pick FILE`` prints 1 where FILE's mps burst took under half of plain's (a call then runs its servers with MPS=1),
else 0.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time

ITERS = int(os.environ.get("ITERS", "200"))
MPS_DIR = "/tmp/nccl-one-gpu-mps"
MPS_ENV = {"CUDA_MPS_PIPE_DIRECTORY": f"{MPS_DIR}/pipe", "CUDA_MPS_LOG_DIRECTORY": f"{MPS_DIR}/log"}
VARIANT_ENV = {"plain": {}, "mps": MPS_ENV, "1sock": {"NCCL_SOCKET_NTHREADS": "1", "NCCL_NSOCKS_PERTHREAD": "1"}}


def worker(rank: int, n: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    x = torch.ones(1024, device="cuda")
    for _ in range(20):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    one = []
    for _ in range(ITERS):
        t = time.perf_counter()
        dist.all_reduce(x)
        torch.cuda.synchronize()
        one.append(time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(50):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    burst = (time.perf_counter() - t) / 50
    if rank == 0:
        q = statistics.quantiles(one, n=10)
        ms = {"one_ms": statistics.median(one), "one_p10_ms": q[0], "one_p90_ms": q[-1], "burst_ms": burst}
        print(json.dumps({k: round(1000 * v, 3) for k, v in ms.items()}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def busy_jiffies() -> tuple[int, int]:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v) - v[3] - v[4], sum(v)  # busy, total (idle and iowait out)


def run(n: int, variant: str, port: int) -> dict[str, object]:
    env = {**os.environ, **VARIANT_ENV[variant], "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1",
           "NCCL_NET": "Socket", "GLOO_SOCKET_IFNAME": "lo"}  # fmt: skip
    b0, t0, w0 = *busy_jiffies(), time.monotonic()
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(n), str(port)],
                              env={**env, "NCCL_HOSTID": f"nccl-one-gpu-node{r}"}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(n)]  # fmt: skip
    try:
        outs = [p.communicate(timeout=max(1.0, 150 - (time.monotonic() - w0))) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outs = [p.communicate() for p in procs]
    b1, t1 = busy_jiffies()
    rec: dict[str, object] = {"variant": variant, "n": n, "wall_s": round(time.monotonic() - w0, 1),
                              "host_busy_cores": round((b1 - b0) / (t1 - t0) * os.cpu_count(), 2),
                              "rc": [p.returncode for p in procs]}  # fmt: skip
    try:
        rec.update(json.loads(outs[0][0].strip().splitlines()[-1]))
    except (IndexError, ValueError):
        rec["error"] = (outs[0][1] or "")[-600:] or f"no result within 150 s (rc {rec['rc']})"
    return rec


def mps(start: bool) -> str:
    ctl = shutil.which("nvidia-cuda-mps-control")
    if ctl is None:
        return "no nvidia-cuda-mps-control"
    env = {**os.environ, **MPS_ENV}
    if start:
        for d in MPS_ENV.values():
            os.makedirs(d, exist_ok=True)
        r = subprocess.run([ctl, "-d"], env=env, capture_output=True, text=True)
    else:
        r = subprocess.run([ctl], input="quit\n", env=env, capture_output=True, text=True)
    return f"rc {r.returncode} {r.stdout.strip()} {r.stderr.strip()}"[:300]


def main() -> None:
    ns = [int(a) for a in sys.argv[1:]] or [2, 4, 8]
    port = 29700
    for variant in os.environ.get("VARIANTS", "plain mps").split():
        if variant == "mps":
            print(json.dumps({"mps_start": mps(True)}), flush=True)
        for n in ns:
            port += 1
            print(json.dumps(run(n, variant, port)), flush=True)
        if variant == "mps":
            log = os.path.join(MPS_ENV["CUDA_MPS_LOG_DIRECTORY"], "control.log")
            clients = open(log).read().count("NEW CLIENT") if os.path.exists(log) else None
            print(json.dumps({"mps_stop": mps(False), "mps_clients_seen": clients}), flush=True)


def pick(path: str) -> int:
    burst: dict[str, float] = {}
    for line in open(path):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and "burst_ms" in rec:
            burst[rec["variant"]] = rec["burst_ms"]
    return int("plain" in burst and "mps" in burst and burst["mps"] < 0.5 * burst["plain"])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--pick"]:
        print(pick(sys.argv[2]))
    elif sys.argv[1:2] == ["--worker"]:
        worker(*(int(a) for a in sys.argv[2:5]))
    else:
        main()
