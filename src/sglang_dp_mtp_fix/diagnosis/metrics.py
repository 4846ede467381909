"""The plugin's vote counters on SGLang's Prometheus endpoint (SGLang launched with ``--enable-metrics``).

SGLang's scheduler metrics are ``prometheus_client`` metrics in multiprocess mode: every scheduler process writes its
samples under ``PROMETHEUS_MULTIPROC_DIR`` and the HTTP server's ``/metrics`` adds them up. At the end of the first
``Scheduler.__init__`` of a scheduler that has SGLang's own metrics collector, the plugin creates its metrics next to
SGLang's: same directory, same ``sglang:`` prefix, the collector's own labels (model_name, engine_type, tp_rank,
pp_rank, moe_ep_rank, dp_rank, ...). From then on every decode batch the vote wrapper counts (``stats``) is added.

Whether the vote wrapper counts at all is decided at load (``Config.export_metrics``): SGLang's launcher sets
``PROMETHEUS_MULTIPROC_DIR`` before it starts the schedulers exactly when metrics are on. Without it (or with
``SGLANG_DP_MTP_FIX_METRICS=off``) nothing here runs and the vote path carries no counting code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from sglang_dp_mtp_fix.core import Outcome
from sglang_dp_mtp_fix.diagnosis import stats

PREFIX = "sglang:dp_mtp_fix_"
DECODE_BATCHES = PREFIX + "decode_batches"  # exposed as ..._total (a Counter)
FORCED_EAGER = PREFIX + "forced_eager_draft_batches"
PATCH_INFO = PREFIX + "patch_info"
EAGER_DRAFT = PREFIX + "eager_draft_steps"  # exposed as ..._total, by reason
SINCE_ROUND = PREFIX + "seconds_since_mlp_sync_round"
STALLS = PREFIX + "stalls"  # exposed as ..._total (a Counter)
GRAPH_ELIGIBLE, EAGER, FORCED_EAGER_VOTE = "graph_eligible", "eager", "forced_eager"
CAUSE_OWN, CAUSE_OTHER = "own_seedless_batch", "other_rank_vote"
OWN_LABELS = ("generic_vote", "draft_vote", "cause", "reason", "version", "patch", "status")

_families: dict[str, Any] = {}  # created once per process (prometheus_client refuses a second registration)


def _family(kind: str, name: str, doc: str, labelnames: Sequence[str]) -> Any:
    import prometheus_client  # SGLang imports it only after PROMETHEUS_MULTIPROC_DIR is set; so does this

    if name not in _families:
        if kind == "counter":
            _families[name] = prometheus_client.Counter(name, doc, labelnames=labelnames)
        else:
            _families[name] = prometheus_client.Gauge(name, doc, labelnames=labelnames, multiprocess_mode="mostrecent")
    return _families[name]


class MetricsExport(NamedTuple):
    """What ``install`` did: ``exported`` or not, and the one line that says so (INFO when exported, else WARNING)."""

    exported: bool
    line: str


def _not_exported(why: str) -> MetricsExport:
    return MetricsExport(False, f"sglang-dp-mtp-fix: vote counters not exported to /metrics: {why}")


def _scheduler_labels(scheduler: Any) -> tuple[dict[str, str], MetricsExport | None]:
    """SGLang's own scheduler-metrics labels, or why they cannot be used."""
    collector = getattr(scheduler, "metrics_collector", None)
    labels = {str(k): str(v) for k, v in dict(getattr(collector, "labels", None) or {}).items()}
    clash = sorted(set(labels) & set(OWN_LABELS))
    if not labels or clash:
        return labels, _not_exported(
            "SGLang's scheduler metrics labels "
            + (f"use the plugin's own label names {clash}" if clash else "were not found on its metrics collector")
        )
    return labels, None


