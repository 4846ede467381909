"""--speculative-moe-a2a-backend different from --moe-a2a-backend: can the DP ranks split? (issue 14, part 2)

Verdict from the code of 0.5.15.post1-0.5.20: yes. The draft CUDA-graph runner computes ``require_mlp_tp_gather``
when it is built, inside ``speculative_moe_a2a_backend_context()`` (the draft backend), while the scheduler shapes
``batch.global_num_tokens`` with its own answer (the target backend) in ``_update_gather_batch``. With the target
not gathering (e.g. ``deepep``) and the draft gathering (``none``), the draft runner's ``can_run_graph`` takes
``max(original_global_num_tokens_cpu)`` of a one-element list: each rank buckets its *own* count, so a rank under
``max_bs`` replays the draft graph while a peer over it goes eager (and bucket sizes differ between ranks that
both replay). Upstream 0.5.21 gives the draft its own counts (``draft_global_num_tokens``).

The reverse (target gathers, draft does not, e.g. none/deepep) makes the draft bucket per rank, which is what a
stock deepep/deepep deployment does by design (its a2a needs no common bucket); it is not shown to split and is not
named.

Not fixed here (no seam gives the draft its counts without re-deriving ForwardBatch's gathered fields); the plugin
refuses the configuration at scheduler start (``_startup_checks.draft_token_counts_hazard``): one WARNING in
``auto``, which also puts the draft-vote group back to stock on that scheduler, ``StartupHazard`` in ``strict``.

REAL: ``ServerArgs`` with both flags, SGLang's ``require_mlp_tp_gather`` in and out of the real
``speculative_moe_a2a_backend_context()``, ``ScheduleBatch``, ``_update_gather_batch``, ``ForwardBatch.init_new``
and ``EAGLEDraftCudaGraphRunner.can_run_graph`` (created without ``__init__``, which captures graphs).
STAND-INs: ``GatheredSyncInfo`` (an ``MLPSyncBatchInfo`` after its all-gather: the gather needs the peer ranks; it
carries the gathered per-rank counts of a two-rank group), the harness's ``ModelRunnerStandIn`` for ``init_new``
(a model runner needs a model) and, on <= 0.5.17, ``enable_num_token_non_padded`` (asks the EP process group).
"""

from __future__ import annotations

import inspect
import logging
import os
from array import array
from typing import Any

import pytest
from conftest import affected_only

from sglang_dp_mtp_fix.config import MODE_ENV, load_config
from sglang_dp_mtp_fix.harness.rank import ModelRunnerStandIn, decode_tensors, draft_runner_standin, publish_server_args
from sglang_dp_mtp_fix.patches import PATCH_IDS
from sglang_dp_mtp_fix.patches._startup_checks import _mlp_tp_gather, draft_token_counts_hazard

pytestmark = affected_only

DUMMY_MODEL = os.path.join(os.path.dirname(__import__("sglang_dp_mtp_fix.harness").harness.__file__), "dummy_model")
MAX_BS = 8
LOCAL_COUNTS = (2, 12)  # the two DP ranks' decode batch sizes this round; 12 > MAX_BS


def server_args(target: str, draft: str) -> Any:
    from sglang.srt.layers.moe import utils as moe_utils
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(
        model_path=DUMMY_MODEL, device="cpu", tp_size=2, dp_size=2, ep_size=2, enable_dp_attention=True,
        enable_dp_lm_head=True, moe_dense_tp_size=1, skip_tokenizer_init=True, load_format="dummy",
        speculative_algorithm="EAGLE", speculative_draft_model_path=DUMMY_MODEL,
        moe_a2a_backend=target, speculative_moe_a2a_backend=draft,
    )  # fmt: skip
    publish_server_args(sa)
    init = moe_utils.initialize_moe_config
    init(sa) if inspect.signature(init).parameters else init()  # as the scheduler process does
    return sa


def gather_answers(sa: Any) -> tuple[bool, bool]:
    from sglang.srt.layers.moe.utils import speculative_moe_a2a_backend_context

    target = _mlp_tp_gather(sa)
    with speculative_moe_a2a_backend_context():
        draft = _mlp_tp_gather(sa)  # what the draft runner's __init__ computes, in the same context
    return target, draft


class GatheredSyncInfo:
    """STAND-IN for an ``MLPSyncBatchInfo`` after ``all_gather`` (the gather needs the peer ranks)."""

    def __init__(self, local: int, gathered: list[int]):
        self.num_tokens = self.num_tokens_for_logprob = local
        self.global_num_tokens = self.global_num_tokens_for_logprob = gathered

    def __getattr__(self, name: str) -> Any:
        return False if "graph" not in name else True  # decode-graph votes yes; other group fields off


