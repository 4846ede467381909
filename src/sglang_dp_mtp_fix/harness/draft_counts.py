"""The draft's per-rank DP token counts and draft-graph decision, through SGLang's real code, for one release.

Used by ``tools/gen_draft_counts_oracle.py`` (0.5.23, upstream's fix: the oracle) and by
``tests/test_draft_token_counts.py`` (0.5.15.post1-0.5.20, stock and with the plugin), on the same inputs.

REAL: ``ServerArgs`` with ``--moe-a2a-backend`` / ``--speculative-moe-a2a-backend``, published as the scheduler
process does; each answer of ``require_mlp_tp_gather`` as the release computes it (0.5.23: inside
``SchedulerDPAttnAdapter.prepare_mlp_sync_batch``; earlier: the scheduler's own answer and, for the draft runner,
the same call inside ``speculative_moe_a2a_backend_context()``); ``_update_gather_batch``; the draft
``ForwardBatch`` (0.5.15.post1-0.5.20: ``ForwardBatch.init_new`` with a draft model runner; 0.5.23:
``ForwardBatch.init_mlp_sync_metadata(..., is_draft_worker=True)``, the method upstream's fix changed, on a bare
ForwardBatch, since its ``init_new`` needs a live model runner); ``EAGLEDraftCudaGraphRunner.can_run_graph``.
STAND-INS: ``GatheredSyncInfoStandIn`` (an ``MLPSyncBatchInfo`` after its all-gather, which needs the peer ranks);
the harness's ``ModelRunnerStandIn`` and decode tensors for ``init_new`` (a model runner needs a model); the draft
runner created without ``__init__`` (it captures CUDA graphs); on <= 0.5.17 ``enable_num_token_non_padded`` (asks
the expert-parallel group, which needs the peer ranks).
"""

from __future__ import annotations

import functools
import inspect
import os
from array import array
from types import SimpleNamespace
from typing import Any

from sglang_dp_mtp_fix.harness.context import publish_server_args
from sglang_dp_mtp_fix.harness.standins import ModelRunnerStandIn, decode_tensors, draft_runner_standin

DUMMY_MODEL = os.path.join(os.path.dirname(__file__), "dummy_model")
MAX_BS = 8  # the draft graph's largest captured batch size in these cases
PAIRS = (("none", "none"), ("deepep", "deepep"), ("deepep", "none"), ("none", "deepep"))
# Per-rank decode batch sizes of one round: an idle rank (0), one over MAX_BS, equal and uneven ranks; 2 and 3 ranks.
COUNTS = ((2, 12), (0, 5), (3, 0), (8, 8), (9, 1), (0, 5, 12), (12, 3, 8))
# The gathered lists as the all-gather fills them, or None (SGLANG_SCHEDULER_SKIP_ALL_GATHER: nothing gathered).
GATHERED = (True, False)


def for_logprob(count: int) -> int:
    """A rank's logprob count, deliberately not its token count (a swap of the two lists shows)."""
    return max(count - 1, 0)


class GatheredSyncInfoStandIn:
    """STAND-IN for an ``MLPSyncBatchInfo`` after ``all_gather`` (the gather needs the peer ranks)."""

    def __init__(self, local: int, gathered: list[int] | None, logprob_differs: bool = False):
        self.num_tokens, self.num_tokens_for_logprob = local, for_logprob(local) if logprob_differs else local
        self.global_num_tokens = None if gathered is None else list(gathered)
        self.global_num_tokens_for_logprob = None
        if gathered is not None:
            self.global_num_tokens_for_logprob = [for_logprob(c) if logprob_differs else c for c in gathered]
        self.tp0_info = self.tp0_info_cpu = None  # the gathered rows: the draft vote is not under test here

    def __getattr__(self, name: str) -> Any:
        return False if "graph" not in name else True  # decode-graph votes yes; other group fields off