def install_liveness(scheduler: Any, watcher: Any) -> MetricsExport | None:
    """This scheduler's liveness on /metrics: the seconds since its last finished MLP-sync round (a gauge, set each
    monitor tick) and its stalls (a counter). ``watcher``: the ``monitor.Monitor`` of this process."""
    if getattr(scheduler, "metrics_collector", None) is None or watcher is None:
        return None
    labels, problem = _scheduler_labels(scheduler)
    if problem is not None:
        return problem
    try:
        since = _family(
            "gauge",
            SINCE_ROUND,
            "Seconds since this scheduler last finished an MLP-sync round, set about once a second by the plugin's "
            "monitor thread (sglang-dp-mtp-fix). Grows while the rank is stuck; near 0 while the group runs.",
            list(labels),
        ).labels(**labels)
        stalls = _family(
            "counter",
            STALLS,
            "Stalls of this scheduler: SGLANG_DP_MTP_FIX_STALL_S seconds without a finished MLP-sync round while the "
            "group had work (each also one WARNING line in the log) (sglang-dp-mtp-fix).",
            list(labels),
        ).labels(**labels)
    except ImportError as exc:
        return _not_exported(str(exc))

    def on_tick(seconds: float, new_stall: bool) -> None:
        since.set(seconds)
        if new_stall:
            stalls.inc()

    watcher.on_tick = on_tick
    return MetricsExport(True, f"sglang-dp-mtp-fix: liveness exported on SGLang's /metrics as {SINCE_ROUND}, {STALLS}")


def install(scheduler: Any, outcomes: Sequence[Outcome], version: str) -> MetricsExport | None:
    """Export this scheduler's vote counters. None when nothing is to be exported here (counting not built, or a
    scheduler without SGLang's collector: SGLang exports nothing from it either)."""
    counters = stats.active()
    collector = getattr(scheduler, "metrics_collector", None)
    if counters is None or collector is None:
        return None
    labels, problem = _scheduler_labels(scheduler)
    if problem is not None:
        return problem
    try:
        decode = _family(
            "counter",
            DECODE_BATCHES,
            "Decode (and idle) batches by the generic decode-graph vote and the draft-graph group vote of their "
            "DP round (sglang-dp-mtp-fix). graph_eligible: no rank asked for eager.",
            [*labels, "generic_vote", "draft_vote"],
        )
        forced = _family(
            "counter",
            FORCED_EAGER,
            "Decode batches whose draft step ran eager on every DP rank together, by cause on this rank: its own "
            "batch had no DSA top-k seed, or another rank's vote (sglang-dp-mtp-fix).",
            [*labels, "cause"],
        )
        eager = _family(
            "counter",
            EAGER_DRAFT,
            "Draft steps that ran eager, by reason: seedless_here (this rank's batch had no DSA top-k seed), "
            "group_vote (another rank's), runner_refused (the draft runner refused its graph, e.g. a batch above the "
            "captured sizes), graphs_off (SGLang runs without CUDA graphs) (sglang-dp-mtp-fix).",
            [*labels, "reason"],
        )
        info = _family(
            "gauge",
            PATCH_INFO,
            "sglang-dp-mtp-fix version and each patch's status in this process (value 1).",
            [*labels, "version", "patch", "status"],
        )
    except ImportError as exc:
        return _not_exported(str(exc))
    # Every series exists from the start (at 0), so dashboards and rate() see them before the first eager round.
    by_vote = {
        (generic, draft): decode.labels(
            **labels,
            generic_vote=GRAPH_ELIGIBLE if generic else EAGER,
            draft_vote=GRAPH_ELIGIBLE if draft else FORCED_EAGER_VOTE,
        )
        for generic in (True, False)
        for draft in (True, False)
    }
    own_seedless = forced.labels(**labels, cause=CAUSE_OWN)
    other_rank = forced.labels(**labels, cause=CAUSE_OTHER)
    for o in outcomes:
        info.labels(**labels, version=version, patch=o.id, status=o.status.value).set(1)

    def export(generic_graph: bool, draft_graph: bool, local_vote: bool) -> None:
        by_vote[generic_graph, draft_graph].inc()
        if not draft_graph:
            (other_rank if local_vote else own_seedless).inc()

    by_reason = {
        reason: eager.labels(**labels, reason=reason)
        for reason in (stats.REASON_OWN, stats.REASON_GROUP, stats.REASON_REFUSED, stats.REASON_GRAPHS_OFF)
    }

    def export_reason(reason: str) -> None:
        by_reason[reason].inc()

    counters.exporter = export
    counters.reason_exporter = export_reason
    shown = ", ".join(f"{k}={v}" for k, v in labels.items() if k in ("tp_rank", "dp_rank"))
    return MetricsExport(True, f"sglang-dp-mtp-fix: vote counters exported on SGLang's /metrics as {PREFIX}* ({shown})")
