"""One PD-decode scheduling round on this rank: build the rank's batch, run SGLang's round and DP MLP sync, and read
the decisions it took (``run_round`` -> ``RoundResult``).

REAL SGLang (unmodified, from the installed release): ``ScheduleBatch``/``Req``/``SamplingParams``,
``EagleDraftInput`` (and its ``merge_batch``),
``SchedulerDisaggregationDecodeMixin.get_next_disagg_decode_batch_to_run``,
``SchedulerDPAttnAdapter.maybe_prepare_mlp_sync_batch``, ``prepare_mlp_sync_batch_raw`` with ``MLPSyncBatchInfo``
and ``_update_gather_batch``, ``ForwardBatch.init_new``, ``EAGLEWorkerV2.requires_dp_attention_eager_forward``
(when the plugin adds it) and ``EAGLEDraftCudaGraphRunner.can_run_graph``. The stand-ins are in ``standins.py``.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from sglang_dp_mtp_fix.harness import draft_counts
from sglang_dp_mtp_fix.harness.context import CONTEXT, parameters
from sglang_dp_mtp_fix.harness.standins import (
    AdapterStandIn,
    ModelRunnerStandIn,
    SchedulerStandIn,
    decode_tensors,
    draft_input_standin,
    draft_runner_standin,
    draft_step_rows,
    stock_guard_goes_eager,
)


@dataclass
class RoundResult:
    """What one rank decided in one round. A rank with nothing to run (``ran`` False) has only its timings.

    Plain fields only: it crosses the pool's queue (pickled) to the process that drives the ranks."""

    rank: int
    ran: bool
    sync_ms: float = 0.0  # wall time of the round on this rank (includes waiting on peers)
    sync_cpu_ms: float = 0.0  # CPU time of this rank's round (excludes waiting on peers)
    round_cpu_ms: float = 0.0  # CPU time of SGLang's own round alone, without building this round's batch
    idle: bool = False
    num_tokens: int = 0
    global_num_tokens: list[int] | None = None
    decode_graph: bool = False  # the generic vote: target verify + draft extend follow it
    draft_vote: bool | None = None  # the group's draft vote on the batch (None: stock SGLang has none)
    forward_batch_draft_vote: bool | None = None  # the vote as the real ForwardBatch.init_new carried it
    force_disable_draft_cuda_graph: bool | None = None
    runner_graph: bool = False  # the draft runner's can_run_graph
    draft_path: str | None = None  # "graph" | "eager"
    draft_gathers: bool = False  # the draft runner's require_mlp_tp_gather
    draft_rows: int | None = None  # rows of the draft step's gathered MoE; None when the draft does not gather
    draft_bucket: int | None = None  # draft_rows on the graph path
    eager_cause: str | None = None
    # Filled in by ``rank.run_rounds``: SGLang's collectives inside the MLP sync, and the emulated draft step.
    sync_collectives: int = 0
    collective: str | None = None  # "ok" | "split"; None when not emulated
    paths: list[tuple[int, int]] | None = None  # every rank's (graph, rows) descriptor, when guarded


def gather_answers() -> tuple[bool, bool]:
    """(target, draft) ``require_mlp_tp_gather`` of this process's published ServerArgs, from SGLang: the target's
    as the scheduler computes it, the draft runner's inside ``speculative_moe_a2a_backend_context()``. Once per
    configuration (``configure`` clears it): one scheduler process has one ServerArgs."""
    if CONTEXT.gather_answers is None:
        CONTEXT.gather_answers = draft_counts.gather_answers(CONTEXT.server_args)
    return CONTEXT.gather_answers