def draft_paths(target_gather: bool, draft_gather: bool, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Each rank's draft-graph decision (True = graph) from the real sync update, init_new and can_run_graph."""
    from sglang.srt.model_executor import forward_batch_info

    # STAND-IN (<= 0.5.17 asks the expert-parallel process group, which needs the peer ranks): the EP world size
    # of this deployment (ep_size=2) is > 1, as SGLang's own function answers from 0.5.18 on.
    monkeypatch.setattr(forward_batch_info, "enable_num_token_non_padded", lambda: True)
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.scheduler_components.dp_attn import _update_gather_batch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    algo = SpeculativeAlgorithm.from_string("EAGLE")
    paths = []
    for rank, local in enumerate(LOCAL_COUNTS):
        reqs = [
            Req(f"r{rank}-{i}", "", array("i", [1, 2, 3, 4]), SamplingParams(max_new_tokens=8)) for i in range(local)
        ]
        batch = ScheduleBatch(reqs=reqs, forward_mode=ForwardMode.DECODE, spec_algorithm=algo)
        _update_gather_batch(batch, GatheredSyncInfo(local, list(LOCAL_COUNTS)), target_gather)
        decode_tensors(batch)
        kwargs = {}
        if "return_hidden_states_before_norm" in inspect.signature(inspect.unwrap(ForwardBatch.init_new)).parameters:
            kwargs = {"return_hidden_states_before_norm": False}
        view = ForwardBatch.init_new(batch, ModelRunnerStandIn(device="cpu", spec_algorithm=algo), **kwargs)
        runner = draft_runner_standin(EAGLEDraftCudaGraphRunner, algo)
        runner.require_mlp_tp_gather, runner.max_bs = draft_gather, MAX_BS
        paths.append(bool(runner.can_run_graph(view)))
    return paths


def test_differing_draft_backend_changes_the_gather_answer():
    assert gather_answers(server_args("none", "none")) == (True, True)
    assert gather_answers(server_args("deepep", "deepep")) == (False, False)
    assert gather_answers(server_args("deepep", "none")) == (False, True)
    assert gather_answers(server_args("none", "deepep")) == (True, False)


def test_same_backend_keeps_ranks_on_one_draft_path(monkeypatch):
    """Control: the draft sees the counts it expects, both ranks agree (over max_bs -> both eager)."""
    target, draft = gather_answers(server_args("none", "none"))
    paths = draft_paths(target, draft, monkeypatch)
    assert len(set(paths)) == 1, paths


def test_differing_draft_backend_splits_the_ranks_on_stock(monkeypatch):
    """Target deepep (no gather), draft none (gather): each rank buckets its own count; rank 0 replays, rank 1 not."""
    target, draft = gather_answers(server_args("deepep", "none"))
    paths = draft_paths(target, draft, monkeypatch)
    assert paths == [True, False], paths


VOTE_GROUP = ("future_seed_authority", "eager_draft_gate", "draft_graph_vote")


def test_auto_refuses_it_and_leaves_the_vote_group_stock_on_that_scheduler(restored, monkeypatch, caplog):
    """The real plugin applied in-process, then SGLang's real ranks' split above run again: stock behaviour comes
    back exactly (the refusal is a stand-down, not a fix), the other groups stay applied, one WARNING names both
    flags and the patches, and the statuses say why (what the cross-rank check compares next)."""
    from types import SimpleNamespace

    from sglang.srt.speculative.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner

    monkeypatch.setenv(MODE_ENV, "auto")
    stock_gate = EAGLEDraftCudaGraphRunner.__dict__["can_run_graph"]
    outcomes = {o.id: o for o in restored.register()}
    assert all(outcomes[pid].status.value == "applied" for pid in VOTE_GROUP)
    others = {pid: o.status.value for pid, o in outcomes.items() if pid not in VOTE_GROUP}
    assert EAGLEDraftCudaGraphRunner.__dict__["can_run_graph"] is not stock_gate
    vote_prints = ("sglang.srt.managers.scheduler_components.dp_attn", "sglang.srt.speculative.eagle_draft_cuda")
    assert any(k.startswith(vote_prints) for k in restored.get_manager().peer_fingerprints())
    scheduler = SimpleNamespace(server_args=server_args("deepep", "none"), draft_worker=object())  # STAND-IN
    with caplog.at_level(logging.INFO, logger="sglang_dp_mtp_fix"):
        restored.check_startup_hazards(scheduler, restored.last_config)
    lines = [r.getMessage() for r in caplog.records if "--speculative-moe-a2a-backend" in r.getMessage()]
    assert len(lines) == 1 and "--moe-a2a-backend deepep" in lines[0] and "backend none" in lines[0], lines
    assert lines[0].endswith("left stock on this scheduler (auto; strict stops): " + ", ".join(VOTE_GROUP)), lines
    assert EAGLEDraftCudaGraphRunner.__dict__["can_run_graph"] is stock_gate
    assert {pid: o.status.value for pid, o in outcomes.items() if pid not in VOTE_GROUP} == others
    for pid in VOTE_GROUP:
        assert outcomes[pid].status.value == "unsupported" and "left stock at scheduler start" in outcomes[pid].reason
    assert not any(k.startswith(vote_prints) for k in restored.get_manager().peer_fingerprints())
    target, draft = gather_answers(server_args("deepep", "none"))
    assert draft_paths(target, draft, monkeypatch) == [True, False]  # SGLang's real path still runs, stock


def test_plugin_names_the_configuration_at_scheduler_start(monkeypatch, caplog):
    from types import SimpleNamespace

    from sglang_dp_mtp_fix import plugin

    scheduler = SimpleNamespace(server_args=server_args("deepep", "none"), draft_worker=object())  # STAND-IN
    monkeypatch.setenv(MODE_ENV, "auto")
    with caplog.at_level(logging.INFO, logger="sglang_dp_mtp_fix"):
        plugin.check_startup_hazards(scheduler, load_config(list(PATCH_IDS)))
    lines = [r.getMessage() for r in caplog.records if "--speculative-moe-a2a-backend" in r.getMessage()]
    assert len(lines) == 1 and "--moe-a2a-backend deepep" in lines[0] and "backend none" in lines[0], lines
    monkeypatch.setenv(MODE_ENV, "strict")
    with pytest.raises(plugin.StartupHazard, match="--speculative-moe-a2a-backend none differs"):
        plugin.check_startup_hazards(scheduler, load_config(list(PATCH_IDS)))
    for target, draft in (("none", "none"), ("deepep", "deepep"), ("none", "deepep")):
        ok = SimpleNamespace(server_args=server_args(target, draft), draft_worker=object())  # STAND-IN
        assert draft_token_counts_hazard(ok) is None, (target, draft)
