"""upstream_vote_watch — the stall line, heartbeat and flight recorder where SGLang's own draft vote decides.

Why:      From 0.5.21 SGLang votes the draft graph itself (#32196), so the fix stands down there. A DP group can still
          stall (a rank frozen, killed or OOM-killed, a lazily loaded kernel on the first verify: sglang#33642), and
          the operator asks the same two questions: which rank stopped, which rank decided differently. This patch
          gives them the same answers as on the patched releases. It changes no decision and adds no collective:
          every wrapper calls SGLang's own function with the same arguments and returns its result.
How:      The seams of draft_graph_vote, with SGLang's bodies unchanged. ``SYNC_ENTRY`` counts MLP-sync rounds
          entered and finished for the stall line (``monitor``). With ``SGLANG_DP_MTP_FIX_RECORDER_DIR`` set
          (``recorder``): ``LOCAL_ROW`` numbers the round and keeps this rank's own draft vote (the row's
          ``can_run_draft_cuda_graph``: the gather then overwrites the field with the group's), ``UPDATE_BATCH``
          records the generic and the draft group votes as SGLang set them on the batch, ``RUNNER_GATE`` the draft
          path and bucket. ``rollcall`` reads the files as it reads the patched releases'.
Releases: applied on 0.5.21 – 0.5.23, where the draft-vote group is superseded; not-affected elsewhere
          (draft_graph_vote carries the same watch on 0.5.15.post1 – 0.5.20; 0.5.14 and 0.5.15 have no draft vote).
Removable when: SGLang names the DP rank that stopped by itself (no upstream change does so up to 0.5.23).
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any

from sglang_dp_mtp_fix.config import Config
from sglang_dp_mtp_fix.core import UNCHANGED, Patch, Resolved, StandDown, Status, Target
from sglang_dp_mtp_fix.diagnosis import monitor, recorder
from sglang_dp_mtp_fix.patches._detect import dp_draft_vote_verdict
from sglang_dp_mtp_fix.patches.draft_graph_vote import (
    FINALIZE_LOCAL,
    GATHER,
    LOCAL_ROW,
    RUNNER_GATE,
    SYNC_ENTRY,
    SYNC_METHOD,
    SYNC_RAW,
    UPDATE_BATCH,
)

UPSTREAM_VOTE_RELEASES = ("0.5.21", "0.5.22", "0.5.23")
# The fields SGLang's own vote uses from 0.5.21 (fingerprinted bodies): the row's local draft vote, and the generic
# vote on the batch.
LOCAL_DRAFT_FIELD = "can_run_draft_cuda_graph"
DECODE_FIELD = "can_run_decode_cuda_graph"

# This rank's own draft vote in the round in progress, read from the row SGLang builds (the recorder's SENT_DRAFT).
_local_vote: contextvars.ContextVar[bool | None] = contextvars.ContextVar("dp_mtp_fix_upstream_vote", default=None)


class UpstreamVoteWatch(Patch):
    id = "upstream_vote_watch"
    targets = (SYNC_ENTRY, SYNC_METHOD, SYNC_RAW, LOCAL_ROW, GATHER, FINALIZE_LOCAL, UPDATE_BATCH, RUNNER_GATE)
    written_for = UPSTREAM_VOTE_RELEASES
    fixes = False

    def classify(self) -> None:
        verdict = dp_draft_vote_verdict()
        if verdict is None:
            raise StandDown(
                Status.NOT_AFFECTED,
                "the plugin's own draft vote (draft_graph_vote) applies on this release and carries the stall line, "
                "heartbeat and flight recorder",
            )
        status, reason = verdict
        if status is not Status.SUPERSEDED:
            raise StandDown(status, f"no draft vote to watch: {reason}")

    def replacements(self, resolved: dict[Target, Resolved], config: Config) -> dict[Target, Any]:
        sync_entry = resolved[SYNC_ENTRY].raw
        local_row = resolved[LOCAL_ROW].raw
        progress = monitor.PROGRESS  # rounds entered and finished, for the stall line (the settings: ``wiring``)

        @functools.wraps(sync_entry)
        def maybe_prepare_mlp_sync_batch(self: Any, *args: Any, **kwargs: Any) -> Any:
            n = progress.entered = progress.entered + 1
            result = sync_entry(self, *args, **kwargs)
            progress.finished = n
            progress.busy = result is not None  # the group had work (a rank without any gets an IDLE batch)
            return result

        new: dict[Target, Any] = {
            SYNC_ENTRY: maybe_prepare_mlp_sync_batch,
            LOCAL_ROW: UNCHANGED,
            UPDATE_BATCH: UNCHANGED,
            RUNNER_GATE: UNCHANGED,
        }

        @functools.wraps(local_row)
        def _get_local_tensor(self: Any, *args: Any, **kwargs: Any) -> Any:
            _local_vote.set(bool(getattr(self, LOCAL_DRAFT_FIELD)))  # before the gather overwrites it
            return local_row(self, *args, **kwargs)

        row, update, gate = recorder.instrument(
            _get_local_tensor,
            resolved[UPDATE_BATCH].raw,
            resolved[RUNNER_GATE].raw,
            DECODE_FIELD,
            DECODE_FIELD,
            _local_vote,
        )
        if row is not _get_local_tensor:  # the directory was accepted: the recorder's wrappers go in
            new.update({LOCAL_ROW: row, UPDATE_BATCH: update, RUNNER_GATE: gate})
        return new  # without the recorder: the stall line only, nothing on the row, the batch or the runner
