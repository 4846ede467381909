"""dsa_decode_trim — every non-TRT-LLM DSA decode backend attends only the real rows the planned metadata describes.

Why:      The eager DP padding that ``dsa_trtllm_trim`` trims for TRT-LLM breaks every other ``--dsa-decode-backend``
          too (FlashMLA sparse/KV, FA3, FlashInfer sparse MLA, TileLang, Triton, aiter): ``forward_decode``'s shared
          prologue asserts ``page_table.shape[0] == topk_indices.shape[0]`` with non-fused top-k, and with fused
          top-k FlashMLA-KV, FA3 and FlashInfer get a query batch larger than their planned ``seq_lens`` /
          ``cu_seqlens_q`` (a kernel shape check). A crash on one rank while its peers wait in the next collective.
How:      An around-wrapper on ``DeepseekSparseAttnBackend.forward_decode``, the first seam before the failing
          prologue (its body and every ``_forward_*`` stay SGLang's). When the query has more rows than the planned
          metadata (``cache_seqlens_int32``) it passes the first ``real`` rows of ``q``, ``k``, ``v``, ``q_rope``,
          ``k_rope``, ``topk_indices`` and, for the call only, of ``forward_batch.out_cache_loc`` (KV save) and
          ``batch_size`` (aiter), and hands the body decode metadata cut to those rows (``rows_only_metadata``), then
          zero-pads the output to the physical rows. TRT-LLM routes (``dsa_trtllm_trim``'s seam), HiSparse (its
          coordinator reads padded request rows) and unpadded calls are the stock call. No host sync: row counts
          are shapes, slices are views. Applied when ``dsa_backend`` is imported (``deferred_until_import``).
Releases: applied on 0.5.15.post1 – 0.5.20 (three ``forward_decode`` bodies: 0.5.15.post1/0.5.16, 0.5.17–0.5.19,
          0.5.20). Not trimmed upstream in 0.5.21–0.5.23 either (only ``_forward_trtllm`` is); the plugin stands down
          there.
Removable when: the oldest supported release trims padded decode rows for every DSA decode backend upstream.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from sglang_dp_mtp_fix.config import Config
from sglang_dp_mtp_fix.core import Kind, Patch, Resolved, StandDown, Status, Target
from sglang_dp_mtp_fix.patches._detect import dp_draft_vote_verdict
from sglang_dp_mtp_fix.patches.dsa_trtllm_trim import DSA_BACKEND, leading_rows, planned_decode_rows, zero_pad_rows
from sglang_dp_mtp_fix.sglang_versions import sglang_version

FORWARD_DECODE = Target(DSA_BACKEND, "DeepseekSparseAttnBackend.forward_decode")
# 0.5.20: decides per call whether forward_decode routes to _forward_trtllm (kpool tail); the wrapper asks it too.
RESOLVE_KPOOL = Target(
    "sglang.srt.layers.attention.dsa.dsa_backend_kpool",
    "DeepseekSparseAttnBackendKPoolMixin._resolve_kpool_tail_backend",
    Kind.CHECK,
    required=False,
)
# Premise of rows_only_metadata: FlashMLA-KV's split plan for given per-token lengths (called, never changed).
COMPUTE_FLASHMLA_PLAN = Target(DSA_BACKEND, "DeepseekSparseAttnBackend._compute_flashmla_metadata", Kind.CHECK)
TRTLLM = "trtllm"
# DSA's per-token decode lengths, and their prefix sums, which SGLang pads to the DP-padded row count with zero lengths
# at the end (dsa/utils.py pad_dsa_cache_seqlens) while cache_seqlens_int32 keeps one row per real request.
PER_TOKEN_LENGTHS = "dsa_cache_seqlens_int32"
PREFIX_SUMS = ("dsa_cu_seqlens_q", "dsa_cu_seqlens_k")


def rows_only_metadata(backend: Any, metadata: Any, real: int) -> Any:
    """``metadata`` as planned for the first ``real`` rows only, for the trimmed call; ``metadata`` itself when its
    DSA lengths are not padded.

    The padded rows have zero length and sit at the end, so the first ``real`` lengths and ``real + 1`` prefix sums are
    the real rows' plan. FlashMLA-KV's split plan (``flashmla_metadata``: tile schedule and ``num_splits``, one per row
    + 1) covers every padded row, so it is planned again by SGLang's own ``_compute_flashmla_metadata`` for the real
    lengths: its kernel checks ``num_splits`` against the query rows. A shallow copy: the original is not touched.
    """
    lengths = getattr(metadata, PER_TOKEN_LENGTHS, None)
    if lengths is None or lengths.shape[0] <= real:
        return metadata
    real_lengths = leading_rows(lengths, real)
    cut = copy.copy(metadata)
    object.__setattr__(cut, PER_TOKEN_LENGTHS, real_lengths)  # the metadata dataclass is frozen in some releases
    for name in PREFIX_SUMS:
        if hasattr(metadata, name):
            object.__setattr__(cut, name, leading_rows(getattr(metadata, name), real + 1))
    if getattr(metadata, "flashmla_metadata", None) is not None:
        plan = backend._compute_flashmla_metadata(cache_seqlens=real_lengths, seq_len_q=1)
        object.__setattr__(cut, "flashmla_metadata", plan)
    return cut


def decode_impl(backend: Any, topk_indices: Any) -> str:
    """The ``_forward_*`` SGLang's ``forward_decode`` will pick for this call (as its first lines decide it)."""
    impl = str(getattr(backend, "dsa_decode_impl", ""))
    resolve = getattr(backend, "_resolve_kpool_tail_backend", None)
    return str(resolve(topk_indices, impl)) if resolve is not None else impl


