"""GPU check (1 GPU): the DP-padding patches' tensor operations add no host synchronisation and replay correctly
inside a captured CUDA graph. Not part of CI. Run by bench/gpu/run.sh after the DP-vote check, per release.

Each check runs three ways on CUDA, with the plugin applied through its real entry point (``plugin.register()``):
  1. eager, under ``torch.cuda.set_sync_debug_mode("error")`` (any device->host sync raises);
  2. captured in a ``torch.cuda.CUDAGraph`` (capture also rejects syncs), then replayed after new data is copied into
     the static inputs; the replayed output must equal an eager computation on the new data;
  3. against the unpadded computation: real rows bit-identical, padding rows exactly zero / all-invalid.
The checks deliberately use DP-padded shapes, so the patches' slicing and padding run (in production graph mode has
no padding and the patches are no-ops; this shows they would also be safe if captured).

dsa_trtllm_trim: SGLang's real ``DeepseekSparseAttnBackend._forward_trtllm`` of the installed release runs on CUDA,
including the real Triton page-table transform kernel. STAND-INs: the TRT-LLM sparse-MLA decode kernel (trtllm-gen
kernels need Blackwell, sm100; this is an H200, sm90) is a sync-free pure-torch reference sparse attention; the
decode metadata is a namespace with the three fields the body reads (its planner needs deep_gemm); the KV pool is a
CUDA buffer (save_kv_cache=False: the MLA write kernel is not the subject here).
Output: one JSON line per check (``RESULT {...}``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import traceback
import types

import torch

HEADS, KV_LORA, ROPE, TOPK, CONTEXT = 4, 64, 16, 2048, 32
VERSION = os.environ.get("SGLANG_VERSION_LABEL", "?")


class no_host_sync:
    """Raise on any device->host synchronisation inside the block (CUDA only)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __enter__(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")


def capture(step):
    """Warm ``step`` up on a side stream (Triton compile, allocator), then capture it in a CUDA graph.

    Returns the graph and the outputs of the captured call (static tensors that every replay rewrites)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    return graph, static


def report(check: str, **fields) -> None:
    print("RESULT " + json.dumps({"sglang": VERSION, "check": check, **fields}), flush=True)


def sync_free_sparse_mla_decode(*, query, kv_cache, block_tables, seq_lens, kv_lora_rank, bmm1_scale, **_unused):
    """STAND-IN for flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla (page size 1, q_len 1), sync-free."""
    batch = query.shape[0]
    assert seq_lens.shape[0] == batch and block_tables.shape[0] == batch, "kernel batch contract"
    kv = kv_cache.reshape(-1, kv_cache.shape[-1]).float()
    slots = block_tables[:, 0, :].long()
    valid = slots >= 0
    keys = kv[slots.clamp(min=0)]  # (B, K, D)
    scores = torch.einsum("bhd,bkd->bhk", query[:, 0].float(), keys) * bmm1_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    out = torch.einsum("bhk,bkd->bhd", torch.softmax(scores, dim=-1), keys[..., :kv_lora_rank])
    return out.unsqueeze(1).to(query.dtype)


def install_kernel_standins() -> None:
    import flashinfer  # the carried flashinfer stand-in package (run.sh); set only what the body calls

    decode = __import__("flashinfer.decode", fromlist=["x"])
    decode.trtllm_batch_decode_with_kv_cache_mla = sync_free_sparse_mla_decode
    utils = __import__("flashinfer.utils", fromlist=["x"])
    utils.get_device_sm_count = lambda device: 132
    utils.get_trtllm_gen_multi_ctas_kv_counter_bytes = lambda *a: 0
    flashinfer.decode, flashinfer.utils = decode, utils


def build_trtllm_case(physical: int, real: int, device: torch.device):
    from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend

    gen = torch.Generator(device="cpu").manual_seed(3)
    backend = object.__new__(DeepseekSparseAttnBackend)
    kv_buffer = torch.randn((real * CONTEXT + 1, KV_LORA + ROPE), generator=gen).to(device, torch.bfloat16)
    page_table = torch.arange(1, real * CONTEXT + 1, dtype=torch.int32).view(real, CONTEXT).to(device)
    backend.forward_metadata = types.SimpleNamespace(
        page_table_1=page_table,
        cache_seqlens_int32=torch.full((real,), CONTEXT, dtype=torch.int32, device=device),
        max_seq_len_k=CONTEXT,
    )
    backend.__dict__.update(
        qk_rope_head_dim=ROPE, qk_nope_head_dim=KV_LORA, kv_lora_rank=KV_LORA, kv_cache_dim=KV_LORA + ROPE,
        kv_cache_dtype=torch.bfloat16, real_page_size=1, use_fused_topk=False, num_q_heads=HEADS, device=device,
        workspace_buffer=torch.empty(0, device=device), dsa_index_topk=TOPK, dsa_topk_backend=None,
        token_to_kv_pool=types.SimpleNamespace(get_key_buffer=lambda layer_id: kv_buffer),
        _multi_ctas_kv_counter_buffer=torch.empty(0, dtype=torch.uint8, device=device),
    )  # fmt: skip
    q = torch.randn((physical, HEADS, KV_LORA), generator=gen).to(device, torch.bfloat16)
    q_rope = torch.randn((physical, HEADS, ROPE), generator=gen).to(device, torch.bfloat16)
    topk = torch.full((physical, TOPK), -1, dtype=torch.int32)
    topk[:, :8] = torch.stack([torch.randperm(CONTEXT, generator=gen)[:8] for _ in range(physical)]).to(torch.int32)
    forward_batch = types.SimpleNamespace(
        positions=torch.arange(physical, device=device),
        out_cache_loc=torch.zeros(physical, dtype=torch.int64, device=device),
        forward_mode=None, encoder_out_cache_loc=None, attn_cp_metadata=None,
    )  # fmt: skip
    layer = types.SimpleNamespace(
        layer_id=0, tp_q_head_num=HEADS, v_head_dim=KV_LORA, head_dim=KV_LORA + ROPE, scaling=0.125,
        is_cross_attention=False, k_scale_float=None,
    )  # fmt: skip
    inputs = dict(q=q, q_rope=q_rope, topk=topk.to(device), forward_batch=forward_batch, layer=layer)
    return backend, inputs


def call_trtllm(backend, inputs, rows: int | None = None):
    cut = (lambda t: t[:rows]) if rows is not None else (lambda t: t)
    forward_batch = inputs["forward_batch"]
    if rows is not None:
        forward_batch = types.SimpleNamespace(**vars(forward_batch))
        forward_batch.positions, forward_batch.out_cache_loc = (
            cut(forward_batch.positions),
            cut(forward_batch.out_cache_loc),
        )
    return backend._forward_trtllm(
        cut(inputs["q"]), None, None, inputs["layer"], forward_batch, backend.forward_metadata.cache_seqlens_int32,
        save_kv_cache=False, q_rope=cut(inputs["q_rope"]), k_rope=None, topk_indices=cut(inputs["topk"]),
    )  # fmt: skip


def check_trtllm_trim(device: torch.device, physical: int = 8, real: int = 5) -> None:
    backend, inputs = build_trtllm_case(physical, real, device)
    with no_host_sync(device):
        out = call_trtllm(backend, inputs)
        reference = call_trtllm(backend, inputs, rows=real)
    eager_ok = (
        tuple(out.shape[:1]) == (physical,)
        and torch.equal(out[:real], reference)
        and int(torch.count_nonzero(out[real:])) == 0
    )
    if device.type != "cuda":  # CPU smoke run of this script: no sync mode, no graphs
        report("dsa_trtllm_trim", eager_correct=bool(eager_ok), smoke="cpu")
        return
    # capture with padding, replay on new query data, compare with an eager run on the same data
    graph, static_out = capture(lambda: call_trtllm(backend, inputs))
    inputs["q"].copy_(torch.randn_like(inputs["q"]))
    graph.replay()
    torch.cuda.synchronize()
    expected = call_trtllm(backend, inputs)
    replay_ok = torch.equal(static_out, expected) and int(torch.count_nonzero(static_out[real:])) == 0
    report(
        "dsa_trtllm_trim", physical_rows=physical, real_rows=real, host_syncs=0, eager_correct=bool(eager_ok),
        graph_replay_correct=bool(replay_ok), body="real _forward_trtllm + real Triton transform kernel",
    )  # fmt: skip


def check_draft_local_rows(device: torch.device, physical: int = 8, real: int = 3, vocab: int = 32000) -> None:
    """The slice to the local draft rows feeding SGLang's real ``draft_topk1_postprocess`` Triton kernel."""
    from sglang.kernels.ops.speculative.topk1 import draft_topk1_postprocess

    from sglang_dp_mtp_fix.patches.draft_local_rows import slice_draft_output_to_local_tokens

    gen = torch.Generator(device="cpu").manual_seed(5)
    logits = torch.randn((physical, vocab), generator=gen).to(device)
    hidden = torch.randn((physical, 16), generator=gen).to(device)
    positions = torch.arange(100, 100 + physical, device=device)

    def step():
        local_logits, local_hidden, local_positions = slice_draft_output_to_local_tokens(
            logits, hidden, positions, real
        )
        topk_p, topk_index = draft_topk1_postprocess(local_logits, local_positions)
        return topk_index, local_hidden

    with no_host_sync(device):
        topk_index, local_hidden = step()
    eager_ok = (
        topk_index.shape[0] == real
        and torch.equal(topk_index[:, 0], logits[:real].argmax(dim=-1))
        and local_hidden.data_ptr() == hidden.data_ptr()  # a view, no copy
        and positions[:real].tolist() == list(range(101, 101 + real))  # advanced in place through the view
        and positions[real:].tolist() == list(range(100 + real, 100 + physical))  # padding rows untouched
    )
    graph, (static_index, _) = capture(step)
    logits.copy_(torch.randn_like(logits))
    graph.replay()
    torch.cuda.synchronize()
    replay_ok = torch.equal(static_index[:, 0], logits[:real].argmax(dim=-1))
    report(
        "draft_local_rows", physical_rows=physical, real_rows=real, host_syncs=0, eager_correct=bool(eager_ok),
        graph_replay_correct=bool(replay_ok), consumer="real draft_topk1_postprocess (Triton)",
    )  # fmt: skip


def check_dsa_idle_index(device: torch.device, physical: int = 8, index_topk: int = 2048) -> None:
    """SGLang's real ``Indexer.forward_cuda`` (patched) on an idle DP rank's padded rows."""
    from sglang.srt.layers.attention.dsa import dsa_indexer
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    indexer = object.__new__(dsa_indexer.Indexer)  # built without its weight-allocating __init__
    indexer.index_topk = index_topk
    forward_batch = types.SimpleNamespace(forward_mode=ForwardMode.IDLE)
    x = torch.randn((physical, 64), device=device)

    def idle_index():
        return dsa_indexer.Indexer.forward_cuda(indexer, x, None, None, forward_batch, 0)

    with no_host_sync(device):
        out = idle_index()
    eager_ok = tuple(out.shape) == (physical, index_topk) and out.dtype == torch.int32 and bool((out == -1).all())
    graph, static_out = capture(idle_index)
    static_out.fill_(7)  # replay must write the all-invalid rows again
    graph.replay()
    torch.cuda.synchronize()
    replay_ok = tuple(static_out.shape) == (physical, index_topk) and bool((static_out == -1).all())
    report(
        "dsa_idle_index", physical_rows=physical, host_syncs=0, eager_correct=bool(eager_ok),
        graph_replay_correct=bool(replay_ok), body="real Indexer.forward_cuda wrapper + SGLang's helpers",
    )  # fmt: skip


CHECKS: dict = {
    "dsa_trtllm_trim": check_trtllm_trim,
    "draft_local_rows": check_draft_local_rows,
    "dsa_idle_index": check_dsa_idle_index,
}


def main() -> int:
    device = torch.device(os.environ.get("PADDING_OPS_DEVICE", "cuda:0"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    from sglang.srt.server_args import ServerArgs

    from sglang_dp_mtp_fix import plugin
    from sglang_dp_mtp_fix.harness.pool import DUMMY_MODEL
    from sglang_dp_mtp_fix.harness.rank import publish_server_args

    publish_server_args(ServerArgs(model_path=str(DUMMY_MODEL), device=device.type, skip_tokenizer_init=True))
    at_load = {o.id: o.status.value for o in plugin.register()}
    # The DSA patches apply when their modules are imported (a DSA model's load does it): import them the same way.
    import_errors = {}
    for module in ("sglang.srt.layers.attention.dsa_backend", "sglang.srt.layers.attention.dsa.dsa_indexer"):
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - reported: a DSA module that cannot load on this host
            import_errors[module] = f"{type(exc).__name__}: {exc}"[:300]
    statuses = {o.id: o.status.value for o in plugin.get_manager().outcomes or []}
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report("plugin", statuses_at_load=at_load, statuses_after_dsa_import=statuses, dsa_import_errors=import_errors,
           torch=torch.__version__, gpu=gpu)  # fmt: skip
    install_kernel_standins()
    failed = 0
    for name, check in CHECKS.items():
        # draft_local_rows' slice is checked wherever its consumer kernel exists, even where the patch stands down
        has_topk1 = importlib.util.find_spec("sglang.kernels") is not None  # draft_topk1_postprocess: 0.5.16+
        if statuses.get(name) != "applied" and not (name == "draft_local_rows" and has_topk1):
            report(name, skipped=f"patch status {statuses.get(name)}")
            continue
        try:
            check(device)
        except Exception as exc:  # noqa: BLE001 - report and go on to the next check
            failed += 1
            report(name, error=f"{type(exc).__name__}: {exc}", tb=traceback.format_exc()[-1500:])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
