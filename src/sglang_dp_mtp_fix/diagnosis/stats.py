"""Vote counters: every N decode batches a rank logs one line (``SGLANG_DP_MTP_FIX_STATS=<N>``), and/or each
decode batch is exported to SGLang's Prometheus endpoint (``metrics``, when SGLang runs with ``--enable-metrics``).

Decided at load: with neither, ``counting_update`` and ``counting_refusals`` hand the vote's wrappers back unchanged
(no counting code at all); with either, they stack a counting wrapper on them, as the recorder does.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

logger = logging.getLogger("sglang_dp_mtp_fix.stats")

OWN_SEEDLESS = "own seedless batch"
OTHER_RANK = "another rank's vote"


@dataclass
class Totals:
    decode_batches: int = 0
    generic_graph_true: int = 0
    generic_graph_false: int = 0
    draft_graph_true: int = 0
    draft_graph_false: int = 0
    eager_own_seedless: int = 0
    eager_other_rank_vote: int = 0
    # eager draft steps the vote did not force: the draft runner refused the graph (e.g. a batch above the captured
    # sizes; counted per refusal), or this scheduler runs without CUDA graphs (counted per decode batch)
    eager_runner_refused: int = 0
    eager_graphs_off: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


# generic decode vote, draft group vote, this rank's own draft vote (see VoteStats.record)
Exporter = Callable[[bool, bool, bool], None]
# why a draft step ran eager: OWN, GROUP, REFUSED, GRAPHS_OFF (metrics label values)
REASON_OWN, REASON_GROUP, REASON_REFUSED, REASON_GRAPHS_OFF = (
    "seedless_here",
    "group_vote",
    "runner_refused",
    "graphs_off",
)


class VoteStats:
    def __init__(self, every: int | None):
        self.every = every  # None: no log lines (counting for the metrics exporter only)
        self.window = Totals()
        self.total = Totals()
        self.exporter: Exporter | None = None  # set at scheduler start when SGLang's metrics are on (``metrics``)
        self.reason_exporter: Callable[[str], None] | None = None  # likewise: one eager draft step by reason
        self.graphs_off = False  # set at scheduler start: SGLang runs without CUDA graphs (--disable-cuda-graph)

    def runner_refused(self) -> None:
        """The draft runner refused its graph although the group voted yes (``can_run_graph`` said no itself)."""
        self.window.eager_runner_refused += 1
        self.total.eager_runner_refused += 1
        if self.reason_exporter is not None:
            self.reason_exporter(REASON_REFUSED)

    def record(self, generic_graph: bool, draft_graph: bool, local_vote: bool) -> None:
        for t in (self.window, self.total):
            t.decode_batches += 1
            if generic_graph:
                t.generic_graph_true += 1
            else:
                t.generic_graph_false += 1
            if draft_graph:
                t.draft_graph_true += 1
                if self.graphs_off:
                    t.eager_graphs_off += 1
            else:
                t.draft_graph_false += 1
                if not local_vote:
                    t.eager_own_seedless += 1
                else:
                    t.eager_other_rank_vote += 1
        if self.exporter is not None:
            self.exporter(generic_graph, draft_graph, local_vote)
        if self.reason_exporter is not None and (self.graphs_off or not draft_graph):
            self.reason_exporter(REASON_GRAPHS_OFF if draft_graph else REASON_GROUP if local_vote else REASON_OWN)
        if self.every is not None and self.window.decode_batches >= self.every:
            w = self.window
            # Votes, not graph use: "graph-eligible" means no rank asked for eager, which is all the vote can know
            # (whether a graph then runs also needs CUDA graphs enabled and captured for that batch size).
            logger.info(
                "sglang-dp-mtp-fix stats (last %d decode batches): generic decode vote graph-eligible=%d eager=%d; "
                "draft vote graph-eligible=%d forced-eager=%d; forced-eager by cause: %s=%d, %s=%d",
                w.decode_batches, w.generic_graph_true, w.generic_graph_false, w.draft_graph_true,
                w.draft_graph_false, OWN_SEEDLESS, w.eager_own_seedless, OTHER_RANK, w.eager_other_rank_vote,
            )  # fmt: skip
            logger.info(
                "sglang-dp-mtp-fix eager draft steps by reason (last %d decode batches): seedless here=%d, group "
                "vote=%d, runner refused=%d, graphs off=%d",
                w.decode_batches, w.eager_own_seedless, w.eager_other_rank_vote, w.eager_runner_refused,
                w.eager_graphs_off,
            )  # fmt: skip
            self.window = Totals()


_active: VoteStats | None = None
# The settings (``configure``, from the plugin's ``diagnosis.wiring``): log every N decode batches; count for /metrics
_every: int | None = None
_for_metrics = False


def configure(every: int | None, for_metrics: bool = False) -> None:
    """At load, before the vote is built: what ``activate`` builds."""
    global _every, _for_metrics
    _every, _for_metrics = every, for_metrics


def activate() -> VoteStats | None:
    """The counters the vote wrapper records into (as ``configure`` set), or None: then it is built without counting
    code."""
    global _active
    _active = VoteStats(_every or None) if _every or _for_metrics else None
    return _active


def active() -> VoteStats | None:
    return _active


def deactivate() -> None:
    """Drop the counters (the plugin's ``restore``): a later scheduler or apply never sees a previous run's."""
    global _active
    _active = None


_F = TypeVar("_F", bound=Callable[..., Any])


def counting_update(
    counters: VoteStats | None,
    update_batch: _F,
    vote_attr: str,
    generic_field: str,
    local_vote: ContextVar[bool | None],
) -> _F:
    """The vote's ``_update_gather_batch`` (which sets the group's draft vote on the batch as ``vote_attr``) with each
    decode batch's votes counted after it; unchanged without ``counters``."""
    if counters is None:
        return update_batch

    @functools.wraps(update_batch)
    def _update_gather_batch(batch: Any, *args: Any, **kwargs: Any) -> Any:
        result = update_batch(batch, *args, **kwargs)
        if batch.forward_mode.is_decode_or_idle():
            group_draft = bool(getattr(batch, vote_attr, True))
            counters.record(bool(getattr(batch, generic_field, False)), group_draft, local_vote.get() is not False)
        return result

    return _update_gather_batch  # type: ignore[return-value]


def counting_refusals(counters: VoteStats | None, runner_gate: _F) -> _F:
    """SGLang's own ``can_run_graph`` with its refusals counted (e.g. a batch above the captured sizes); the vote
    wraps this one, so the vote's no is never counted as the runner's. Unchanged without ``counters``."""
    if counters is None:
        return runner_gate

    @functools.wraps(runner_gate)
    def can_run_graph(self: Any, forward_batch: Any) -> Any:
        ok = runner_gate(self, forward_batch)
        if not ok:
            counters.runner_refused()
        return ok

    return can_run_graph  # type: ignore[return-value]
