"""arrival_seed (issue 53): a seedless PD arrival gets a DSA top-k seed, so the draft graph replays.

REAL SGLang throughout (``harness/arrival.py`` names the stand-ins): the PD metadata buffers as a seedless prefill
leaves them, ``DecodeTransferQueue._commit_transfer_to_req``, ``build_eagle_disagg_draft_input``, and on the 4 gloo
ranks of ``rank_pool`` SGLang's PD-decode round and DP MLP sync with the plugin's vote (0.5.15.post1-0.5.20) or
SGLang's own (0.5.21+).
"""

from __future__ import annotations

import pytest
import torch
from releases import AFFECTED, SGLANG_VERSION, SUPERSEDED

from sglang_dp_mtp_fix.config import ARRIVAL_SEED_ENV, ArrivalSeed
from sglang_dp_mtp_fix.harness import arrival as pd
from sglang_dp_mtp_fix.patches import arrival_seed

pytestmark = pytest.mark.skipif(
    SGLANG_VERSION not in (*AFFECTED, *SUPERSEDED), reason=f"SGLang {SGLANG_VERSION} sends no DSA seed through PD"
)

TOPK = 8  # index_topk of the stand-in model (GLM-5: 2048)


@pytest.fixture()
def seeding(restored, monkeypatch):
    """The plugin applied in this process with ``SGLANG_DP_MTP_FIX_ARRIVAL_SEED=<mode>``."""

    def apply(mode: str) -> None:
        monkeypatch.setenv(ARRIVAL_SEED_ENV, mode)
        restored.restore()
        statuses = {o.id: o.status.value for o in restored.register()}
        assert statuses["arrival_seed"] == ("disabled" if mode == "off" else "applied"), statuses

    return apply


def _queue(width: int = TOPK, index_topk: int = TOPK, speculative: bool = True):
    return pd.transfer_queue(pd.metadata_buffers(width), index_topk, speculative)


def _seeded_row(width: int = TOPK):
    """What SGLang's own commit gives a seeded arrival (the prefill sent a seed): the row to look like."""
    return pd.arrive(_queue(width), 3, seed=torch.tensor([2, 0, 1], dtype=torch.int32)).output_dsa_topk_indices


def _positions(row) -> list[int]:
    return row.tolist()


@pytest.mark.parametrize("mode", ["exact", "recent"])
@pytest.mark.parametrize("prompt_len", [1, 5, TOPK])
def test_a_seedless_arrival_whose_prompt_fits_index_topk_gets_the_exact_seed(seeding, mode, prompt_len):
    assert pd.arrive(_queue(), prompt_len).output_dsa_topk_indices is None  # stock: seedless
    seeding(mode)
    row = pd.arrive(_queue(), prompt_len).output_dsa_topk_indices
    assert row is not None
    assert _positions(row) == list(range(prompt_len)) + [-1] * (TOPK - prompt_len)
    like = _seeded_row()
    assert (row.dtype, row.shape, row.device) == (like.dtype, like.shape, like.device)
    assert (row.dtype, row.shape) == (torch.int32, (TOPK,))


def test_a_longer_prompt_gets_the_recency_stand_in_under_recent_and_stays_seedless_under_exact(seeding):
    seeding("recent")
    assert _positions(pd.arrive(_queue(), 13).output_dsa_topk_indices) == list(range(13 - TOPK, 13))
    assert list(arrival_seed.recent_positions(13, TOPK)) == list(range(5, 13))  # the stand-in, by name
    seeding("exact")
    assert pd.arrive(_queue(), 13).output_dsa_topk_indices is None  # left to the vote


def test_the_kv_length_is_the_prebuilt_batchs(seeding):
    """A rebootstrapped request (output tokens before its retraction) is seeded over its whole KV."""
    seeding("exact")
    queue = _queue()
    req = pd.arrive(queue, 3)
    req.output_ids.extend([8, 9])  # two more tokens were emitted, then it was retracted and re-transferred
    req.output_dsa_topk_indices = None
    arrival_seed.seed_arrival(queue, req, ArrivalSeed.EXACT)
    assert arrival_seed.kv_length(req) == 3 + 2 and _positions(req.output_dsa_topk_indices)[:6] == [0, 1, 2, 3, 4, -1]


def test_what_it_leaves_alone(seeding):
    seeding("recent")
    seeded = pd.arrive(_queue(), 5, seed=torch.tensor([4, 1], dtype=torch.int32)).output_dsa_topk_indices
    assert _positions(seeded)[:3] == [4, 1, -1]  # the prefill's own seed is kept
    assert pd.arrive(_queue(speculative=False), 5).output_dsa_topk_indices is None  # no speculative decoding here
    assert pd.arrive(_queue(width=0), 5).output_dsa_topk_indices is None  # the model sends no seed
    # a wider row (0.5.20+'s index_kpool > 1) holds pooled entries, not positions
    assert pd.arrive(_queue(width=TOPK + 3, index_topk=TOPK), 5).output_dsa_topk_indices is None
    req = pd.arrive(_queue(), 5, room=pd.ROOM + 1)  # a corrupted transfer: SGLang aborts it
    assert req.output_dsa_topk_indices is None and len(req.output_ids) == 0 and req.finished_reason is not None


