"""draft_graph_vote — a draft-graph vote carried in the existing DP MLP sync; the draft runner obeys it.

Why:      Every DP rank must take the same draft path (CUDA graph vs eager), because the two paths issue different
          collectives. Folding the seedless fallback into the generic decode-graph vote would keep ranks consistent
          but cost target-verify and draft-extend their graphs (docs/how-it-works.md, "The bug"), so the draft vote
          is separate (#32209, first and fifth failure modes).
How:      No added collective and no change to the gathered row's shape: the decode-graph column carries the draft
          vote in its value (wire format at ``DECODE_COLUMN``). Six wrappers; ``SYNC_ENTRY`` opens the round
          (eager_draft_gate's PD-decode marking, then the rank's vote in a context variable); ``LOCAL_ROW`` and
          ``FALLBACK_ROW`` encode; ``UPDATE_BATCH`` decodes the gathered column (min over every rank, the local vote
          when nothing was gathered) into ``batch.can_run_dp_draft_cuda_graph``; ``FORWARD_INIT`` carries it to the
          forward batch; ``RUNNER_GATE`` refuses the draft graph when the runner needs MLP sync and the group voted
          no. A rank without the plugin raises ``MixedDeploymentError``. Target-verify and draft-extend are untouched.
Releases: applied on 0.5.15.post1 – 0.5.20. Superseded from 0.5.21 (column ``can_run_draft_cuda_graph``, upstream
          #32196).
Removable when: the oldest supported release carries upstream #32196 (0.5.21), or #32209 lands.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any

from sglang_dp_mtp_fix.config import Config
from sglang_dp_mtp_fix.core import Kind, Patch, Resolved, Target
from sglang_dp_mtp_fix.diagnosis import monitor, recorder, stats
from sglang_dp_mtp_fix.errors import MixedDeploymentError
from sglang_dp_mtp_fix.patches._detect import classify_group
from sglang_dp_mtp_fix.patches.eager_draft_gate import mark_pd_decode_batch

DP_ATTN = "sglang.srt.managers.scheduler_components.dp_attn"
SCHEDULE_BATCH = "sglang.srt.managers.schedule_batch"
FORWARD_BATCH = "sglang.srt.model_executor.forward_batch_info"
DRAFT_RUNNER = "sglang.srt.speculative.eagle_draft_cuda_graph_runner"
BASE_SPEC = "sglang.srt.speculative.base_spec_worker"
EAGLE_COMMON = "sglang.srt.speculative.eagle_worker_common"
SCHEDULER = "sglang.srt.managers.scheduler"

VOTE_ATTR = "can_run_dp_draft_cuda_graph"
FORCE_EAGER_ATTR = "force_disable_draft_cuda_graph"

# Wire format of the decode-graph column of the MLP-sync row. SGLang reads the column only as bool(column.min()), which
# this encoding leaves as it was (2 and 3 are truthy): the generic vote, its consumers and the row width (hard-coded 7
# on 0.5.15.post1) stay stock. A gathered STOCK_DECODE_YES names a rank without the plugin: the sync stops the group
# with a clear error instead of letting the ranks split later.
DECODE_COLUMN = 2
DECODE_NO = 0
STOCK_DECODE_YES = 1  # decode graph yes, sent by a rank WITHOUT this plugin
DECODE_YES_DRAFT_NO = 2
DECODE_YES_DRAFT_YES = 3  # also every inactive rank's vote

SYNC_ENTRY = Target(DP_ATTN, "SchedulerDPAttnAdapter.maybe_prepare_mlp_sync_batch")
LOCAL_ROW = Target(DP_ATTN, "MLPSyncBatchInfo._get_local_tensor")
FALLBACK_ROW = Target(DP_ATTN, "MLPSyncBatchInfo._get_fallback_tensor")
# Premises of the one-scope round (fingerprinted, never changed): the sync entry is the only way to the raw sync,
# which calls all_gather (rows built from the two encoded tensors, left on the info) and then _update_gather_batch.
# Where nothing is gathered (one DP rank, SGLANG_SCHEDULER_SKIP_ALL_GATHER) finalize_local, where present, builds the
# info from this rank's own row, so the local vote stands.
SYNC_METHOD = Target(DP_ATTN, "SchedulerDPAttnAdapter.prepare_mlp_sync_batch", Kind.CHECK)
SYNC_RAW = Target(DP_ATTN, "prepare_mlp_sync_batch_raw", Kind.CHECK)
GATHER = Target(DP_ATTN, "MLPSyncBatchInfo.all_gather", Kind.CHECK)
FINALIZE_LOCAL = Target(DP_ATTN, "MLPSyncBatchInfo.finalize_local", Kind.CHECK, required=False)
UPDATE_BATCH = Target(DP_ATTN, "_update_gather_batch")
FORWARD_INIT = Target(FORWARD_BATCH, "ForwardBatch.init_new")
RUNNER_GATE = Target(DRAFT_RUNNER, "EAGLEDraftCudaGraphRunner.can_run_graph")
# Class defaults True (here and FB_DEFAULT): batches that never synced keep their draft graphs.
SB_DEFAULT = Target(SCHEDULE_BATCH, "ScheduleBatch", Kind.ADD, attr=VOTE_ATTR, fingerprinted=False)
# Premises (fingerprinted, never changed): the vote reaches the runner only because run_batch hands the ScheduleBatch
# itself to the worker, and prepare_for_draft builds the draft ForwardBatch with ForwardBatch.init_new(batch) and
# asks can_run_graph on that same object. prepare_for_draft lives in base_spec_worker in 0.5.15.post1 and in
# eagle_worker_common from 0.5.16: one premise, two homes, at least one must be present.
PREPARE_DRAFT_BASE = Target(
    BASE_SPEC, "EagleDraftWorkerBase.prepare_for_draft", Kind.CHECK, required=False, one_of="prepare_for_draft"
)
PREPARE_DRAFT_COMMON = Target(EAGLE_COMMON, "prepare_for_draft", Kind.CHECK, required=False, one_of="prepare_for_draft")
RUN_BATCH = Target(SCHEDULER, "Scheduler.run_batch", Kind.CHECK)
FB_DEFAULT = Target(FORWARD_BATCH, "ForwardBatch", Kind.ADD, attr=VOTE_ATTR, fingerprinted=False)


# This rank's draft vote for the MLP-sync round in progress; None outside one (reads as yes).
_local_vote: contextvars.ContextVar[bool | None] = contextvars.ContextVar("dp_mtp_fix_local_draft_vote", default=None)


def local_draft_vote(local_batch: Any) -> bool:
    """This rank's draft-graph vote: no batch, idle and prebuilt batches vote yes."""
    if local_batch is None:
        return True
    mode = local_batch.forward_mode
    if mode.is_idle() or mode.is_prebuilt():
        return True
    return not getattr(local_batch, FORCE_EAGER_ATTR, False)