def real_forward_batch(batch: Any, spec_algo: Any) -> Any:
    """SGLang's real ``ForwardBatch.init_new`` (wrapped by the plugin when it is applied) on the synced batch, as the
    draft builds it: with the draft model runner (``is_draft_worker``, read by 0.5.21+ and draft_token_counts)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    decode_tensors(batch)
    runner = ModelRunnerStandIn(device=CONTEXT.device, spec_algorithm=spec_algo, is_draft_worker=True)
    init = ForwardBatch.init_new
    kwargs = {"return_hidden_states_before_norm": False}
    if "return_hidden_states_before_norm" not in parameters("ForwardBatch.init_new", init):
        kwargs = {}
    return init(batch, runner, **kwargs)


def arrival_draft_input(reqs: list[Any], arrival: dict[str, Any], overlap: bool) -> Any:
    """The draft input of one PD arrival per request of ``reqs`` (same ids) from a seedless prefill, through SGLang's
    own commit and PD draft-input builder (``harness/arrival.py``)."""
    from sglang_dp_mtp_fix.harness import arrival as pd

    index_topk = int(arrival["index_topk"])
    queue = pd.transfer_queue(pd.metadata_buffers(index_topk, size=max(len(reqs), 1)), index_topk)
    arrived = [pd.arrive(queue, int(arrival["prompt_len"]), slot=i, rid=r.rid) for i, r in enumerate(reqs)]
    spec = pd.pd_draft_input(arrived, index_topk, overlap)
    if hasattr(spec, "num_tokens_per_req"):  # as draft_input_standin: what the EAGLE worker sets (topk = 1)
        spec.num_tokens_per_req = spec.num_tokens_for_logprob_per_req = 1
    return spec


def _running_batch(state: dict[str, Any], rank: int, spec_algo: Any, idle_batch: Callable[[], Any]) -> Any:
    """The rank's running batch as ``state`` describes it (``run_round``), with SGLang's real batch classes."""
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.sampling.sampling_params import SamplingParams

    kind = state.get("kind", "decode")
    if kind == "idle":
        return idle_batch()
    if kind != "decode":
        return ScheduleBatch(reqs=[], forward_mode=ForwardMode.DECODE, spec_algorithm=spec_algo)  # empty
    n = int(state.get("num_reqs", 1))
    reqs = [Req(f"r{rank}-{i}", "", array("i", [1, 2, 3, 4]), SamplingParams(max_new_tokens=8)) for i in range(n)]
    running = ScheduleBatch(reqs=reqs, forward_mode=ForwardMode.DECODE, spec_algorithm=spec_algo)
    overlap = bool(state.get("overlap", False))
    if state.get("arrival"):
        spec = arrival_draft_input(reqs, dict(state["arrival"]), overlap)
    else:
        spec = draft_input_standin(bool(state.get("seed", True)), overlap, state.get("future_flag"), n)
    if state.get("merge_seedless_prebuilt"):
        spec.merge_batch(draft_input_standin(False, True, False, 1))  # real EagleDraftInput.merge_batch
    running.spec_info = spec
    return running


def _eager_cause(guard_eager: bool, runner_graph: bool, draft_vote: bool | None, view: Any, runner: Any) -> str:
    """Why this rank's draft step ran eagerly."""
    if guard_eager and runner_graph:
        return "local seedless guard"
    if guard_eager:
        return "own seedless batch"
    if draft_vote is False:
        return "another rank's vote"
    if (draft_step_rows(view, runner, False) or view.batch_size) > runner.max_bs:
        return "above the draft graph's max_bs"
    return "generic graph refused"