def server_args(target: str, draft: str, world: int = 2, rank: int = 0, multi_layer: bool = False) -> Any:
    """The deployment's ServerArgs (``world`` DP ranks, EP over all of them; ``multi_layer``:
    ``--enable-multi-layer-eagle``), published as this process's scheduler (rank ``rank``) publishes it, and the MoE
    config initialized from it."""
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(
        model_path=DUMMY_MODEL, device="cpu", tp_size=world, dp_size=world, ep_size=world, enable_dp_attention=True,
        enable_dp_lm_head=True, moe_dense_tp_size=1, skip_tokenizer_init=True, load_format="dummy",
        speculative_algorithm="EAGLE", speculative_draft_model_path=DUMMY_MODEL,
        moe_a2a_backend=target, speculative_moe_a2a_backend=draft,
        **({"enable_multi_layer_eagle": True} if multi_layer else {}),
    )  # fmt: skip
    publish_server_args(sa, rank)
    initialize_moe_config(sa)
    return sa


def initialize_moe_config(sa: Any) -> None:
    """The MoE runtime flags from ``sa``, as the scheduler process sets them after publishing its ServerArgs."""
    from sglang.srt.layers.moe import utils as moe_utils

    init = moe_utils.initialize_moe_config
    init(sa) if inspect.signature(init).parameters else init()


def scale_up(expanded: bool) -> None:
    """STAND-IN for elastic EP scale-up (0.5.20 ``require_mlp_tp_gather``: once ``elastic_expanded_world_enabled()``
    holds it answers True, before any backend check, for the target and inside the draft's backend context alike;
    reaching it for real needs an elastic-EP state manager with ranks admitted after launch). ``expanded``:
    SGLang's function on its module answers True from now on (signature kept); False: the original back."""
    from sglang.srt.utils import common

    original = getattr(common.require_mlp_tp_gather, "__wrapped__", common.require_mlp_tp_gather)
    if not expanded:
        common.require_mlp_tp_gather = original
        return

    @functools.wraps(original)
    def expanded_world(*args: Any, **kwargs: Any) -> bool:
        return True

    common.require_mlp_tp_gather = expanded_world


def gather_answers(sa: Any) -> tuple[bool, bool]:
    """(target, draft) ``require_mlp_tp_gather`` as 0.5.15.post1-0.5.20 compute them (scheduler; draft runner)."""
    from sglang.srt.layers.moe.utils import speculative_moe_a2a_backend_context
    from sglang.srt.utils.common import require_mlp_tp_gather

    from sglang_dp_mtp_fix.patches._startup_checks import takes_server_args

    def answer() -> bool:
        return bool(require_mlp_tp_gather(sa) if takes_server_args(require_mlp_tp_gather) else
                    require_mlp_tp_gather())  # fmt: skip

    target = answer()
    with speculative_moe_a2a_backend_context():
        draft = answer()
    return target, draft


def _answers_0523() -> tuple[bool, bool]:
    """0.5.23's (target, draft) answers, taken from its real ``SchedulerDPAttnAdapter.prepare_mlp_sync_batch``."""
    from sglang.srt.managers.scheduler_components import dp_attn
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    seen: dict[str, Any] = {}
    raw = dp_attn.prepare_mlp_sync_batch_raw
    dp_attn.prepare_mlp_sync_batch_raw = lambda *args, **kwargs: seen.update(kwargs)  # what it would be handed
    try:
        adapter = SimpleNamespace(  # STAND-IN: only what the method reads before it calls the raw sync
            spec_algorithm=SpeculativeAlgorithm.from_string("EAGLE"), model_runner=None, get_idle_batch=None,
            offload_tags=set(), sync_wait_carry=None,
        )  # fmt: skip
        dp_attn.SchedulerDPAttnAdapter.prepare_mlp_sync_batch(adapter, None)
    finally:
        dp_attn.prepare_mlp_sync_batch_raw = raw
    return bool(seen["require_mlp_tp_gather"]), bool(seen["draft_require_mlp_tp_gather"])


def _runner(draft_gather: bool) -> Any:
    from sglang.srt.speculative.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    runner = draft_runner_standin(EAGLEDraftCudaGraphRunner, SpeculativeAlgorithm.from_string("EAGLE"))
    runner.require_mlp_tp_gather, runner.max_bs = draft_gather, MAX_BS
    return runner


