"""draft_token_counts — the draft model's own DP token counts when its MoE a2a backend gathers differently.

Why:      ``--speculative-moe-a2a-backend`` can answer SGLang's ``require_mlp_tp_gather`` differently from
          ``--moe-a2a-backend`` (FP4 NextN recipes: target ``deepep``, draft ``none``). The scheduler stores the
          target's per-rank counts on the batch, and the draft graph runner buckets on them: each rank then sizes
          its draft step from its own count while the draft's gathered MoE needs one size for all, and ranks split
          between draft graph and eager, or between buckets (#32182). The draft-graph vote cannot help: it votes
          on a path the counts have already split.
How:      No collective: the MLP-sync gather holds every rank's counts. Two seams, as upstream #32196:
            * ``_update_gather_batch`` (on the vote's wrapper): each round reads the draft's answer afresh (elastic
              EP can change it) and assigns ``draft_global_num_tokens(_for_logprob)``: ``None`` where the answers
              agree, else the gathered lists (draft gathers) or ``[local]``;
            * ``ForwardBatch.init_new`` for a draft model runner: the lists lent to the batch for the call.
          Target forwards untouched. Scheduler start: the answer must be readable (else the group stays stock);
          no draft, no DP attention, equal backends (equal answers every round) or a multi-layer EAGLE draft (it
          runs under the target's backend): nothing read or lent per round.
Releases: applied on 0.5.15.post1 – 0.5.20 (group dp_draft_vote: it stacks on the vote's two wrappers). Superseded
          from 0.5.21.
Removable when: the oldest supported release carries upstream #32196 (0.5.21).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from sglang_dp_mtp_fix.config import Config
from sglang_dp_mtp_fix.core import Kind, Patch, Resolved, Target
from sglang_dp_mtp_fix.patches._detect import classify_group
from sglang_dp_mtp_fix.patches._startup_checks import takes_server_args
from sglang_dp_mtp_fix.patches.draft_graph_vote import FORWARD_INIT, SCHEDULE_BATCH, SYNC_RAW, UPDATE_BATCH

DRAFT_COUNTS = "draft_global_num_tokens"
DRAFT_COUNTS_FOR_LOGPROB = "draft_global_num_tokens_for_logprob"

SB_COUNTS = Target(SCHEDULE_BATCH, "ScheduleBatch", Kind.ADD, attr=DRAFT_COUNTS, fingerprinted=False)
SB_COUNTS_FOR_LOGPROB = Target(
    SCHEDULE_BATCH, "ScheduleBatch", Kind.ADD, attr=DRAFT_COUNTS_FOR_LOGPROB, fingerprinted=False
)
# Premises (fingerprinted, never changed): the draft runner's answer is require_mlp_tp_gather inside the
# speculative backend context; the raw sync (SYNC_RAW, shared with draft_graph_vote) hands _update_gather_batch the
# target's answer as ``require_mlp_tp_gather``.
GATHER_ANSWER = Target("sglang.srt.utils.common", "require_mlp_tp_gather", Kind.CHECK)
DRAFT_CONTEXT = Target("sglang.srt.layers.moe.utils", "speculative_moe_a2a_backend_context", Kind.CHECK)
# 0.5.20 reads the counts in this method, called by init_new; earlier releases read them inline in init_new.
SYNC_METADATA = Target(
    "sglang.srt.model_executor.forward_batch_info", "ForwardBatch.init_mlp_sync_metadata", Kind.CHECK, required=False
)


def draft_gathers(server_args: Any = None) -> bool:
    """The draft's ``require_mlp_tp_gather`` as the draft runner computes it (``server_args``: the scheduler's;
    None: this process's published ones). SGLang's function is looked up on its module at each call."""
    from sglang.srt.layers.moe.utils import speculative_moe_a2a_backend_context
    from sglang.srt.utils import common

    with speculative_moe_a2a_backend_context():
        if not takes_server_args(common.require_mlp_tp_gather):  # 0.5.18+ reads the published ServerArgs
            return bool(common.require_mlp_tp_gather())
        if server_args is None:
            from sglang.srt.server_args import get_global_server_args

            server_args = get_global_server_args()
        return bool(common.require_mlp_tp_gather(server_args))


def draft_backend_differs() -> bool:
    """Whether the draft's context installs another MoE a2a backend than the target's. Of the flags that context
    changes, ``require_mlp_tp_gather`` reads only the backend (premises GATHER_ANSWER, DRAFT_CONTEXT): with equal
    backends the two answers are equal every round, whatever else changes (elastic scale-up turns both alike), so
    nothing need be read per round."""
    from sglang.srt.layers.moe.utils import get_moe_a2a_backend, get_speculative_moe_a2a_backend

    return bool(get_speculative_moe_a2a_backend() != get_moe_a2a_backend())


def multi_layer_eagle(scheduler: Any = None) -> bool:
    """Whether the draft is ``--enable-multi-layer-eagle``'s ``MultiLayerEagleWorkerV2``, which builds, captures and
    runs its draft outside ``speculative_moe_a2a_backend_context``: its runner's ``require_mlp_tp_gather`` is the
    target's answer. ``scheduler``: its spec worker and server args; None: this process's published config."""
    worker = getattr(scheduler, "draft_worker", None)
    if worker is not None and type(worker).__module__.endswith(".multi_layer_eagle_worker_v2"):
        return True
    try:  # 0.5.18+: the resolved config (a model's overrides can turn it on)
        from sglang.srt.runtime_context import get_spec

        return bool(get_spec().enable_multi_layer_eagle)
    except (ImportError, AttributeError):
        pass
    server_args = getattr(scheduler, "server_args", None)
    if server_args is None:
        from sglang.srt.server_args import get_global_server_args

        server_args = get_global_server_args()
    return bool(getattr(server_args, "enable_multi_layer_eagle", False))


def draft_answer_reader() -> Callable[[], bool]:
    """``draft_gathers()`` for the per-round path: the signature question asked once, SGLang's function and the
    published ServerArgs looked up at each call (both can be rebound at run time)."""
    from sglang.srt.layers.moe.utils import speculative_moe_a2a_backend_context
    from sglang.srt.utils import common

    if not takes_server_args(common.require_mlp_tp_gather):

        def read() -> bool:
            with speculative_moe_a2a_backend_context():
                return bool(common.require_mlp_tp_gather())

        return read
    from sglang.srt.server_args import get_global_server_args

    def read_with_args() -> bool:
        with speculative_moe_a2a_backend_context():
            return bool(common.require_mlp_tp_gather(get_global_server_args()))

    return read_with_args


class DraftTokenCounts(Patch):
    id = "draft_token_counts"
    requires = ("draft_graph_vote",)
    targets = (
        UPDATE_BATCH,
        FORWARD_INIT,
        SB_COUNTS,
        SB_COUNTS_FOR_LOGPROB,
        GATHER_ANSWER,
        DRAFT_CONTEXT,
        SYNC_RAW,
        SYNC_METADATA,
    )

    def __init__(self) -> None:
        # Whether this scheduler's draft can answer require_mlp_tp_gather unlike its target, so that its answer is
        # read each round (set at scheduler start; empty: not known yet).
        self.sizes_draft: list[bool] = []

    def classify(self) -> None:
        classify_group()

    def at_scheduler_start(self, scheduler: Any) -> None:
        server_args = getattr(scheduler, "server_args", None)
        if getattr(scheduler, "draft_worker", None) is None or not getattr(server_args, "enable_dp_attention", False):
            self.sizes_draft[:] = [False]  # nothing to size: no draft, or no DP ranks to agree with
            return
        if multi_layer_eagle(scheduler):
            self.sizes_draft[:] = [False]  # its draft gathers as the target does: the target's counts are its own
            return
        draft_gathers(server_args)  # unreadable: raises, and the group stays stock here
        self.sizes_draft[:] = [draft_backend_differs()]

    def replacements(self, resolved: dict[Target, Resolved], config: Config) -> dict[Target, Any]:
        update_batch = resolved[UPDATE_BATCH].raw
        forward_init = resolved[FORWARD_INIT].raw.__func__  # a classmethod
        self.sizes_draft.clear()  # a fresh application (tests apply the plugin again under other ServerArgs)
        sizes_draft = self.sizes_draft
        read_draft_answer = draft_answer_reader()

        def draft_answer() -> bool | None:
            if not sizes_draft:  # no scheduler start in this process (the rank harness): its published ServerArgs
                try:
                    draft_gathers()
                    sizes_draft.append(not multi_layer_eagle() and draft_backend_differs())
                except Exception:  # noqa: BLE001 - no ServerArgs at all: not a scheduler, nothing to size
                    sizes_draft.append(False)
            return read_draft_answer() if sizes_draft[0] else None

        @functools.wraps(update_batch)
        def _update_gather_batch(
            batch: Any, mlp_sync_info: Any, require_mlp_tp_gather: bool, *args: Any, **kwargs: Any
        ) -> Any:
            result = update_batch(batch, mlp_sync_info, require_mlp_tp_gather, *args, **kwargs)
            draft = draft_answer()
            counts = for_logprob = None  # the answers agree: the draft reads the target's lists
            if draft is not None and draft != bool(require_mlp_tp_gather):
                if draft:
                    counts = mlp_sync_info.global_num_tokens
                    for_logprob = mlp_sync_info.global_num_tokens_for_logprob
                else:
                    counts, for_logprob = [mlp_sync_info.num_tokens], [mlp_sync_info.num_tokens_for_logprob]
            batch.draft_global_num_tokens, batch.draft_global_num_tokens_for_logprob = counts, for_logprob
            return result

        @functools.wraps(forward_init)
        def init_new(cls: Any, batch: Any, model_runner: Any, *args: Any, **kwargs: Any) -> Any:
            counts = batch.draft_global_num_tokens
            if counts is None or getattr(model_runner, "is_draft_worker", False) is not True:
                return forward_init(cls, batch, model_runner, *args, **kwargs)
            target = batch.global_num_tokens, batch.global_num_tokens_for_logprob
            batch.global_num_tokens = counts
            batch.global_num_tokens_for_logprob = batch.draft_global_num_tokens_for_logprob
            try:
                return forward_init(cls, batch, model_runner, *args, **kwargs)
            finally:
                batch.global_num_tokens, batch.global_num_tokens_for_logprob = target

        return {
            UPDATE_BATCH: _update_gather_batch,
            FORWARD_INIT: classmethod(init_new),
            SB_COUNTS: None,
            SB_COUNTS_FOR_LOGPROB: None,
        }