# A round's ``state``, the rank's local situation:
#   kind: "none" (no running batch) | "idle" (idle batch) | "decode"
#   seed: bool (DSA top-k seed present), overlap: bool, future_flag: bool | None,
#   merge_seedless_prebuilt: bool (a seeded running batch absorbs a seedless prebuilt batch, overlap-style),
#   seed_from_draft_extend: bool, has_draft_worker: bool, num_reqs: int,
#   arrival: {"prompt_len": L, "index_topk": K} (the running batch is a PD arrival from a seedless prefill, committed
#   by SGLang's ``_commit_transfer_to_req`` and built by its ``build_eagle_disagg_draft_input``: ``harness/arrival.py``;
#   ``overlap`` as above, ``seed`` and ``future_flag`` are then SGLang's own)
def run_round(state: dict[str, Any]) -> RoundResult:
    """One PD-decode scheduling round on this rank, in the situation ``state`` describes (above)."""
    import torch  # noqa: F401
    from sglang.srt.disaggregation.decode import SchedulerDisaggregationDecodeMixin
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    rank = CONTEXT.rank
    t0 = time.perf_counter()
    c0 = time.thread_time()
    spec_algo = SpeculativeAlgorithm.from_string("EAGLE")
    model_runner = SimpleNamespace(prefill_cuda_graph_runner=None, spec_algorithm=spec_algo, model_config=None)

    def idle_batch() -> Any:
        return ScheduleBatch(reqs=[], forward_mode=ForwardMode.IDLE, spec_algorithm=spec_algo)

    running = _running_batch(state, rank, spec_algo, idle_batch)

    spec_worker = object.__new__(EAGLEWorkerV2)  # real class; __init__ would load a model
    spec_worker._draft_worker = (
        SimpleNamespace(seed_dsa_topk_from_draft_extend=bool(state.get("seed_from_draft_extend", True)))
        if state.get("has_draft_worker", True)
        else None
    )
    adapter = AdapterStandIn(CONTEXT.world, idle_batch, model_runner, gather_answers())
    scheduler = SchedulerStandIn(running, spec_worker, adapter)
    fn = SchedulerDisaggregationDecodeMixin.get_next_disagg_decode_batch_to_run
    c1 = time.thread_time()
    if len(parameters("get_next_disagg_decode_batch_to_run", fn)) > 1:  # 0.5.16+: (self, running_batch) -> plan
        batch = fn(scheduler, running).batch_to_run
    else:  # 0.5.15.post1: (self) -> Optional[ScheduleBatch]
        batch = fn(scheduler)
    round_cpu_ms = (time.thread_time() - c1) * 1e3
    sync_ms = (time.perf_counter() - t0) * 1e3
    sync_cpu_ms = (time.thread_time() - c0) * 1e3
    if batch is None:  # nothing was gathered for this rank (no DP peers active)
        return RoundResult(rank=rank, ran=False, sync_ms=sync_ms, sync_cpu_ms=sync_cpu_ms, round_cpu_ms=round_cpu_ms)

    run_batch = getattr(batch, "inner_idle_batch", None) or batch
    decode_vote = bool(
        getattr(run_batch, "can_run_decode_cuda_graph", getattr(run_batch, "can_run_dp_cuda_graph", False))
    )
    draft_vote = getattr(run_batch, "can_run_dp_draft_cuda_graph", None)
    is_idle = run_batch.forward_mode.is_idle()
    view = real_forward_batch(run_batch, spec_algo)  # the draft's ForwardBatch (built with the draft model runner)
    runner = draft_runner_standin(EAGLEDraftCudaGraphRunner, spec_algo)
    runner.require_mlp_tp_gather = gather_answers()[1]  # the draft runner's own answer
    if state.get("_flip_draft_path"):
        # TEST-ONLY switch (flight-recorder tests): a bug elsewhere that turns this rank's draft path around after
        # the group's vote; the plugin's can_run_graph then answers the other way on this rank alone.
        view.can_run_dp_draft_cuda_graph = not getattr(view, "can_run_dp_draft_cuda_graph", True)
    runner_graph = bool(runner.can_run_graph(view))
    guard_eager = stock_guard_goes_eager(state, is_idle, getattr(run_batch, "spec_info", None))
    draft_graph = runner_graph and not guard_eager
    draft_rows = draft_step_rows(view, runner, draft_graph)
    cause = None if draft_graph else _eager_cause(guard_eager, runner_graph, draft_vote, view, runner)
    return RoundResult(
        rank=rank,
        ran=True,
        sync_ms=sync_ms,
        sync_cpu_ms=sync_cpu_ms,
        round_cpu_ms=round_cpu_ms,
        idle=is_idle,
        num_tokens=0 if is_idle else len(run_batch.reqs),
        global_num_tokens=list(getattr(run_batch, "global_num_tokens", None) or []),
        decode_graph=decode_vote,
        draft_vote=draft_vote,
        forward_batch_draft_vote=view.__dict__.get("can_run_dp_draft_cuda_graph"),
        force_disable_draft_cuda_graph=getattr(batch, "force_disable_draft_cuda_graph", None),
        runner_graph=runner_graph,
        draft_path="graph" if draft_graph else "eager",
        draft_gathers=bool(runner.require_mlp_tp_gather),
        draft_rows=draft_rows,
        draft_bucket=draft_rows if draft_graph else None,
        eager_cause=cause,
    )
