"""eager_draft_gate — the worker hook, and PD-decode marking of batches that need a rank-consistent eager draft.

Why:      In PD decode a request can arrive without a DSA top-k seed (GLM-5.2 MTP IndexShare). The stock draft step
          then goes eager on that rank only while idle DP ranks replay the draft CUDA graph; the ranks issue
          different collectives and hang (#32209, first failure mode). The group can only agree if the condition is
          known *before* the DP MLP sync.
How:      Adds ``BaseSpecWorker.requires_dp_attention_eager_forward(batch) -> False`` (non-EAGLE algorithms,
          non-last PP ranks) and the PR's predicate on ``EAGLEWorkerV2`` (the draft guard's condition, the seed read
          through ``future_seed_authority``'s ``has_dsa_topk_seed``). A wrapper around the PD-decode round scopes the
          scheduler's spec worker in a context variable; ``mark_pd_decode_batch`` then sets
          ``batch.force_disable_draft_cuda_graph`` immediately before the sync: the PR's placement, reached from a
          seam instead of a copied function body. ``draft_graph_vote``'s wrapper that opens the sync round calls it,
          so the two patches apply together. ``draft()`` itself is unchanged: its local guard stays.
Releases: applied on 0.5.15.post1 – 0.5.20. Superseded from 0.5.21 (``EagleDraftInput.cuda_graph_compatible``).
Removable when: the oldest supported release carries upstream #32196 (0.5.21), or #32209 lands.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any

from sglang_dp_mtp_fix.config import Config
from sglang_dp_mtp_fix.core import Kind, Patch, Resolved, Target
from sglang_dp_mtp_fix.patches._detect import classify_group
from sglang_dp_mtp_fix.patches.future_seed_authority import draft_seed_present

BASE_SPEC = "sglang.srt.speculative.base_spec_worker"
EAGLE_V2 = "sglang.srt.speculative.eagle_worker_v2"
DECODE = "sglang.srt.disaggregation.decode"
SCHEDULE_BATCH = "sglang.srt.managers.schedule_batch"
EAGLE_DISAGG = "sglang.srt.speculative.eagle_disaggregation"

HOOK_NAME = "requires_dp_attention_eager_forward"
FLAG = "force_disable_draft_cuda_graph"

BASE_HOOK = Target(BASE_SPEC, "BaseSpecWorker", Kind.ADD, attr=HOOK_NAME, fingerprinted=False)
EAGLE_HOOK = Target(EAGLE_V2, "EAGLEWorkerV2", Kind.ADD, attr=HOOK_NAME, fingerprinted=False)
BATCH_FLAG_DEFAULT = Target(SCHEDULE_BATCH, "ScheduleBatch", Kind.ADD, attr=FLAG, fingerprinted=False)
# Premise (fingerprinted, never changed): the draft guard goes eager exactly when a seeding draft worker gets a
# non-idle batch without a seed; the EAGLE predicate below mirrors that condition.
DRAFT_GUARD = Target(EAGLE_V2, "EagleDraftWorker.draft", Kind.CHECK)
DECODE_ROUND = Target(DECODE, "SchedulerDisaggregationDecodeMixin.get_next_disagg_decode_batch_to_run")
# Premises (fingerprinted, never changed): the seedless PD arrival is built here, and outside PD decode the
# draft-extend paths always set the seed, which is why only PD-decode rounds need marking (tests/test_premises.py
# pins this on the real source).
DISAGG_ARRIVAL = Target(EAGLE_DISAGG, "build_eagle_disagg_draft_input", Kind.CHECK)
EXTEND_FOR_PREFILL = Target(EAGLE_V2, "EagleDraftWorker._draft_extend_for_prefill", Kind.CHECK)
EXTEND_FOR_DECODE = Target(EAGLE_V2, "EagleDraftWorker._draft_extend_for_decode", Kind.CHECK)

# The spec worker of the scheduler whose PD-decode round is being scheduled; _OUTSIDE elsewhere.
_OUTSIDE = object()
_pd_decode_worker: contextvars.ContextVar[Any] = contextvars.ContextVar("dp_mtp_fix_pd_decode_worker", default=_OUTSIDE)


def base_requires_dp_attention_eager_forward(self: Any, batch: Any) -> bool:
    """Default for every speculative worker: no rank-consistent eager draft needed."""
    return False


def eagle_requires_dp_attention_eager_forward(self: Any, batch: Any) -> bool:
    """True when this batch's draft step will run eagerly because its DSA top-k seed is missing.

    Mirrors the draft guard: the draft worker seeds DSA top-k from draft-extend, the batch is not idle, and the
    seed the guard will see (future flag authoritative under overlap) is absent.
    """
    draft_worker = getattr(self, "_draft_worker", None)
    if draft_worker is None or not getattr(draft_worker, "seed_dsa_topk_from_draft_extend", False):
        return False
    spec_info = getattr(batch, "spec_info", None)
    if spec_info is None:
        return False
    forward_mode = getattr(batch, "forward_mode", None)
    if forward_mode is not None and forward_mode.is_idle():
        return False
    has_seed = getattr(spec_info, "has_dsa_topk_seed", None)
    return not (has_seed() if callable(has_seed) else draft_seed_present(spec_info))


def needs_eager_draft(spec_worker: Any, batch: Any) -> bool:
    hook = getattr(spec_worker, HOOK_NAME, None) if spec_worker is not None else None
    return bool(hook(batch)) if hook is not None else False


def mark_pd_decode_batch(batch: Any) -> None:
    """Inside a PD-decode round, mark ``batch`` (not None) for a rank-consistent eager draft when it needs one.

    Called immediately before the DP MLP sync, by the wrapper that opens the sync round (draft_graph_vote)."""
    spec_worker = _pd_decode_worker.get()
    if spec_worker is not _OUTSIDE:
        setattr(batch, FLAG, needs_eager_draft(spec_worker, batch))


class EagerDraftGate(Patch):
    id = "eager_draft_gate"
    requires = ("future_seed_authority", "draft_graph_vote")
    targets = (
        BASE_HOOK,
        EAGLE_HOOK,
        BATCH_FLAG_DEFAULT,
        DRAFT_GUARD,
        DECODE_ROUND,
        DISAGG_ARRIVAL,
        EXTEND_FOR_PREFILL,
        EXTEND_FOR_DECODE,
    )

    def classify(self) -> None:
        classify_group()

    def replacements(self, resolved: dict[Target, Resolved], config: Config) -> dict[Target, Any]:
        decode_round_original = resolved[DECODE_ROUND].raw

        @functools.wraps(decode_round_original)
        def get_next_disagg_decode_batch_to_run(self: Any, *args: Any, **kwargs: Any) -> Any:
            token = _pd_decode_worker.set(getattr(self, "draft_worker", None))
            try:
                return decode_round_original(self, *args, **kwargs)
            finally:
                _pd_decode_worker.reset(token)

        return {
            BASE_HOOK: base_requires_dp_attention_eager_forward,
            EAGLE_HOOK: eagle_requires_dp_attention_eager_forward,
            BATCH_FLAG_DEFAULT: False,
            DECODE_ROUND: get_next_disagg_decode_batch_to_run,
        }
