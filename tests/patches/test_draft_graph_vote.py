"""draft_graph_vote: the wire format in the real MLPSyncBatchInfo, the runner gate, and the multi-rank behaviour
of SGLang's real PD-decode round + DP MLP sync over 4 gloo ranks (stock arm vs patched arm)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from support import affected_only

from sglang_dp_mtp_fix import errors
from sglang_dp_mtp_fix.harness.pool import RankError
from sglang_dp_mtp_fix.patches import draft_graph_vote as dgv

pytestmark = affected_only

SEEDED = dict(kind="decode", seed=True)
SEEDLESS = dict(kind="decode", seed=False)
NONE = dict(kind="none")
IDLE = dict(kind="idle")


def _sync_info(decode_vote: bool = True):
    from sglang.srt.managers.scheduler_components.dp_attn import MLPSyncBatchInfo
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    kwargs = {}
    for f in dataclasses.fields(MLPSyncBatchInfo):
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
            continue
        if f.name in ("can_cuda_graph", "can_run_decode_cuda_graph"):
            kwargs[f.name] = decode_vote
        elif f.name == "local_forward_mode":
            kwargs[f.name] = ForwardMode.DECODE.value
        elif f.name in ("dp_size", "num_dp_ranks", "tp_size", "cp_size", "num_tokens", "num_tokens_for_logprob"):
            kwargs[f.name] = 1
        else:
            kwargs[f.name] = False
    return MLPSyncBatchInfo(**kwargs)


@pytest.mark.parametrize(("local_vote", "wire"), [(True, dgv.DECODE_YES_DRAFT_YES), (False, dgv.DECODE_YES_DRAFT_NO)])
def test_local_row_carries_an_independent_draft_vote(restored, local_vote, wire):
    """#32209 test_draft_graph_gate_has_independent_dp_vote, in this plugin's shape-preserving wire format."""
    restored.register()
    info = _sync_info(decode_vote=True)
    stock_width = info._get_fallback_tensor(device="cpu").numel()
    token = dgv._local_vote.set(local_vote)
    try:
        row = info._get_local_tensor(device="cpu")
    finally:
        dgv._local_vote.reset(token)
    assert row[dgv.DECODE_COLUMN].item() == wire
    assert bool(row[dgv.DECODE_COLUMN]) is True  # SGLang's own reading of the generic vote is unchanged
    assert info._get_fallback_tensor(device="cpu")[dgv.DECODE_COLUMN].item() == dgv.DECODE_YES_DRAFT_YES
    assert row.numel() in (stock_width, stock_width + 1)  # 0.5.20's local row carries one extra stock column
    restored.restore()
    assert _sync_info()._get_local_tensor(device="cpu")[dgv.DECODE_COLUMN].item() == 1  # stock again


def test_fallback_rows_are_fresh_encoded_copies_of_sglangs_row(restored):
    """The encoded fallback row is built once per device and dtype; every call still gets its own tensor (SGLang
    writes into the gathered buffer built from it), equal to SGLang's row but for the draft vote."""
    import torch

    stock = _sync_info()._get_fallback_tensor(device="cpu")
    restored.register()
    info = _sync_info()
    first, second = info._get_fallback_tensor(device="cpu"), info._get_fallback_tensor(device="cpu")
    assert first is not second and first.data_ptr() != second.data_ptr()
    first.fill_(7)  # a caller writing into its row changes no later row
    third = _sync_info()._get_fallback_tensor(device="cpu")
    want = stock.clone()
    want[dgv.DECODE_COLUMN] = dgv.DECODE_YES_DRAFT_YES
    assert torch.equal(second, want) and torch.equal(third, want)
    assert info._get_fallback_tensor(device="cpu", dtype=torch.int32).dtype == torch.int32  # per dtype
    restored.restore()
    assert torch.equal(_sync_info()._get_fallback_tensor(device="cpu"), stock)


def test_decode_no_stays_zero(restored):
    restored.register()
    token = dgv._local_vote.set(False)
    try:
        assert _sync_info(decode_vote=False)._get_local_tensor(device="cpu")[dgv.DECODE_COLUMN].item() == 0
    finally:
        dgv._local_vote.reset(token)


@pytest.mark.parametrize(
    ("column", "group"),
    [([3, 3, 3, 3], True), ([3, 2, 3, 3], False), ([0, 3, 3, 3], True), ([0, 2], False), ([2, 2], False)],
)
def test_group_vote_is_the_min_over_every_rank(column, group):
    assert dgv.decode_group_vote(column) is group


@pytest.mark.parametrize("column", [[3, 1, 3, 3], [1, 1], [3, 7]])
def test_ranks_without_the_plugin_fail_fast_naming_them(column):
    with pytest.raises(errors.MixedDeploymentError) as exc:
        dgv.decode_group_vote(column)
    bad = [i for i, v in enumerate(column) if v not in (0, 2, 3)]
    assert str(bad) in str(exc.value)