_PLUGIN_VALUES = frozenset((DECODE_NO, DECODE_YES_DRAFT_NO, DECODE_YES_DRAFT_YES))


def decode_group_vote(column: list[int]) -> bool:
    """Group draft vote from the gathered decode-graph column; raises on ranks without the plugin."""
    seen = set(column)
    if seen <= _PLUGIN_VALUES:  # every round but a misconfigured one: two set operations
        return DECODE_YES_DRAFT_NO not in seen
    stock = [rank for rank, value in enumerate(column) if value == STOCK_DECODE_YES]
    unknown = [
        rank
        for rank, value in enumerate(column)
        if value not in (DECODE_NO, STOCK_DECODE_YES, DECODE_YES_DRAFT_NO, DECODE_YES_DRAFT_YES)
    ]
    if stock or unknown:
        raise MixedDeploymentError(
            "sglang-dp-mtp-fix: DP rank(s) "
            f"{stock + unknown} sent an MLP-sync row without the draft-graph vote (column values {column}); "
            "the plugin is not active there (not installed, SGLANG_PLUGINS excludes dp_mtp_fix, "
            "SGLANG_DP_MTP_FIX=off/skip, or a different SGLang). Every rank of a DP group must run the same "
            "plugin configuration; stopping now instead of hanging in a later collective."
        )
    return DECODE_YES_DRAFT_NO not in column


