"""upstream_vote_watch (issue 33, item 8): the recorder and the stall counters on SGLang's own draft vote (0.5.21+).

REAL: SGLang 0.5.23's ``SchedulerDPAttnAdapter.maybe_prepare_mlp_sync_batch``, MLP sync, ``_update_gather_batch``,
``ForwardBatch.init_new`` and ``EAGLEDraftCudaGraphRunner.can_run_graph`` on the 4 gloo ranks of the shared
``rank_pool`` (the harness's stand-ins: ``harness/standins.py``; on 0.5.21+ its PD producer marks a seedless input
``cuda_graph_compatible=False``, as SGLang's does). The injected divergence is the harness's TEST-ONLY
``_flip_draft_path`` switch. Fault injection on the watch's targets: ``tests/test_faults.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from releases import SGLANG_VERSION, SUPERSEDED
from support import written

from sglang_dp_mtp_fix import rollcall
from sglang_dp_mtp_fix.config import RECORDER_DIR_ENV
from sglang_dp_mtp_fix.diagnosis import monitor, reader, recorder

pytestmark = pytest.mark.skipif(
    SGLANG_VERSION not in SUPERSEDED, reason=f"SGLang's own draft vote decides only on {', '.join(SUPERSEDED)}"
)

SEEDED = {"kind": "decode", "seed": True, "num_reqs": 3}


def files(directory: Path) -> list[Path]:
    return sorted(directory.glob("sglang-dp-mtp-fix-*.rec"))


def paths(results: list[list[Any]]) -> list[list[tuple[str, bool, bool]]]:
    """Per round and rank: what SGLang decided (draft path, group draft vote, generic decode vote)."""
    return [[(r.draft_path, r.draft_vote, r.decode_graph) for r in rnd] for rnd in results]


def test_records_sglangs_own_votes_changes_none_and_rollcall_names_the_divergence(rank_pool, tmp_path):
    trace = [[dict(SEEDED) for _ in range(4)] for _ in range(12)]
    trace[4][1] = {"kind": "decode", "seed": False, "num_reqs": 2}  # seedless: SGLang's own vote sends all eager
    trace[8][2]["_flip_draft_path"] = True  # round 9 as the recorder counts: rank 2 alone turns eager
    rank_pool.plugin("restore")
    stock = rank_pool.run_trace(trace, collective=False)
    applied = rank_pool.plugin({"command": "apply", "env": {RECORDER_DIR_ENV: str(tmp_path)}})
    try:
        watched = rank_pool.run_trace(trace, collective=False)
        written(str(tmp_path), 4, 12)
        data, code = rollcall.rollcall([str(tmp_path)])
    finally:
        rank_pool.plugin("restore")
    assert [a["statuses"]["upstream_vote_watch"] for a in applied] == ["applied"] * 4, applied
    assert paths(watched) == paths(stock)  # the watch decides nothing
    assert {r.draft_path for r in stock[4]} == {"eager"} and [r.draft_path for r in stock[8]][2] == "eager"
    assert code == 1 and data["verdict"] == "diverge", data["answer"]
    assert data["answer"] == (
        "round 9: ranks [0, 1, 3] draft graph (bucket 8), rank [2] eager (after a graph vote: decided outside the vote)"
    )
    assert [r["last_round"] for r in data["ranks"]] == [12] * 4 and not data["missing_ranks"]
    # The seedless round as SGLang decided it: rank 1's row voted no, the group's column no, every rank eager.
    by_rank = {f.dp_rank: f for f in map(reader.read_file, map(str, files(tmp_path)))}
    seedless = {rank: f.records[5].as_dict() for rank, f in by_rank.items()}
    assert seedless[1]["draft_vote_sent"] is False and seedless[0]["draft_vote_sent"] is True, seedless
    assert {v["draft_vote_group"] for v in seedless.values()} == {False}, seedless
    assert {v["draft_path"] for v in seedless.values()} == {"eager"}, seedless
    assert {by_rank[r].records[3].as_dict()["draft_path"] for r in by_rank} == {"graph"}


def test_without_a_recorder_only_the_sync_entry_is_wrapped_and_it_counts_rounds(restored, monkeypatch):
    from sglang.srt.managers.scheduler_components import dp_attn
    from sglang.srt.speculative import eagle_draft_cuda_graph_runner as runner

    monkeypatch.delenv(RECORDER_DIR_ENV, raising=False)

    def seams() -> tuple[Any, ...]:
        return (
            dp_attn.MLPSyncBatchInfo._get_local_tensor,
            dp_attn._update_gather_batch,
            runner.EAGLEDraftCudaGraphRunner.can_run_graph,
        )

    stock = seams()
    entry = dp_attn.SchedulerDPAttnAdapter.maybe_prepare_mlp_sync_batch
    outcomes = {o.id: o.status.value for o in restored.register()}
    assert outcomes["upstream_vote_watch"] == "applied" and outcomes["draft_graph_vote"] == "superseded", outcomes
    assert recorder.active() is None
    assert all(a is b for a, b in zip(seams(), stock, strict=True))  # SGLang's own, by identity
    wrapped = dp_attn.SchedulerDPAttnAdapter.maybe_prepare_mlp_sync_batch
    assert wrapped is not entry and wrapped.__wrapped__ is entry

    class Adapter:  # the sync entry's own self: SGLang's body asks it whether to sync (here: no)
        def get_require_mlp_sync(self) -> bool:
            return False

    before = monitor.PROGRESS.entered
    batch = object()
    assert wrapped(Adapter(), batch) is batch  # SGLang's result, unchanged
    assert monitor.PROGRESS.entered == monitor.PROGRESS.finished == before + 1 and monitor.PROGRESS.busy
    restored.restore()
    assert dp_attn.SchedulerDPAttnAdapter.maybe_prepare_mlp_sync_batch is entry
