"""dsa_trtllm_trim — TRT-LLM DSA decode attends only the real rows that the pre-planned metadata describes.

Why:      Once DP ranks agree to run a step eagerly, the eager DP MLP-sync padding (MAX_LEN) gives an active rank more
          query / top-k rows than the DSA metadata that was planned before padding (``cache_seqlens_int32``,
          ``page_table_1``: one row per real request). ``_forward_trtllm`` then fails the page-table transform's
          row assertion (non-fused top-k) or hands the TRT-LLM kernel a query batch larger than its ``seq_lens``
          (fused top-k, the PD-decode branch from 0.5.18): an assertion, or an out-of-bounds read on the GPU, on
          one rank while its peers wait in the next MLP/EP collective (#32209, fourth failure mode).
How:      An around-wrapper on ``DeepseekSparseAttnBackend._forward_trtllm`` (the body stays SGLang's). For a decode
          call whose query has more rows than the planned metadata it passes the first ``real`` rows of the
          row-aligned inputs and, for the call only, of ``forward_batch.positions`` (FP8 RoPE) and ``out_cache_loc``
          (KV save), then zero-pads the output back to the physical DP row count before the MLP/EP collectives:
          padding rows are never attended nor written to the KV cache, and come out exactly zero. The PR trims the
          same data (``q_all``/top-k before the page-table transform); trimming the inputs needs no copy of the body.
          Unpadded calls (CUDA graphs) are the stock call. No host sync: row counts are shapes, slices are views.
          Applied when ``dsa_backend`` is imported (``deferred_until_import``).
Releases: applied on 0.5.15.post1 – 0.5.20 (three bodies of ``_forward_trtllm``; both top-k branches). Superseded
          from 0.5.21 (``_trim_trtllm_decode_dp_padding`` / ``_restore_trtllm_decode_dp_padding`` upstream).
Removable when: the oldest supported release is 0.5.21 (upstream #32196 as merged), or #32209 lands.
"""

from __future__ import annotations

import functools
from typing import Any

from sglang_dp_mtp_fix.config import Config
from sglang_dp_mtp_fix.core import Patch, Resolved, StandDown, Status, Target
from sglang_dp_mtp_fix.patches._detect import dp_draft_vote_verdict, module_defines

DSA_BACKEND = "sglang.srt.layers.attention.dsa_backend"
FORWARD_TRTLLM = Target(DSA_BACKEND, "DeepseekSparseAttnBackend._forward_trtllm")
UPSTREAM_TRIM = "_trim_trtllm_decode_dp_padding"


def planned_decode_rows(metadata: Any) -> int | None:
    """Rows the decode metadata was planned for (one per real request); None when there is no such metadata."""
    cache_seqlens = getattr(metadata, "cache_seqlens_int32", None)
    return None if cache_seqlens is None else int(cache_seqlens.shape[0])


def leading_rows(tensor: Any, rows: int) -> Any:
    """The first ``rows`` rows of a row-aligned tensor (a view); anything else unchanged."""
    if tensor is None or getattr(tensor, "ndim", 0) == 0 or tensor.shape[0] <= rows:
        return tensor
    return tensor[:rows]


def zero_pad_rows(out: Any, physical_rows: int) -> Any:
    """``out`` with zero rows appended up to ``physical_rows`` (the DP-padded shape the next collectives expect)."""
    missing = physical_rows - out.shape[0]
    if missing <= 0:
        return out
    import torch

    return torch.cat([out, out.new_zeros((missing, *out.shape[1:]))], dim=0)


def make_forward_trtllm(original: Any) -> Any:
    @functools.wraps(original)
    def _forward_trtllm(
        self: Any,
        q: Any,
        k: Any,
        v: Any,
        layer: Any,
        forward_batch: Any,
        seq_lens: Any,
        save_kv_cache: bool = True,
        q_rope: Any = None,
        k_rope: Any = None,
        topk_indices: Any = None,
        cos_sin_cache: Any = None,
        is_neox: Any = False,
        llama_4_scaling: Any = None,
        is_prefill: bool = False,
    ) -> Any:
        physical = q.shape[0]
        real = None if is_prefill else planned_decode_rows(getattr(self, "forward_metadata", None))
        if real is None or real >= physical:
            # No DP padding (graph capture/replay, non-DP, prefill): exactly the stock call.
            return original(
                self,
                q,
                k,
                v,
                layer,
                forward_batch,
                seq_lens,
                save_kv_cache=save_kv_cache,
                q_rope=q_rope,
                k_rope=k_rope,
                topk_indices=topk_indices,
                cos_sin_cache=cos_sin_cache,
                is_neox=is_neox,
                llama_4_scaling=llama_4_scaling,
                is_prefill=is_prefill,
            )
        positions, out_cache_loc = forward_batch.positions, forward_batch.out_cache_loc
        forward_batch.positions = leading_rows(positions, real)
        forward_batch.out_cache_loc = leading_rows(out_cache_loc, real)
        try:
            out = original(
                self,
                leading_rows(q, real),
                leading_rows(k, real),
                leading_rows(v, real),
                layer,
                forward_batch,
                leading_rows(seq_lens, real),
                save_kv_cache=save_kv_cache,
                q_rope=leading_rows(q_rope, real),
                k_rope=leading_rows(k_rope, real),
                topk_indices=leading_rows(topk_indices, real),
                cos_sin_cache=cos_sin_cache,
                is_neox=is_neox,
                llama_4_scaling=llama_4_scaling,
                is_prefill=is_prefill,
            )
        finally:
            forward_batch.positions, forward_batch.out_cache_loc = positions, out_cache_loc
        return zero_pad_rows(out, physical)

    return _forward_trtllm


class DsaTrtllmTrim(Patch):
    id = "dsa_trtllm_trim"
    targets = (FORWARD_TRTLLM,)
    # Checked and applied when SGLang imports dsa_backend (see dsa_idle_index); "not-loaded" until then.
    deferred_until_import = DSA_BACKEND

    def classify(self) -> None:
        if module_defines(DSA_BACKEND, UPSTREAM_TRIM):
            raise StandDown(
                Status.SUPERSEDED,
                f"SGLang already trims TRT-LLM DSA decode to the planned batch ({DSA_BACKEND}.{UPSTREAM_TRIM}, "
                "upstream 0.5.21+)",
            )
        verdict = dp_draft_vote_verdict()
        if verdict is not None and verdict[0] is Status.NOT_AFFECTED:
            raise StandDown(Status.NOT_AFFECTED, verdict[1])

    def replacements(self, resolved: dict[Target, Resolved], config: Config) -> dict[Target, Any]:
        return {FORWARD_TRTLLM: make_forward_trtllm(resolved[FORWARD_TRTLLM].raw)}
