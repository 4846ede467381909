"""The patch registry: one patch per file, applied in this order.

| id                     | group          | seed bullet(s) of sgl-project/sglang#32209 |
|------------------------|----------------|---------------------------------------------|
| future_seed_authority  | dp_draft_vote  | 3 (overlap: the future flag is authoritative) |
| eager_draft_gate       | dp_draft_vote  | 1, 2 (worker hook; PD-decode marking)       |
| draft_graph_vote       | dp_draft_vote  | 4, 5, 6 (vote in the MLP sync; runner gate) |
| draft_token_counts     | dp_draft_vote  | #32182 (the draft's own DP token counts; stacks on the vote's wrappers) |
| draft_local_rows       | (own)          | 7 (eager draft rows sliced to the local count) |
| dsa_idle_index         | (own)          | 8 (idle DP ranks skip eager DSA index selection) |
| dsa_trtllm_trim        | (own)          | 9 (TRT-LLM DSA decode: trim to the planned batch, zero-pad back) |
| dsa_decode_trim        | (own)          | 9, for every other DSA decode backend (not in the PR; issue 27) |
"""

from __future__ import annotations

from sglang_dp_mtp_fix.core import Patch
from sglang_dp_mtp_fix.patches.draft_graph_vote import DraftGraphVote
from sglang_dp_mtp_fix.patches.draft_local_rows import DraftLocalRows
from sglang_dp_mtp_fix.patches.draft_token_counts import DraftTokenCounts
from sglang_dp_mtp_fix.patches.dsa_decode_trim import DsaDecodeTrim
from sglang_dp_mtp_fix.patches.dsa_idle_index import DsaIdleIndex
from sglang_dp_mtp_fix.patches.dsa_trtllm_trim import DsaTrtllmTrim
from sglang_dp_mtp_fix.patches.eager_draft_gate import EagerDraftGate
from sglang_dp_mtp_fix.patches.future_seed_authority import FutureSeedAuthority


def all_patches() -> list[Patch]:
    return [
        FutureSeedAuthority(), EagerDraftGate(), DraftGraphVote(), DraftTokenCounts(), DraftLocalRows(), DsaIdleIndex(),
        DsaTrtllmTrim(), DsaDecodeTrim(),
    ]  # fmt: skip


PATCH_IDS = tuple(p.id for p in all_patches())