def _listed(value: Any) -> list[int] | None:
    return None if value is None else list(value)


def _row(view: Any, runner: Any) -> dict[str, Any]:
    try:
        can_run: bool | str = bool(runner.can_run_graph(view))
    except Exception as exc:  # noqa: BLE001 - recorded: both sides must fail alike
        can_run = type(exc).__name__
    return {
        "global_num_tokens_cpu": _listed(getattr(view, "global_num_tokens_cpu", None)),
        "global_num_tokens_for_logprob_cpu": _listed(getattr(view, "global_num_tokens_for_logprob_cpu", None)),
        "original_global_num_tokens_cpu": _listed(getattr(view, "original_global_num_tokens_cpu", None)),
        "can_run_graph": can_run,
    }


def _sync_info(local: int, counts: tuple[int, ...], gathered: bool) -> GatheredSyncInfoStandIn:
    return GatheredSyncInfoStandIn(local, list(counts) if gathered else None, logprob_differs=True)


def oracle_rows(target: str, draft: str, counts: tuple[int, ...], gathered: bool = True) -> list[dict[str, Any]]:
    """0.5.23: each rank's draft ForwardBatch counts and draft-graph decision (``gathered`` False: the gathered
    lists are None, as under SGLANG_SCHEDULER_SKIP_ALL_GATHER)."""
    from sglang.srt.managers.scheduler_components.dp_attn import _update_gather_batch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    server_args(target, draft, world=len(counts))
    target_gather, draft_gather = _answers_0523()
    rows = []
    for local in counts:
        batch = SimpleNamespace(dp_spec_prefill_coordination_applied=False)  # STAND-IN: the fields the two read
        _update_gather_batch(batch, _sync_info(local, counts, gathered), target_gather, draft_gather)
        view = object.__new__(ForwardBatch)
        view.spec_info, view.batch_size = None, local
        view.init_mlp_sync_metadata(batch, "cpu", is_draft_worker=True)
        rows.append(_row(view, _runner(draft_gather)))
    return rows


def release_rows(target: str, draft: str, counts: tuple[int, ...], gathered: bool = True) -> list[dict[str, Any]]:
    """0.5.15.post1-0.5.20 (stock, or with the plugin applied): the same rows through ``ForwardBatch.init_new``."""
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.scheduler_components.dp_attn import _update_gather_batch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    target_gather, draft_gather = gather_answers(server_args(target, draft, world=len(counts)))
    algo = SpeculativeAlgorithm.from_string("EAGLE")
    kwargs = {}
    if "return_hidden_states_before_norm" in inspect.signature(inspect.unwrap(ForwardBatch.init_new)).parameters:
        kwargs = {"return_hidden_states_before_norm": False}
    rows = []
    for rank, local in enumerate(counts):
        reqs = [
            Req(f"r{rank}-{i}", "", array("i", [1, 2, 3, 4]), SamplingParams(max_new_tokens=8)) for i in range(local)
        ]
        mode = ForwardMode.DECODE if local else ForwardMode.IDLE
        batch = ScheduleBatch(reqs=reqs, forward_mode=mode, spec_algorithm=algo)
        _update_gather_batch(batch, _sync_info(local, counts, gathered), target_gather)
        decode_tensors(batch)
        draft_model_runner = ModelRunnerStandIn(device="cpu", spec_algorithm=algo, is_draft_worker=True)
        view = ForwardBatch.init_new(batch, draft_model_runner, **kwargs)
        rows.append(_row(view, _runner(draft_gather)))
    return rows


class _TorchNativeView:
    """STAND-IN: the runner's ServerArgs (read-only once resolved) with the torch_native attention backend, so that
    ``init_new`` computes extend positions on CPU."""

    attention_backend = "torch_native"

    def __init__(self, server_args: Any):
        self._server_args = server_args

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server_args, name)


