"""future_seed_authority — under overlap scheduling the future seed flag, not the tensor, says whether a seed exists.

Why:      With overlap scheduling a seeded running batch can merge a seedless prebuilt batch: its
          ``dsa_topk_indices`` tensor stays, stale and non-empty, while the draft guard sees no seed and goes eager.
          A vote that read the tensor would say "graph" on a rank that then runs eager: the very hang this plugin
          removes (#32209, second failure mode).
How:      Adds ``EagleDraftInput.has_dsa_topk_seed()``: the future flag when ``future_indices`` is set, otherwise
          ``dsa_topk_indices is not None``. ``eager_draft_gate``'s predicate calls it.
Releases: applied on 0.5.15.post1 – 0.5.20. Superseded from 0.5.21 (``cuda_graph_compatible`` is ANDed in both merge
          branches).
Removable when: the oldest supported release carries upstream #32196 (0.5.21), or #32209 lands.
"""

from __future__ import annotations

from typing import Any

from sglang_dp_mtp_fix.config import Config
from sglang_dp_mtp_fix.core import Kind, Patch, Resolved, Target
from sglang_dp_mtp_fix.patches._detect import classify_group

EAGLE_INFO = "sglang.srt.speculative.eagle_info"
OVERLAP_UTILS = "sglang.srt.managers.overlap_utils"
SCHEDULE_BATCH = "sglang.srt.managers.schedule_batch"
SCHEDULER = "sglang.srt.managers.scheduler"
MULTIPLEX = "sglang.srt.multiplex.multiplexing_mixin"

HAS_SEED = Target(EAGLE_INFO, "EagleDraftInput", Kind.ADD, attr="has_dsa_topk_seed", fingerprinted=False)
# Premises (fingerprinted, never changed): EagleDraftInput.merge_batch ANDs future_dsa_topk_indices_available but
# leaves the materialized dsa_topk_indices in place, and FutureMap._resolve_spec_extras replaces that tensor with None
# when the flag is False; so under overlap the flag, not the tensor, is the seed the draft guard sees.
MERGE_BATCH = Target(EAGLE_INFO, "EagleDraftInput.merge_batch", Kind.CHECK)
RESOLVE_EXTRAS = Target(OVERLAP_UTILS, "FutureMap._resolve_spec_extras", Kind.CHECK)
# Premises (fingerprinted, never changed): ScheduleBatch.merge_batch is only reached with a non-empty receiver,
# because every call site replaces an empty running batch instead of merging into it (the PD-decode call site,
# get_next_disagg_decode_batch_to_run, is eager_draft_gate's wrapped DECODE_ROUND and fingerprinted there).
SB_MERGE = Target(SCHEDULE_BATCH, "ScheduleBatch.merge_batch", Kind.CHECK)
MERGE_SITE_NEXT_BATCH = Target(SCHEDULER, "Scheduler.get_next_batch_to_run", Kind.CHECK)
MERGE_SITE_PAUSE = Target(SCHEDULER, "Scheduler.pause_generation", Kind.CHECK)
MERGE_SITE_PDMUX = Target(MULTIPLEX, "SchedulerMultiplexMixin.event_loop_pdmux", Kind.CHECK)


def draft_seed_present(spec_info: Any) -> bool:
    """The seed the draft guard will see after the FutureMap resolves this input (no device access)."""
    if getattr(spec_info, "future_indices", None) is not None:
        return bool(getattr(spec_info, "future_dsa_topk_indices_available", False))
    return getattr(spec_info, "dsa_topk_indices", None) is not None


def has_dsa_topk_seed(self: Any) -> bool:
    """True when this draft input carries a DSA top-k seed (future flag authoritative under overlap)."""
    return draft_seed_present(self)


class FutureSeedAuthority(Patch):
    id = "future_seed_authority"
    requires = ("eager_draft_gate",)
    targets = (
        HAS_SEED,
        MERGE_BATCH,
        RESOLVE_EXTRAS,
        SB_MERGE,
        MERGE_SITE_NEXT_BATCH,
        MERGE_SITE_PAUSE,
        MERGE_SITE_PDMUX,
    )

    def classify(self) -> None:
        classify_group()

    def replacements(self, resolved: dict[Target, Resolved], config: Config) -> dict[Target, Any]:
        return {HAS_SEED: has_dsa_topk_seed}
