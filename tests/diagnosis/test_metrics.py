"""Vote counters on SGLang's Prometheus endpoint: real ranks, real prometheus_client in multiprocess mode (SGLang's
setup), the directory read back by the collector SGLang's /metrics uses. The real server's /metrics: tests/launch."""

from __future__ import annotations

import pytest
from support import affected_only

from diagnosis.test_stats import SCRIPT, SEEDED
from sglang_dp_mtp_fix import __version__
from sglang_dp_mtp_fix.diagnosis import metrics

pytestmark = affected_only
prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry  # noqa: E402
from prometheus_client.multiprocess import MultiProcessCollector  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


def scrape(directory) -> dict[str, list]:
    """What SGLang's /metrics would serve from this directory: family name -> samples."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    text = prometheus_client.generate_latest(registry).decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def rank_labels(rank: int) -> dict[str, str]:  # the keys SGLang's scheduler collector uses (0.5.20)
    return {
        "model_name": "m",
        "engine_type": "decode",
        "tp_rank": str(rank),
        "pp_rank": "0",
        "moe_ep_rank": "0",
        "dp_rank": str(rank),
    }


def by_rank(samples, name: str, key: str) -> dict[tuple[str, str], float]:
    return {(s.labels["dp_rank"], s.labels[key]): s.value for s in samples if s.name == name}


def test_metrics_count_a_scripted_trace_exactly_per_rank(rank_pool, tmp_path):
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    rank_pool.plugin({"command": "apply", "env": env})
    try:
        lines = rank_pool.plugin(
            [{"command": "export_metrics", "env": env, "labels": rank_labels(r)} for r in range(4)]
        )
        for states in SCRIPT:
            rank_pool.round(states)
        totals = [r["stats"] for r in rank_pool.plugin("stats")]
    finally:
        rank_pool.plugin("restore")
    exported = [r["line"] for r in lines]  # what metrics.install returned on each rank
    assert all(
        e.exported and e.line.startswith("sglang-dp-mtp-fix: vote counters exported on SGLang's /metrics as")
        for e in exported
    )
    assert totals[0]["decode_batches"] == 4  # counted without SGLANG_DP_MTP_FIX_STATS: --enable-metrics alone
    got = scrape(tmp_path)
    decode = [s for s in got[metrics.DECODE_BATCHES] if s.name.endswith("_total")]
    draft = {}
    for s in decode:
        key = (s.labels["dp_rank"], s.labels["draft_vote"])
        draft[key] = draft.get(key, 0) + s.value
        assert s.labels["generic_vote"] == "graph_eligible" or s.value == 0, s  # every round's generic vote: yes
    # test_stats' trace: each rank counts 4 rounds, 2 of them forced eager together
    assert draft == {(str(r), v): 2.0 for r in range(4) for v in ("graph_eligible", "forced_eager")}
    cause = by_rank(got[metrics.FORCED_EAGER], metrics.FORCED_EAGER + "_total", "cause")
    own, other = "own_seedless_batch", "other_rank_vote"
    assert cause == {
        ("0", own): 1,
        ("0", other): 1,
        ("1", own): 1,
        ("1", other): 1,
        ("2", own): 1,
        ("2", other): 1,
        ("3", own): 0,
        ("3", other): 2,
    }
    info = [s for s in got[metrics.PATCH_INFO]]
    assert {(s.labels["dp_rank"], s.labels["patch"]) for s in info} >= {(str(r), "draft_graph_vote") for r in range(4)}
    assert all(
        s.value == 1 and s.labels["version"] == __version__ and s.labels["tp_rank"] == s.labels["dp_rank"] for s in info
    )
    assert {s.labels["status"] for s in info if s.labels["patch"] == "draft_graph_vote"} == {"applied"}


def test_no_metrics_without_sglang_metrics_or_when_switched_off(rank_pool, tmp_path):
    for env in ({}, {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "SGLANG_DP_MTP_FIX_METRICS": "off"}):
        rank_pool.plugin({"command": "apply", "env": env} if env else "apply")
        try:
            rank_pool.round([SEEDED] * 4)
            # nothing counts, so the vote wrapper was built without counting code, and nothing can be exported
            assert [r["stats"] for r in rank_pool.plugin("stats")] == [None] * 4
        finally:
            rank_pool.plugin("restore")
    assert not list(tmp_path.iterdir())


def test_liveness_gauge_and_stall_counter_follow_the_monitor(tmp_path, monkeypatch):
    """Issue 33: the monitor's ticks land on the scheduler's labels (in-process registry: the families are created in
    this process the way a scheduler creates them; the multiprocess read-back is the launch tier's)."""
    from types import SimpleNamespace

    from sglang_dp_mtp_fix.diagnosis import monitor

    scheduler = SimpleNamespace(metrics_collector=SimpleNamespace(labels=rank_labels(1)))
    watcher = monitor.Monitor(stall_s=5, dp_rank=1)
    result = metrics.install_liveness(scheduler, watcher)
    assert result is not None and result.exported, result
    assert watcher.on_tick is not None
    watcher.on_tick(7.5, True)
    watcher.on_tick(8.5, False)
    registry = prometheus_client.REGISTRY
    assert registry.get_sample_value(metrics.SINCE_ROUND, rank_labels(1)) == 8.5
    assert registry.get_sample_value(metrics.STALLS + "_total", rank_labels(1)) == 1.0
    assert metrics.install_liveness(SimpleNamespace(metrics_collector=None), watcher) is None
    clash = SimpleNamespace(metrics_collector=SimpleNamespace(labels={**rank_labels(0), "cause": "x"}))
    refused = metrics.install_liveness(clash, monitor.Monitor(stall_s=5))
    assert refused is not None and not refused.exported and "cause" in refused.line
