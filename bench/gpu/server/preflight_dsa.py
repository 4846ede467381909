#!/usr/bin/env python3
"""DSA tier preflight (on demand; never CI; NOT product code): the compiled kernels SGLang's DSA decode path calls on
sm90, with the tiny model's shapes (model-dsa/config.json), each against a torch reference, before any server starts.
A missing library, a failed JIT compile or a wrong result then shows here in seconds, not inside a scheduler log.

  paged_logits  deep_gemm.get_paged_mqa_logits_metadata + fp8_paged_mqa_logits, as the indexer's _get_topk_paged
                calls them on sm90: 32 index heads of 128 + a 4-byte fp32 scale per token in the index-K page layout,
                page 64, next_n 1, (N, 1) context lengths. Reference: sum_h w[h] * relu(q[h] . k * scale).
  topk          sgl_kernel.fast_topk_v2 (top-k 2048, the draft's unfused top-k under IndexShare) on those logits.
  sparse_mla    sgl_kernel.flash_mla.flash_mla_sparse_fwd as _forward_flashmla_sparse calls it: 16 heads padded to
                64, d_qk 576, d_v 512, 2048 indices per row padded with -1, topk_length. Reference: softmax attention
                over the selected rows.
  sglang        SGLang imports the DSA backend and the indexer with the real deep_gemm, and the GLM router has no
                flashinfer fused_topk_deepseek (the stand-in refuses flashinfer.fused_moe).
One JSON line per check; exit 1 when any check fails or any result is off its reference.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

DEV, PAGE, HEADS, DIM, TOPK = "cuda", 64, 32, 128, 2048
CONTEXT = [1, 63, 64, 65, 300]
TOLERANCE = 2e-2
state: dict[str, Any] = {}
failed: list[str] = []


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-6))


def paged_logits() -> dict[str, Any]:
    import deep_gemm

    torch.manual_seed(0)
    pages = 8
    k = torch.randn(pages * PAGE, DIM, device=DEV)
    scale = k.abs().amax(1).clamp(min=1e-4) / 448.0
    k8 = (k / scale[:, None]).to(torch.float8_e4m3fn)
    raw = torch.zeros(pages, PAGE * (DIM + 4), dtype=torch.uint8, device=DEV)  # per page: fp8 rows, then fp32 scales
    raw[:, : PAGE * DIM] = k8.view(torch.uint8).reshape(pages, -1)
    raw[:, PAGE * DIM :] = scale.view(torch.uint8).reshape(pages, -1)
    q = torch.randn(len(CONTEXT), HEADS, DIM, device=DEV).clamp(-4, 4).to(torch.float8_e4m3fn)
    w = torch.randn(len(CONTEXT), HEADS, device=DEV)
    lens = torch.tensor(CONTEXT, dtype=torch.int32, device=DEV).view(-1, 1)
    width = -(-max(CONTEXT) // PAGE)
    table = torch.stack([torch.randperm(pages, device=DEV)[:width] for _ in CONTEXT]).to(torch.int32)
    schedule = deep_gemm.get_paged_mqa_logits_metadata(lens, PAGE, deep_gemm.get_num_sms())
    logits = deep_gemm.fp8_paged_mqa_logits(
        q.unsqueeze(1), raw.view(pages, PAGE, 1, DIM + 4), w, lens, table, schedule, width * PAGE, clean_logits=False
    )
    kf = k8.float() * scale[:, None]
    errs = []
    for row, n in enumerate(CONTEXT):
        pos = torch.arange(n, device=DEV)
        keys = kf[table[row, pos // PAGE].long() * PAGE + pos % PAGE]
        ref = (torch.relu(q[row].float() @ keys.T) * w[row][:, None]).sum(0)
        errs.append(rel_err(logits[row, :n], ref))
    state["logits"], state["lens"] = logits, lens.view(-1)
    return {"deep_gemm": getattr(deep_gemm, "__version__", "?"), "rel_err": max(errs)}


def topk() -> dict[str, Any]:
    from sgl_kernel import fast_topk_v2

    idx = fast_topk_v2(state["logits"].contiguous(), state["lens"], TOPK)
    valid = (idx >= 0).sum(1).tolist()
    # every position of a short context is selected; the reference is "all of them, and only them"
    return {"valid_per_row": valid, "rel_err": 0.0 if valid == [min(n, TOPK) for n in CONTEXT] else 1.0}


def sparse_mla() -> dict[str, Any]:
    from sgl_kernel.flash_mla import flash_mla_sparse_fwd

    torch.manual_seed(1)
    rows, cache, heads, padded, d_qk, d_v = 5, 500, 16, 64, 576, 512
    scale = 256**-0.5  # qk_nope 192 + rope 64
    q = torch.zeros(rows, padded, d_qk, dtype=torch.bfloat16, device=DEV)
    q[:, :heads] = torch.randn(rows, heads, d_qk, device=DEV).to(torch.bfloat16)
    kv = torch.randn(cache, 1, d_qk, device=DEV).to(torch.bfloat16)
    picked = [1, 2, 64, 65, 400]
    indices = torch.full((rows, 1, TOPK), -1, dtype=torch.int32, device=DEV)
    for r, n in enumerate(picked):
        indices[r, 0, :n] = torch.randperm(cache, device=DEV)[:n].to(torch.int32)
    lengths = torch.tensor(picked, dtype=torch.int32, device=DEV)
    out = flash_mla_sparse_fwd(q=q, kv=kv, indices=indices, sm_scale=scale, d_v=d_v, topk_length=lengths)[0]
    errs = []
    for r, n in enumerate(picked):
        keys = kv[indices[r, 0, :n].long(), 0].float()
        ref = torch.softmax(q[r, :heads].float() @ keys.T * scale, -1) @ keys[:, :d_v]
        errs.append(rel_err(out[r, :heads], ref))
    return {"rel_err": max(errs)}


def sglang_side() -> dict[str, Any]:
    import sglang
    from sglang.srt.layers.attention import dsa_backend  # noqa: F401
    from sglang.srt.layers.attention.dsa import dsa_indexer
    from sglang.srt.layers.moe import topk as moe_topk

    router_stub = moe_topk.fused_topk_deepseek is not None if hasattr(moe_topk, "fused_topk_deepseek") else False
    ok = type(dsa_indexer.deep_gemm).__name__ == "module" and not router_stub
    return {"sglang": sglang.__version__, "rel_err": 0.0 if ok else 1.0, "router_binds_stand_in": router_stub}


def run(name: str, check: Callable[[], dict[str, Any]]) -> None:
    t = time.monotonic()
    try:
        detail = check()
        torch.cuda.synchronize()
        ok = detail["rel_err"] <= TOLERANCE
        line: dict[str, Any] = {"check": name, "ok": ok, **detail}
    except Exception as exc:  # noqa: BLE001 - every check reports, the next one still runs
        ok, line = False, {"check": name, "ok": False, "error": repr(exc)[:1500], "tb": traceback.format_exc()[-2500:]}
    line["s"] = round(time.monotonic() - t, 1)
    print(json.dumps(line, default=str), flush=True)
    if not ok:
        failed.append(name)


def main() -> int:
    cap = torch.cuda.get_device_capability()
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "capability": cap,
        "CUDA_HOME": os.environ.get("CUDA_HOME"),
    }
    print(json.dumps({"check": "env", "device": torch.cuda.get_device_name(), **env}), flush=True)
    run("paged_logits", paged_logits)
    if "logits" in state:
        run("topk", topk)
    run("sparse_mla", sparse_mla)
    run("sglang", sglang_side)
    print(json.dumps({"check": "summary", "ok": not failed, "failed": failed}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