def _runner(require_mlp_sync: bool = True):
    from sglang.srt.speculative.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_dp_mtp_fix.harness.rank import draft_runner_standin

    runner = draft_runner_standin(EAGLEDraftCudaGraphRunner, SpeculativeAlgorithm.from_string("EAGLE"))
    runner.require_mlp_sync = require_mlp_sync
    return runner


def _forward_view(decode: bool, draft: bool | None):
    view = SimpleNamespace(
        spec_info=None, batch_size=1, global_num_tokens_cpu=[1, 0], original_global_num_tokens_cpu=[1, 0],
        can_run_dp_cuda_graph=decode, can_run_decode_cuda_graph=decode,
    )  # fmt: skip
    if draft is not None:
        view.can_run_dp_draft_cuda_graph = draft
    return view


def test_seedless_gate_only_disables_the_draft_graph(restored):
    """#32209 test_seedless_gate_only_disables_draft_graph, on the real can_run_graph."""
    restored.register()
    runner = _runner()
    assert runner.can_run_graph(_forward_view(decode=True, draft=False)) is False
    assert runner.can_run_graph(_forward_view(decode=True, draft=True)) is True
    assert runner.can_run_graph(_forward_view(decode=True, draft=None)) is True  # never synced: keeps graphs
    assert runner.can_run_graph(_forward_view(decode=False, draft=True)) is False
    assert _runner(require_mlp_sync=False).can_run_graph(_forward_view(decode=True, draft=False)) is True


def test_batches_that_never_synced_keep_graphs(restored):
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    restored.register()
    assert ScheduleBatch.can_run_dp_draft_cuda_graph is True and ForwardBatch.can_run_dp_draft_cuda_graph is True
    assert ScheduleBatch.force_disable_draft_cuda_graph is False


# ---- four real ranks --------------------------------------------------------------------------------------------


def _paths(results):
    return [r.draft_path for r in results]


def _arms(pool, states):
    pool.plugin("restore")
    stock = pool.round(states)
    pool.plugin("apply")
    patched = pool.round(states)
    return stock, patched


def test_seedless_active_rank_with_idle_ranks(rank_pool):
    stock, patched = _arms(rank_pool, [SEEDLESS, NONE, IDLE, NONE])
    # control arm: the stock ranks split (the hang): the seedless rank goes eager, idle ranks replay the graph
    assert _paths(stock) == ["eager", "graph", "graph", "graph"]
    # patched: every rank refuses the draft graph, the generic decode/verify vote stays True
    assert _paths(patched) == ["eager"] * 4
    assert all(r.decode_graph is True for r in patched)
    assert all(r.draft_vote is False for r in patched)
    assert all(r.forward_batch_draft_vote is False for r in patched)  # carried by the real ForwardBatch.init_new
    assert all(r.forward_batch_draft_vote is None for r in stock)
    assert patched[0].force_disable_draft_cuda_graph is True
    assert [r.eager_cause for r in patched] == ["own seedless batch"] + ["another rank's vote"] * 3


def test_all_seeded_keeps_draft_graph_everywhere(rank_pool):
    stock, patched = _arms(rank_pool, [SEEDED, SEEDED, NONE, SEEDED])
    assert _paths(stock) == _paths(patched) == ["graph"] * 4
    assert all(r.draft_vote is True and r.decode_graph is True for r in patched)


def test_overlap_merge_of_seeded_running_and_seedless_prebuilt(rank_pool):
    merged = dict(kind="decode", seed=True, overlap=True, merge_seedless_prebuilt=True)
    stock, patched = _arms(rank_pool, [merged, SEEDED, IDLE, SEEDED])
    assert _paths(stock) == ["eager", "graph", "graph", "graph"]
    assert _paths(patched) == ["eager"] * 4


def test_future_seed_present_keeps_graph(rank_pool):
    future_seeded = dict(kind="decode", seed=False, overlap=True, future_flag=True)
    stock, patched = _arms(rank_pool, [future_seeded, SEEDED, NONE, IDLE])
    assert _paths(stock) == _paths(patched) == ["graph"] * 4


def test_no_draft_worker_and_non_seeding_worker_never_force_eager(rank_pool):
    pp_rank = dict(kind="decode", seed=False, has_draft_worker=False)
    no_seeding = dict(kind="decode", seed=False, seed_from_draft_extend=False)
    _, patched = _arms(rank_pool, [pp_rank, no_seeding, SEEDED, NONE])
    assert _paths(patched) == ["graph"] * 4


def test_a_rank_without_the_plugin_stops_the_group_instead_of_hanging(rank_pool):
    rank_pool.plugin(["apply", "apply", "apply", "restore"])
    try:
        with pytest.raises(RankError, match=r"(?s)MixedDeploymentError.*DP rank\(s\) \[3\]"):
            rank_pool.round([SEEDED, SEEDED, SEEDED, SEEDED])
    finally:
        rank_pool.plugin("restore")
    # the group is still usable: the collective itself completed on every rank
    assert _paths(rank_pool.round([SEEDED, SEEDED, SEEDED, SEEDED])) == ["graph"] * 4
