"""dsa_idle_index — idle DP ranks skip eager sparse index selection and return all-invalid top-k rows.

Why:      Once the DP group agrees to run a step eagerly, idle DP ranks run the eager DSA indexer too. An idle rank
          has no real requests, but MAX_LEN DP padding gives it padded ``seq_lens`` rows, so the stock escape for
          empty batches (``forward_batch.seq_lens.numel() == 0``) is not taken: the rank projects and quantizes the
          padded rows, writes them into the index-K cache and enters paged index selection (``_get_topk_paged``)
          with metadata planned for zero real rows (#32209, fourth failure mode; AMD symptom #34455).
How:      A wrapper around ``Indexer.forward_cuda`` (arguments in, result out): on a CUDA rank running an IDLE batch
          eagerly (``is_eager_idle_rank``) it returns int32 rows of -1 at ``x``'s physical (padded) row count, or
          None when ``return_indices`` is False, through SGLang's own top-k broadcast and capture helpers, as every
          stock top-k return does; anything else is the original call. Graph-safe: it decides from Python flags and
          the forward mode only, takes the shape from ``x.shape``, never short-circuits under capture or breakable
          graphs, and has no logging or context variables for Dynamo to meet. The attention-TP peers of a DP rank
          share its batch, so they decide alike and issue the same one broadcast: no new collective. Applied when
          ``dsa_indexer`` is imported (``deferred_until_import``).
Releases: applied on 0.5.15.post1 – 0.5.20 (four ``forward_cuda`` bodies: 0.5.15.post1, 0.5.16, 0.5.17 – 0.5.19,
          0.5.20). Superseded from 0.5.21 (``dsa_indexer._make_eager_idle_topk_result``). Not affected on
          0.5.14/0.5.15 (no seedless eager fallback, so no rank-consistent eager draft step sends idle ranks here).
Removable when: the oldest supported release has upstream's ``_make_eager_idle_topk_result`` (0.5.21).
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import TYPE_CHECKING, Any

from sglang_dp_mtp_fix.config import Config
from sglang_dp_mtp_fix.core import Kind, Patch, Resolved, StandDown, Status, Target, TargetProblem
from sglang_dp_mtp_fix.patches._detect import dp_draft_vote_verdict, module_defines
from sglang_dp_mtp_fix.sglang_versions import sglang_version

if TYPE_CHECKING:
    import torch

DSA_INDEXER = "sglang.srt.layers.attention.dsa.dsa_indexer"
CAPTURER = "sglang.srt.state_capturer.indexer_topk"
CAPTURE_MODE = "sglang.srt.model_executor.runner_utils.capture_mode"
UPSTREAM_HELPER = "_make_eager_idle_topk_result"

FORWARD_CUDA = Target(DSA_INDEXER, "Indexer.forward_cuda")
# Premises (fingerprinted, never changed): the wrapper calls these by name through the dsa_indexer module, as every
# stock top-k return of forward_cuda does, and relies on what they do.
BROADCAST = Target(DSA_INDEXER, "_broadcast_indexer_topk_from_rank0", Kind.CHECK)
CAPTURE_TOPK = Target(CAPTURER, "maybe_capture_indexer_topk", Kind.CHECK)
IS_CAPTURE_MODE = Target(CAPTURE_MODE, "get_is_capture_mode", Kind.CHECK)

# Module globals of dsa_indexer the wrapper reads at call time, as upstream's early return (0.5.21) does: HIP, XPU and
# NPU ranks (_is_cuda False) stay stock.
MODULE_NAMES = ("_is_cuda", "get_is_capture_mode", "_broadcast_indexer_topk_from_rank0", "maybe_capture_indexer_topk")


def is_eager_idle_rank(indexer_module: Any, forward_batch: Any) -> bool:
    """True on a CUDA rank running an IDLE batch eagerly (not capturing a CUDA graph, not in a breakable graph).

    Same condition and order as upstream's early return: non-idle batches never evaluate the capture flag.
    """
    return bool(
        indexer_module._is_cuda and forward_batch.forward_mode.is_idle() and not indexer_module.get_is_capture_mode()
    )


def all_invalid_topk_rows(x: Any, index_topk: int, return_indices: bool) -> torch.Tensor | None:
    """-1 rows for every physical row of ``x``; None when the caller asked for no indices (k-cache-only calls).

    ``x`` may be the fused FP8 RMSNorm+quant tuple ``(x_fp8, x_scale[, y])``; its first element carries the row count.
    """
    import torch  # here, not at module top: the plugin has no hard dependency on torch

    if not return_indices:
        return None
    rows_of = x[0] if isinstance(x, tuple) else x
    return torch.full((rows_of.shape[0], index_topk), -1, dtype=torch.int32, device=rows_of.device)


class DsaIdleIndex(Patch):
    id = "dsa_idle_index"
    requires = ()
    targets = (FORWARD_CUDA, BROADCAST, CAPTURE_TOPK, IS_CAPTURE_MODE)
    # Checked and applied when SGLang imports the indexer (its model registry does, in a scheduler that loads a
    # model), never imported by the plugin itself; "not-loaded" until then. A module that cannot be imported
    # (CUDA-only dependencies missing) never runs the hook: this process cannot run DSA indexing.
    deferred_until_import = DSA_INDEXER

    def classify(self) -> None:
        # Read without importing: from 0.5.22 plugins also load in processes where DSA modules must not be imported.
        if module_defines(DSA_INDEXER, UPSTREAM_HELPER):
            raise StandDown(
                Status.SUPERSEDED,
                f"SGLang {sglang_version()} already short-circuits eager DSA index selection on idle DP ranks "
                f"(dsa_indexer.{UPSTREAM_HELPER} in Indexer.forward_cuda; upstream 0.5.21+)",
            )
        group = dp_draft_vote_verdict()
        if group is not None and group[0] is Status.NOT_AFFECTED:
            raise StandDown(
                Status.NOT_AFFECTED,
                f"SGLang {sglang_version()} has no seedless eager fallback in EagleDraftWorker.draft (introduced by "
                "#30839, first released in 0.5.15.post1), so no rank-consistent eager draft step sends idle DP ranks "
                "through eager DSA index selection",
            )

    def check_imported(self) -> None:
        module = importlib.import_module(DSA_INDEXER)  # imported by now: this runs from the post-import hook
        missing = [name for name in MODULE_NAMES if not hasattr(module, name)]
        if missing:
            raise TargetProblem(f"{DSA_INDEXER} lacks {', '.join(missing)}")

    def replacements(self, resolved: dict[Target, Resolved], config: Config) -> dict[Target, Any]:
        original = resolved[FORWARD_CUDA].raw
        indexer_module = sys.modules[resolved[FORWARD_CUDA].owner.__module__]

        @functools.wraps(original)
        def forward_cuda(
            self: Any,
            x: Any,
            q_lora: Any,
            positions: Any,
            forward_batch: Any,
            layer_id: int,
            return_indices: bool = True,
        ) -> Any:
            if is_eager_idle_rank(indexer_module, forward_batch):
                topk = all_invalid_topk_rows(x, self.index_topk, return_indices)
                topk = indexer_module._broadcast_indexer_topk_from_rank0(topk)
                return indexer_module.maybe_capture_indexer_topk(layer_id, topk)
            return original(self, x, q_lora, positions, forward_batch, layer_id, return_indices)

        return {FORWARD_CUDA: forward_cuda}