def multi_layer_draft_extend(target: str, draft: str, counts: tuple[int, ...], rank: int) -> dict[str, Any]:
    """``--enable-multi-layer-eagle``'s eager draft-extend on DP rank ``rank`` (0.5.16-0.5.20: 0.5.15.post1 prepares
    it inside the worker; stock, or with the plugin applied), up to the value that indexes the per-rank counts.

    REAL: ``_update_gather_batch`` with the scheduler's answer; ``prepare_for_draft_extend`` (what
    ``MultiLayerEagleDraftWorker._draft_extend_for_decode`` calls) with an ``EagleDraftExtendInput`` of its width
    (``speculative_num_steps + 1`` = 4 rows per request, 1 for logprobs) and ``ForwardBatch.init_new`` with the draft
    model runner; ``ForwardBatch.set_local_num_token_non_padded`` (0.5.18+; before it
    ``adjust_num_token_non_padded_for_attn_tp``: what the model runner calls on the eager path), outside
    ``speculative_moe_a2a_backend_context`` as the multi-layer worker runs.
    STAND-INS: the harness's ``ModelRunnerStandIn`` (the torch_native attention backend: positions on CPU) and decode
    tensors; ``GatheredSyncInfoStandIn``; this rank's attention DP rank and size through SGLang's own
    ``get_parallel().override`` (the groups need the peer ranks); ``batch.model_config`` (its vocab size only);
    ``enable_num_token_non_padded`` as the tests set it (EP world > 1)."""
    import torch
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.scheduler_components.dp_attn import _update_gather_batch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative import eagle_worker_common
    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    sa = server_args(target, draft, world=len(counts), rank=rank, multi_layer=True)
    target_gather, _ = gather_answers(sa)

    algo = SpeculativeAlgorithm.from_string("EAGLE")
    local = counts[rank]
    reqs = [Req(f"r{rank}-{i}", "", array("i", [1, 2, 3, 4]), SamplingParams(max_new_tokens=8)) for i in range(local)]
    batch = ScheduleBatch(reqs=reqs, forward_mode=ForwardMode.DECODE, spec_algorithm=algo)
    _update_gather_batch(batch, GatheredSyncInfoStandIn(local, list(counts)), target_gather)
    decode_tensors(batch)
    batch.model_config = SimpleNamespace(vocab_size=1000)
    width = 4
    extend_input = EagleDraftExtendInput(
        hidden_states=None, num_tokens_per_req=width, num_tokens_for_logprob_per_req=1, num_front_tokens=0
    )
    runner = ModelRunnerStandIn(
        device="cpu", spec_algorithm=algo, is_draft_worker=True, prefill_attention_backend_str="torch_native",
        server_args=_TorchNativeView(sa),  # <= 0.5.17 reads the attention backend there
    )  # fmt: skip
    from sglang.srt.runtime_context import get_parallel

    # This rank's place, through SGLang's own override of the parallel context (the groups need the peer ranks).
    with get_parallel().override(attn_dp_rank=rank, attn_dp_size=len(counts), attn_tp_size=1, attn_tp_rank=0):
        view = eagle_worker_common.prepare_for_draft_extend(
            extend_input, batch, torch.zeros(local * width, dtype=torch.int64), width, runner, None,
            return_hidden_states_before_norm=True,
        )  # fmt: skip
        row: dict[str, Any] = {"global_num_tokens_cpu": list(view.global_num_tokens_cpu)}
        try:
            if hasattr(view, "set_local_num_token_non_padded"):  # 0.5.20
                view.set_local_num_token_non_padded(sharded=False)
            elif inspect.signature(view.adjust_num_token_non_padded_for_attn_tp).parameters:  # <= 0.5.18
                view.adjust_num_token_non_padded_for_attn_tp(sa)
            else:  # 0.5.19 reads the parallel context instead of server_args
                view.adjust_num_token_non_padded_for_attn_tp()
            row["num_token_non_padded"] = int(view.num_token_non_padded)
        except IndexError as exc:
            row["error"] = f"IndexError: {exc}"
    return row
