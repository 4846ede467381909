"""The patch registry: one patch per file, applied in this order.

"#32209 bullet N" is the Nth bullet of sgl-project/sglang#32209's description; docs/how-it-works.md ("The patches")
says what each patch does.

| id                    | group         | carries                                                           |
|-----------------------|---------------|-------------------------------------------------------------------|
| future_seed_authority | dp_draft_vote | #32209 bullet 3: under overlap the future flag is authoritative   |
| eager_draft_gate      | dp_draft_vote | #32209 bullets 1, 2: the worker hook; PD-decode marking           |
| draft_graph_vote      | dp_draft_vote | #32209 bullets 4, 5, 6: the vote in the MLP sync; the runner gate |
| draft_token_counts    | dp_draft_vote | #32182 as upstream #32196: the draft's own DP token counts        |
| draft_local_rows      | (own)         | #32209 bullet 7: eager draft rows sliced to the local count       |
| dsa_idle_index        | (own)         | #32209 bullet 8: idle DP ranks skip eager DSA index selection     |
| dsa_trtllm_trim       | (own)         | #32209 bullet 9: TRT-LLM DSA decode trimmed to the planned batch  |
| dsa_decode_trim       | (own)         | bullet 9 for every other DSA decode backend (not in #32209)       |
| upstream_vote_watch   | (own)         | 0.5.21+: the stall line and recorder on SGLang's own draft vote   |
| arrival_seed          | (own)         | a setting (default off): seedless PD arrivals get a DSA seed      |
"""

from __future__ import annotations

from sglang_dp_mtp_fix.core import Patch
from sglang_dp_mtp_fix.patches.arrival_seed import ArrivalSeedPatch
from sglang_dp_mtp_fix.patches.draft_graph_vote import DraftGraphVote
from sglang_dp_mtp_fix.patches.draft_local_rows import DraftLocalRows
from sglang_dp_mtp_fix.patches.draft_token_counts import DraftTokenCounts
from sglang_dp_mtp_fix.patches.dsa_decode_trim import DsaDecodeTrim
from sglang_dp_mtp_fix.patches.dsa_idle_index import DsaIdleIndex
from sglang_dp_mtp_fix.patches.dsa_trtllm_trim import DsaTrtllmTrim
from sglang_dp_mtp_fix.patches.eager_draft_gate import EagerDraftGate
from sglang_dp_mtp_fix.patches.future_seed_authority import FutureSeedAuthority
from sglang_dp_mtp_fix.patches.upstream_vote_watch import UpstreamVoteWatch


def all_patches() -> list[Patch]:
    return [
        FutureSeedAuthority(),
        EagerDraftGate(),
        DraftGraphVote(),
        DraftTokenCounts(),
        DraftLocalRows(),
        DsaIdleIndex(),
        DsaTrtllmTrim(),
        DsaDecodeTrim(),
        UpstreamVoteWatch(),
        ArrivalSeedPatch(),
    ]


PATCH_IDS = tuple(p.id for p in all_patches())
