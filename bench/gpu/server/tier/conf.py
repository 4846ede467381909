"""Settings of one driver run, read once from the environment, and the summary every stage writes into."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/gpu/server
CARRY = os.environ.get("G", os.path.join(HERE, "..", "..", "..", ".gpuserver"))
OUT = os.environ.get("OUT") or "/tmp/out"
LOGS = os.environ.get("DRIVE_LOGS", "/tmp/gslogs")
RELEASE = os.environ.get("SGLANG_RELEASE", "unknown")
CPU = os.environ.get("DRIVE_CPU") == "1"
T0 = time.monotonic()
BUDGET = float(os.environ.get("DRIVE_BUDGET_S", "480"))
# a cold machine (no JIT cache) compiles kernels during the graph captures: 0.5.20's DP4 was not ready at 280 s
# (its target-verify capture alone took 122 s) and ready in 181 s with the cache (2026-12-07)
READY_S = float(os.environ.get("DRIVE_READY_S", "420"))
MODEL = os.environ.get("DRIVE_MODEL", os.path.join(CARRY, "model"))


def _vocab(model: str) -> int:
    try:
        with open(os.path.join(model, "config.json")) as f:
            return int(json.load(f)["vocab_size"])
    except (OSError, ValueError, KeyError):
        return 400


VOCAB = _vocab(MODEL)  # prompts' token ids stay below it (both tiers' models have 128)
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
SUMMARY: dict[str, Any] = {"release": RELEASE, "t_start": time.time()}
# the driver's own plugin settings never leak into a server: each arm sets its own
BASE_ENV_DROP = ("SGLANG_DP_MTP_FIX", "SGLANG_PLUGINS")

# The model tier (the carry decides it: fetch.sh TIER): "qwen" (Qwen3-MoE, triton attention, the trigger emulates the
# seeding draft worker) or "dsa" (GlmMoeDsaForCausalLM, DSA attention, MTP IndexShare from the model's own config:
# SGLang makes every PD arrival seedless itself, and the trigger plugin only observes). DSA_KV picks the DSA KV cache
# and backends: bf16 with flashmla_sparse (Hopper's bf16 default, fa3, is not carried: 342 MB) or fp8 with flashmla_kv
# (SGLang's Hopper FP8 default).
TIER = os.environ.get("DRIVE_TIER") or ("dsa" if os.path.isdir(os.path.join(CARRY, "dg")) else "qwen")
DSA_KV = os.environ.get("DSA_KV", "bf16")
# NODES: the DP ranks of a server, one "node" each (its own NCCL_HOSTID) on this one GPU: --tp = --dp = --nnodes.
# PER_RANK: running requests per DP rank; --max-running-requests and the captured decode graph sizes are NODES times
# it, because SGLang divides both by the DP size (the seed ran up to 7 per rank).
NODES = int(os.environ.get("NODES", "2"))
if NODES not in (2, 4, 8):
    sys.exit(f"NODES must be 2, 4 or 8, not {NODES}")
RANKS = tuple(range(NODES))
PER_RANK = int(os.environ.get("PER_RANK", str(16 // NODES if NODES < 8 else 2)))
# --mem-fraction-static: the KV pool is capped by --max-total-tokens; the fraction sets how much of the free memory
# SGLang may claim after the weights, per node (0.25 held for 2 DP4 servers and one DP8 server side by side: 12 GB)
MEM_FRAC = os.environ.get("MEM_FRAC", "0.25")


def release_has_flag(flag: str) -> bool:
    """0.5.15.post1 has no --mm-feature-transport; later releases need it set to cpu here."""
    spec = importlib.util.find_spec("sglang.srt.server_args")
    return spec is not None and spec.origin is not None and flag in open(spec.origin).read()


def attention_flags(tier: str, kv: str = DSA_KV) -> list[str]:
    if CPU:
        return ["--attention-backend", "torch_native"]
    if tier != "dsa":
        return ["--attention-backend", "triton"]
    backend = "flashmla_kv" if kv == "fp8" else "flashmla_sparse"
    return ["--attention-backend", "dsa", "--kv-cache-dtype", "fp8_e4m3" if kv == "fp8" else "bfloat16",
            "--dsa-prefill-backend", backend, "--dsa-decode-backend", backend, "--page-size", "64"]  # fmt: skip


def base_flags() -> list[str]:
    running = str(PER_RANK * NODES)
    if CPU:
        return ["--model-path", MODEL, "--load-format", "dummy", "--host", "127.0.0.1", "--device", "cpu",
                "--disable-cuda-graph", "--max-total-tokens", "4096", "--max-running-requests", running,
                "--decode-log-interval", "1", "--random-seed", "1"]  # fmt: skip
    return [
        "--model-path", MODEL, "--load-format", "dummy", "--host", "127.0.0.1",
        "--sampling-backend", "pytorch", "--moe-runner-backend", "triton",
        "--disable-custom-all-reduce", "--enforce-disable-flashinfer-allreduce-fusion",
        "--mem-fraction-static", MEM_FRAC, "--max-total-tokens", "16384", "--max-running-requests", running,
        "--cuda-graph-max-bs-decode", running, "--disable-prefill-cuda-graph",
        # every decode batch logs its line: the seed's count of decode batches and of target-verify graph on/off
        "--decode-log-interval", "1", "--random-seed", "1",
    ] + (["--mm-feature-transport", "cpu"] if release_has_flag("--mm-feature-transport") else [])  # fmt: skip


MTP = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2", "--speculative-eagle-topk", "1",
       "--speculative-num-draft-tokens", "3"]  # fmt: skip
PD = ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "fake"]
# the hang servers: no PD warm-up (it sends one seedless arrival per DP rank, so the trigger's first request would
# not be the first arrival) and SGLang's soft watchdog, which logs a stuck scheduler (py-spy dump when on PATH)
HANG_FLAGS = ["--skip-server-warmup"] + ([] if CPU else ["--soft-watchdog-timeout", "30"])
HANG_WAIT_S = float(os.environ.get("HANG_WAIT_S", "60"))
# run.sh MPS=1: every server's processes share the GPU through one CUDA MPS daemon, not N time-sliced contexts (a
# collective among 8 ranks: 0.17 ms against 55 ms, bench/gpu/nccl_one_gpu.py). Under MPS, killing a server whose
# kernels still ran took the other servers on the GPU down ("illegal memory access" at their next request, 2026-12-07,
# twice), so no server is killed before the last arm is done (servers.retire), and a stuck arm, whose spinning
# kernels then stay on the GPU, is driven last.
MPS = bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY"))

# The decode arms of stages soak and pd: patched, stock (SGLANG_DP_MTP_FIX=off), and seeded (issue 53): patched with
# SGLANG_DP_MTP_FIX_ARRIVAL_SEED=SEEDED_MODE (default recent: the exact seed where the prompt fits index_topk, the
# stand-in past it, so no arrival stays seedless).
SEEDED_MODE = os.environ.get("SEEDED_MODE", "recent")


def arm_seed_env(arm: str) -> dict[str, str]:
    """The arrival-seed setting of a decode arm."""
    return {"SGLANG_DP_MTP_FIX_ARRIVAL_SEED": SEEDED_MODE} if arm == "seeded" else {}


def say(*parts: object) -> None:
    print(f"[+{time.monotonic() - T0:5.0f}s]", *parts, flush=True)


def left() -> float:
    return BUDGET - (time.monotonic() - T0)


def refuse_without_multicast_off() -> None:
    """NVLink multicast can take a shared host's GPUs out of service: never start without it switched off."""
    wrong = {k: os.environ.get(k) for k, v in MULTICAST_OFF.items() if os.environ.get(k) != v}
    if wrong and not CPU:
        sys.exit(f"refusing to start: multicast variables not set as required {MULTICAST_OFF}: {wrong}")


def refuse_stuck_arm_before_another(order: list[str]) -> None:
    """Under MPS a stock arm (stuck, its kernels spinning until the end) must come after every other arm."""
    if MPS and "stock" in order[:-1]:
        sys.exit(f"under MPS the stock arm must be driven last (stuck, it stays on the GPU until the end): {order}")


def write_summary() -> None:
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, f"summary-{RELEASE}.json"), "w") as f:
        json.dump(SUMMARY, f, indent=1, default=str)