@pytest.mark.parametrize("overlap", [True, False])
def test_sglangs_own_pd_draft_input_sees_a_seeded_arrival(seeding, overlap):
    stock = pd.pd_draft_input([pd.arrive(_queue(), 5)], TOPK, overlap)
    assert stock.dsa_topk_indices is None
    seeding("recent")
    queue = _queue()
    reqs = [pd.arrive(queue, 5, slot=0, rid="short"), pd.arrive(queue, 13, slot=1, rid="long")]
    draft_input = pd.pd_draft_input(reqs, TOPK, overlap)
    assert draft_input.dsa_topk_indices is not None
    assert draft_input.dsa_topk_indices.tolist() == [[0, 1, 2, 3, 4, -1, -1, -1], list(range(5, 13))]
    if overlap:
        assert stock.future_dsa_topk_indices_available is False
        assert draft_input.future_dsa_topk_indices_available is True
    if "cuda_graph_compatible" in getattr(type(draft_input), "__dataclass_fields__", {}):  # 0.5.21+: SGLang's vote
        assert stock.cuda_graph_compatible is False and draft_input.cuda_graph_compatible is True


# ---- four real ranks --------------------------------------------------------------------------------------------

ARRIVAL = dict(kind="decode", overlap=True, arrival=dict(prompt_len=5, index_topk=TOPK))
SEEDED = dict(kind="decode", seed=True)
NONE = dict(kind="none")
IDLE = dict(kind="idle")
STATES = [ARRIVAL, NONE, IDLE, SEEDED]


def _round(pool, env: dict[str, str] | None):
    """One round of STATES with the plugin applied under ``env`` (None: stock)."""
    pool.plugin("restore")
    try:
        if env is not None:
            applied = pool.plugin({"command": "apply", "env": env})
            want = "disabled" if env.get(ARRIVAL_SEED_ENV, "off") == "off" else "applied"
            assert [a["statuses"]["arrival_seed"] for a in applied] == [want] * 4, applied
        return pool.round(STATES)
    finally:
        pool.plugin("restore")


def test_the_group_keeps_the_draft_graph_when_a_rank_had_a_seedless_arrival(rank_pool):
    seeded = _round(rank_pool, {ARRIVAL_SEED_ENV: "exact"})
    assert [r.draft_path for r in seeded] == ["graph"] * 4
    assert all(r.decode_graph is True for r in seeded)
    assert all(r.draft_vote is True for r in seeded)  # the plugin's vote, or SGLang's own (0.5.21+)
    if SGLANG_VERSION in AFFECTED:
        assert seeded[0].force_disable_draft_cuda_graph is False  # eager_draft_gate's predicate: graph


def test_control_arm_setting_off_still_votes_eager(rank_pool):
    off = _round(rank_pool, {ARRIVAL_SEED_ENV: "off"})
    assert [r.draft_path for r in off] == ["eager"] * 4  # the vote keeps the group together, all eager
    assert all(r.draft_vote is False for r in off)
    assert off[0].eager_cause == "own seedless batch"
    stock = _round(rank_pool, None)
    if SGLANG_VERSION in AFFECTED:
        assert [r.draft_path for r in stock] == ["eager", "graph", "graph", "graph"]  # stock splits: the hang
    else:
        assert [r.draft_path for r in stock] == ["eager"] * 4  # SGLang's own vote


# ---- the setting where the operator sees it -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["exact", "off"])
def test_doctor_and_the_report_line_show_the_setting(mode):
    import json

    from support import run_cli

    done = run_cli(["doctor", "--json"], env={"SGLANG_PLUGINS": "dp_mtp_fix", ARRIVAL_SEED_ENV: mode})
    data = json.loads(done.stdout)
    assert done.returncode == 0, (done.stdout, done.stderr)  # an opt-in patch never turns the verdict
    variable = next(v for v in data["variables"] if v["name"] == ARRIVAL_SEED_ENV)
    assert variable["value"] == mode and variable["meaning"].startswith("off" if mode == "off" else "seedless")
    status = next(p["status"] for p in data["patches"] if p["id"] == "arrival_seed")
    assert status == ("applied" if mode == "exact" else "disabled")
    assert (f"arrival_seed ({ARRIVAL_SEED_ENV}=exact) will be applied" in data["verdict"]) is (mode == "exact")
    shown = run_cli(["doctor"], env={"SGLANG_PLUGINS": "dp_mtp_fix", ARRIVAL_SEED_ENV: mode}).stdout
    assert f"{ARRIVAL_SEED_ENV}  '{mode}' -> " in shown


def test_the_report_line_names_the_setting(seeding):
    from sglang_dp_mtp_fix import plugin, report

    seeding("recent")
    line = report.summary_line(plugin.get_manager().outcomes or [], plugin.last_config)
    assert f"(mode=auto): {ARRIVAL_SEED_ENV}=recent: future_seed_authority=" in line and "arrival_seed=applied" in line