def make_forward_decode(original: Any) -> Any:
    @functools.wraps(original)
    def forward_decode(
        self: Any,
        q: Any,
        k: Any,
        v: Any,
        layer: Any,
        forward_batch: Any,
        save_kv_cache: bool = True,
        q_rope: Any = None,
        k_rope: Any = None,
        topk_indices: Any = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        physical = q.shape[0]
        real = planned_decode_rows(getattr(self, "forward_metadata", None))
        if (
            real is None
            or not 0 < real < physical
            or getattr(self, "hisparse_coordinator", None) is not None
            or decode_impl(self, topk_indices) == TRTLLM
        ):
            # The stock call: unpadded (graph capture/replay, non-DP), TRT-LLM (dsa_trtllm_trim), HiSparse, and zero
            # real rows (idle ranks never get here: AttentionBackend.forward returns early for IDLE).
            return original(
                self, q, k, v, layer, forward_batch, save_kv_cache, q_rope, k_rope, topk_indices, *args, **kwargs
            )
        out_cache_loc, batch_size = forward_batch.out_cache_loc, forward_batch.batch_size
        metadata = self.forward_metadata
        forward_batch.out_cache_loc = leading_rows(out_cache_loc, real)
        if isinstance(batch_size, int) and batch_size > real:
            forward_batch.batch_size = real
        try:
            self.forward_metadata = rows_only_metadata(self, metadata, real)
            out = original(
                self,
                leading_rows(q, real),
                leading_rows(k, real),
                leading_rows(v, real),
                layer,
                forward_batch,
                save_kv_cache,
                leading_rows(q_rope, real),
                leading_rows(k_rope, real),
                leading_rows(topk_indices, real),
                *args,
                **kwargs,
            )
        finally:
            forward_batch.out_cache_loc, forward_batch.batch_size = out_cache_loc, batch_size
            self.forward_metadata = metadata
        return zero_pad_rows(out, physical)

    return forward_decode


class DsaDecodeTrim(Patch):
    id = "dsa_decode_trim"
    targets = (FORWARD_DECODE, RESOLVE_KPOOL, COMPUTE_FLASHMLA_PLAN)
    # Checked and applied when SGLang imports dsa_backend (see dsa_trtllm_trim); "not-loaded" until then.
    deferred_until_import = DSA_BACKEND

    def classify(self) -> None:
        verdict = dp_draft_vote_verdict()
        if verdict is None:
            return
        status, reason = verdict
        if status is Status.SUPERSEDED:
            # Upstream's vote makes the eager round rank-consistent, but trims only _forward_trtllm: say so.
            reason = (
                f"SGLang {sglang_version()} carries upstream's rank-consistent draft vote (0.5.21+), so the plugin "
                "leaves it stock; upstream trims padded DSA decode rows for TRT-LLM only (docs/dsa-backends.md)"
            )
        raise StandDown(status, reason)

    def replacements(self, resolved: dict[Target, Resolved], config: Config) -> dict[Target, Any]:
        return {FORWARD_DECODE: make_forward_decode(resolved[FORWARD_DECODE].raw)}
