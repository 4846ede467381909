"""The patch registry: one patch per file, applied in this order.

| id                     | group          | seed bullet(s) of sgl-project/sglang#32209 |
|------------------------|----------------|---------------------------------------------|
| future_seed_authority  | dp_draft_vote  | 3 (overlap: the future flag is authoritative) |
| eager_draft_gate       | dp_draft_vote  | 1, 2 (worker hook; PD-decode marking)       |
| draft_graph_vote       | dp_draft_vote  | 4, 5, 6 (vote in the MLP sync; runner gate) |
| dsa_idle_index         | dsa_idle_index | 8 (idle DP ranks skip eager DSA index selection) |
"""

from __future__ import annotations

from sglang_dp_mtp_fix.core import Patch
from sglang_dp_mtp_fix.patches.draft_graph_vote import DraftGraphVote
from sglang_dp_mtp_fix.patches.dsa_idle_index import DsaIdleIndex
from sglang_dp_mtp_fix.patches.eager_draft_gate import EagerDraftGate
from sglang_dp_mtp_fix.patches.future_seed_authority import FutureSeedAuthority


def all_patches() -> list[Patch]:
    return [FutureSeedAuthority(), EagerDraftGate(), DraftGraphVote(), DsaIdleIndex()]


PATCH_IDS = ("future_seed_authority", "eager_draft_gate", "draft_graph_vote", "dsa_idle_index")