class DraftGraphVote(Patch):
    id = "draft_graph_vote"
    requires = ("eager_draft_gate",)
    targets = (
        SYNC_ENTRY,
        SYNC_METHOD,
        SYNC_RAW,
        LOCAL_ROW,
        FALLBACK_ROW,
        GATHER,
        FINALIZE_LOCAL,
        UPDATE_BATCH,
        FORWARD_INIT,
        RUNNER_GATE,
        SB_DEFAULT,
        FB_DEFAULT,
        PREPARE_DRAFT_BASE,
        PREPARE_DRAFT_COMMON,
        RUN_BATCH,
    )

    def classify(self) -> None:
        classify_group()

    def replacements(self, resolved: dict[Target, Resolved], config: Config) -> dict[Target, Any]:
        fields = getattr(resolved[LOCAL_ROW].owner, "__dataclass_fields__", {})
        # The decode vote's and the gathered tensor's field names differ per release: read whichever this one has.
        decode_field = "can_run_decode_cuda_graph" if "can_run_decode_cuda_graph" in fields else "can_cuda_graph"
        gathered_field = "tp0_info_cpu" if "tp0_info_cpu" in fields else "tp0_info"
        # The generic vote's name on ScheduleBatch: can_run_dp_cuda_graph until 0.5.18, can_run_decode_cuda_graph after.
        batch_fields = getattr(resolved[SB_DEFAULT].owner, "__dataclass_fields__", {})
        generic_field = (
            "can_run_decode_cuda_graph" if "can_run_decode_cuda_graph" in batch_fields else "can_run_dp_cuda_graph"
        )
        # Decided at load (the settings: ``diagnosis.wiring``, set by the plugin): without SGLANG_DP_MTP_FIX_STATS and
        # SGLang's --enable-metrics the wrappers carry no counting code at all.
        counters = stats.activate()
        forward_init = resolved[FORWARD_INIT].raw.__func__  # a classmethod

        @functools.wraps(forward_init)
        def init_new(cls: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
            forward_batch = forward_init(cls, batch, *args, **kwargs)
            forward_batch.can_run_dp_draft_cuda_graph = getattr(batch, VOTE_ATTR, True)
            return forward_batch

        # Flight recorder (SGLANG_DP_MTP_FIX_RECORDER_DIR, ``recorder``): decided at load like the counters; unset, the
        # three wrappers stay as built and nothing records.
        # Stacked: SGLang's gate, its refusals counted, the vote's gate, the recorder; SGLang's update, the vote's,
        # its votes counted, the recorder.
        update_batch = _update_batch_wrapper(resolved[UPDATE_BATCH].raw, gathered_field)
        local_row, update_batch, runner_gate = recorder.instrument(
            _local_row_wrapper(resolved[LOCAL_ROW].raw, decode_field),
            stats.counting_update(counters, update_batch, VOTE_ATTR, generic_field, _local_vote),
            _runner_gate_wrapper(stats.counting_refusals(counters, resolved[RUNNER_GATE].raw)),
            decode_field,
            generic_field,
            _local_vote,
        )
        return {
            SYNC_ENTRY: _sync_entry_wrapper(resolved[SYNC_ENTRY].raw),
            LOCAL_ROW: local_row,
            FALLBACK_ROW: _fallback_row_wrapper(resolved[FALLBACK_ROW].raw),
            UPDATE_BATCH: update_batch,
            FORWARD_INIT: classmethod(init_new),
            RUNNER_GATE: runner_gate,
            SB_DEFAULT: True,
            FB_DEFAULT: True,
        }


def _sync_entry_wrapper(sync_entry: Any) -> Any:
    """Opens the round: eager_draft_gate's PD-decode marking, then this rank's vote in ``_local_vote``; counts the
    rounds entered and finished for the stall line (``monitor.PROGRESS``: its thread reads them, nothing else here)."""
    progress = monitor.PROGRESS

    @functools.wraps(sync_entry)
    def maybe_prepare_mlp_sync_batch(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        if batch is None:
            vote = True
        else:
            mark_pd_decode_batch(batch)  # eager_draft_gate, immediately before the sync
            vote = local_draft_vote(batch)
        token = _local_vote.set(vote)
        n = progress.entered = progress.entered + 1
        try:
            result = sync_entry(self, batch, *args, **kwargs)
        finally:
            _local_vote.reset(token)
        progress.finished = n
        progress.busy = result is not None  # the group had work (a rank without any gets an IDLE batch)
        return result

    return maybe_prepare_mlp_sync_batch


def _local_row_wrapper(local_row: Any, decode_field: str) -> Any:
    @functools.wraps(local_row)
    def _get_local_tensor(self: Any, *args: Any, **kwargs: Any) -> Any:
        decode_vote = getattr(self, decode_field)  # host-side bool: no device read
        if not decode_vote:
            return local_row(self, *args, **kwargs)
        # SGLang builds the row with int(<decode vote>): lend it the encoded value for that one call instead of
        # writing into the tensor afterwards (no tensor op, and no device write on the device-group path).
        setattr(self, decode_field, DECODE_YES_DRAFT_NO if _local_vote.get() is False else DECODE_YES_DRAFT_YES)
        try:
            return local_row(self, *args, **kwargs)
        finally:
            setattr(self, decode_field, decode_vote)

    return _get_local_tensor


def _fallback_row_wrapper(fallback_row: Any) -> Any:
    """SGLang's fallback row is constant (fingerprinted): encoded once per device and dtype, handed out as copies (a
    fresh tensor per call, as SGLang's own: all_gather may build its gathered tensor as a view of it)."""
    encoded_fallback: dict[tuple[Any, Any], Any] = {}

    @functools.wraps(fallback_row)
    def _get_fallback_tensor(self: Any, *args: Any, **kwargs: Any) -> Any:
        key = (args[0] if args else kwargs.get("device"), args[1] if len(args) > 1 else kwargs.get("dtype"))
        row = encoded_fallback.get(key)
        if row is None:
            row = fallback_row(self, *args, **kwargs)
            row[DECODE_COLUMN] = DECODE_YES_DRAFT_YES  # inactive ranks vote yes
            encoded_fallback[key] = row
        return row.clone()

    return _get_fallback_tensor


def _update_batch_wrapper(update_batch: Any, gathered_field: str) -> Any:
    """Decodes the gathered column into ``batch.can_run_dp_draft_cuda_graph``."""

    def round_vote(info: Any) -> bool:
        """The group's draft vote from the rows SGLang gathered; the local vote when it gathered none."""
        gathered = getattr(info, gathered_field, None)
        if gathered is None or info.dp_size == 1:
            return _local_vote.get() is not False
        # <=0.5.17 keeps the gathered rows on the device: one small D2H here, none on 0.5.18+.
        return decode_group_vote([row[DECODE_COLUMN] for row in gathered.tolist()])

    @functools.wraps(update_batch)
    def _update_gather_batch(batch: Any, mlp_sync_info: Any, *args: Any, **kwargs: Any) -> Any:
        result = update_batch(batch, mlp_sync_info, *args, **kwargs)
        setattr(batch, VOTE_ATTR, round_vote(mlp_sync_info))
        return result

    return _update_gather_batch


def _runner_gate_wrapper(runner_gate: Any) -> Any:
    """Refuses the draft graph when the runner needs MLP sync and the group voted no."""

    @functools.wraps(runner_gate)
    def can_run_graph(self: Any, forward_batch: Any) -> Any:
        ok = runner_gate(self, forward_batch)
        # Common case first (vote yes): one attribute read; objects that never synced keep graphs.
        if ok and not getattr(forward_batch, VOTE_ATTR, True) and self.require_mlp_sync:
            return False
        return ok

    return can_run_graph
