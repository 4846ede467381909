"""The draft's per-rank DP token counts, draft-graph decision and what its forward derives from them, through SGLang's
real code, for one release.

Used by ``tools/gen_draft_counts_oracle.py`` (0.5.23, upstream's fix: the oracle) and by
``tests/test_draft_token_counts.py`` (0.5.15.post1-0.5.20, stock and with the plugin), on the same inputs.

REAL: ``ServerArgs`` with ``--moe-a2a-backend`` / ``--speculative-moe-a2a-backend``, published as the scheduler
process does; each answer of ``require_mlp_tp_gather`` as the release computes it (0.5.23: inside
``SchedulerDPAttnAdapter.prepare_mlp_sync_batch``; earlier: the scheduler's own answer and, for the draft runner, the
same call inside ``speculative_moe_a2a_backend_context()``); ``_update_gather_batch``; the draft ``ForwardBatch``
from ``ForwardBatch.init_new`` with a draft model runner (the draft extend's through the release's
``prepare_for_draft_extend``, which calls it); ``can_run_graph`` of ``EAGLEDraftCudaGraphRunner`` /
``EAGLEDraftExtendCudaGraphRunner``, and for the frozen-KV MTP draft decode (``FrozenKVMTPDraftInput``, the release's
``expand_for_topk_draft``) of ``FrozenKVMTPCudaGraphRunner``; ``_pad_to_bucket`` (the replay bucket); the eager
forward's ``ForwardBatch.prepare_mlp_sync_batch`` (``DpPaddingMode``, ``global_dp_buffer_len``) and
``set_local_num_token_non_padded`` (0.5.20+), under the draft's backend context.
STAND-INS: ``GatheredSyncInfoStandIn`` (an ``MLPSyncBatchInfo`` after its all-gather, which needs the peer ranks);
the harness's ``ModelRunnerStandIn`` and decode tensors for ``init_new`` (a model runner needs a model), with the
fields ``_draft_model_runner`` names; the draft decode's input (``_draft_view``: ``prepare_for_draft`` assigns KV
slots first, which needs the req-to-token pool); the draft runners created without ``__init__`` (they capture CUDA
graphs) and the bucket choice at the top of their replay (``draft_step_rows``, ``frozen_kv_replay_bs``); this rank's
place in attention DP (``_DpRank``); on <= 0.5.17 ``enable_num_token_non_padded`` (asks the expert-parallel group,
which needs the peer ranks).
"""

from __future__ import annotations

import functools
import inspect
import os
from array import array
from types import SimpleNamespace
from typing import Any

from sglang_dp_mtp_fix.harness.context import publish_server_args
from sglang_dp_mtp_fix.harness.standins import ModelRunnerStandIn, decode_tensors, draft_runner_standin, draft_step_rows

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


# The draft forwards of one EAGLE round, as (forward, width): "plain" is no spec_info (width 1, DECODE / IDLE);
# "decode" the draft decode (width topk: the release sets num_tokens_per_req = topk before its init_new); "extend"
# the draft extend after verify (width speculative_num_draft_tokens), prepared by the release's own
# prepare_for_draft_extend (DRAFT_EXTEND_V2; IDLE on an idle rank). ``--speculative-eagle-topk 1
# --speculative-num-steps 3`` gives decode 1 / extend 4; topk 4, 4 steps, 8 draft tokens gives decode 4 / extend 8.
# ForwardMode.DRAFT_EXTEND (v1) does not exist on 0.5.15.post1-0.5.23: DRAFT_EXTEND_V2 is the draft-extend mode.
SHAPES = (("plain", 1), ("decode", 1), ("extend", 4), ("decode", 4), ("extend", 8))
# The widened shapes run on fewer count sets (the test runs on 8 releases on 2 cores): an idle rank, a rank above
# MAX_BS, 2 and 3 ranks.
SHAPE_COUNTS = ((2, 12), (0, 5), (0, 5, 12))
# One oracle case: (target backend, draft backend, per-rank counts, gathered, shape).
Case = tuple[str, str, tuple[int, ...], bool, tuple[str, int]]
CAPTURE_BS = (1, 2, 4, 8)  # the draft graph's captured batch sizes: a replay bucket shows which one a rank takes


def cases() -> list[Case]:
    """Every (target, draft, counts, gathered, shape) of the oracle, in its order."""
    return [
        (t, d, c, g, shape)
        for t, d in PAIRS
        for shape in SHAPES
        for c in (COUNTS if shape == SHAPES[0] else SHAPE_COUNTS)
        for g in GATHERED
    ]


def _runner(draft_gather: bool, shape: tuple[str, int]) -> Any:
    """The draft graph runner of ``shape``'s forward (decode: EAGLEDraftCudaGraphRunner; extend: its draft-extend
    runner), captured at ``CAPTURE_BS`` with the forward's width."""
    from sglang.srt.speculative.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner
    from sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner import EAGLEDraftExtendCudaGraphRunner
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    kind = EAGLEDraftExtendCudaGraphRunner if shape[0] == "extend" else EAGLEDraftCudaGraphRunner
    runner = draft_runner_standin(kind, SpeculativeAlgorithm.from_string("EAGLE"))
    runner.require_mlp_tp_gather, runner.max_bs, runner.capture_bs = draft_gather, MAX_BS, list(CAPTURE_BS)
    runner.num_tokens_per_bs = runner.captured_req_width = shape[1]
    return runner


def _frozen_kv_runner(draft_gather: bool, width: int) -> Any:
    """The frozen-KV MTP draft-decode graph runner (``FrozenKVMTPCudaGraphRunner``), captured at ``CAPTURE_BS`` with
    ``--speculative-eagle-topk`` ``width``: its capture width is topk rows per request (0.5.17+
    ``resolve_num_tokens_per_req(phase="draft_decode")``; 0.5.15.post1 ``num_tokens_per_bs``)."""
    from sglang.srt.speculative.frozen_kv_mtp_cuda_graph_runner import FrozenKVMTPCudaGraphRunner
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    runner = draft_runner_standin(FrozenKVMTPCudaGraphRunner, SpeculativeAlgorithm.from_string("EAGLE"))
    runner.require_mlp_tp_gather, runner.max_bs, runner.capture_bs = draft_gather, MAX_BS, list(CAPTURE_BS)
    runner.topk = runner.num_tokens_per_bs = runner.captured_req_width = width
    return runner


def frozen_kv_replay_bs(view: Any, runner: Any) -> int:
    """STAND-IN for the bucket choice at the top of ``FrozenKVMTPCudaGraphRunner.execute`` (it needs captured graphs):
    ``max(global_num_tokens_cpu) // width**2`` when the runner gathers, else the request count (``batch_size //
    width`` of the topk-expanded batch), padded by SGLang's own ``_pad_to_bucket``."""
    width = runner.captured_req_width
    if runner.require_mlp_tp_gather:
        size = max(view.global_num_tokens_cpu) // (width * width)
    else:
        size = view.batch_size // width if runner.topk > 1 else view.batch_size
    return int(type(runner)._pad_to_bucket(int(size), runner.capture_bs))


def _frozen_kv_row(batch: Any, shape: tuple[str, int], model_runner: Any, local: int, draft_gather: bool) -> Any:
    """The frozen-KV MTP draft decode's graph decision and replay bucket (``FrozenKVMTPDraftWorker.draft``: its
    ``init_new`` with the draft model runner, the release's ``expand_for_topk_draft``, then ``can_run_graph``).
    None for the other forwards: its draft extend runs no forward, and an idle rank returns before ``init_new``."""
    if shape[0] != "decode" or not local:
        return {"frozen_kv_can_run_graph": None, "frozen_kv_replay_bs": None}
    from sglang.srt.speculative.frozen_kv_mtp_utils import expand_for_topk_draft

    view = _draft_view(batch, shape, model_runner, local, frozen_kv=True)
    expand_for_topk_draft(view, shape[1])
    runner = _frozen_kv_runner(draft_gather, shape[1])
    try:
        can_run: bool | str = bool(runner.can_run_graph(view))
    except Exception as exc:  # noqa: BLE001 - recorded: both sides must fail alike
        can_run = type(exc).__name__
    return {
        "frozen_kv_can_run_graph": can_run,
        "frozen_kv_replay_bs": frozen_kv_replay_bs(view, runner) if can_run is True else None,
    }


def _listed(value: Any) -> list[int] | None:
    return None if value is None else list(value)


def _row(view: Any, runner: Any) -> dict[str, Any]:
    try:
        can_run: bool | str = bool(runner.can_run_graph(view))
    except Exception as exc:  # noqa: BLE001 - recorded: both sides must fail alike
        can_run = type(exc).__name__
    return {
        "forward_mode": view.forward_mode.name,  # DECODE / DRAFT_EXTEND_V2, or IDLE on an idle rank
        "global_num_tokens_cpu": _listed(getattr(view, "global_num_tokens_cpu", None)),
        "global_num_tokens_for_logprob_cpu": _listed(getattr(view, "global_num_tokens_for_logprob_cpu", None)),
        "original_global_num_tokens_cpu": _listed(getattr(view, "original_global_num_tokens_cpu", None)),
        "can_run_graph": can_run,
        # The captured batch size the draft graph would replay (None: eager): the bucket choice of its replay.
        "replay_bs": draft_step_rows(view, runner, graph=True) if can_run is True else None,
    }


def _sync_info(local: int, counts: tuple[int, ...], gathered: bool) -> GatheredSyncInfoStandIn:
    return GatheredSyncInfoStandIn(local, list(counts) if gathered else None, logprob_differs=True)


@functools.cache
def _hf_config() -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(DUMMY_MODEL)


def _draft_model_runner(sa: Any) -> Any:
    """STAND-IN: the draft model runner (a model runner needs a model): the harness's null object, with the
    dummy model's real HF config (prepare_mlp_sync_batch asks whether it is hybrid-SSM: it is not) and an attention
    backend whose only answer is the padded rows' sequence length (torch_native's 1 on CPU); the torch_native
    attention backend named, so that ``init_new`` computes draft-extend positions on CPU (<= 0.5.17 reads it from
    the runner's ServerArgs)."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    fill = functools.partial(int, 1)
    return ModelRunnerStandIn(
        device="cpu", spec_algorithm=SpeculativeAlgorithm.from_string("EAGLE"), is_draft_worker=True,
        model_config=ModelRunnerStandIn(hf_config=_hf_config(), linear_attn_registry_result=None),
        mambaish_config=None, prefill_attention_backend_str="torch_native", server_args=TorchNativeView(sa),
        attn_backend=SimpleNamespace(get_cpu_graph_seq_len_fill_value=fill, get_cuda_graph_seq_len_fill_value=fill,
                                     init_forward_metadata=lambda *a: None),
    )  # fmt: skip


class _TorchUnpinned:
    """``torch`` whose ``tensor`` ignores ``pin_memory`` (see ``_DpRank``)."""

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch, name)

    @staticmethod
    def tensor(*args: Any, **kwargs: Any) -> Any:
        import torch

        kwargs.pop("pin_memory", None)
        return torch.tensor(*args, **kwargs)


class _DpRank:
    """STAND-IN for this rank's place in attention DP (the groups need the peer ranks): SGLang's own
    ``get_parallel().override``, and on <= 0.5.20 the ``dp_attention`` globals its ``get_attention_dp_size`` /
    ``_rank`` read; and ``forward_batch_info._is_cpu`` True (the forward runs on CPU here; SGLang reads it once at
    import from its CPU engine's env var, and pins memory otherwise); <= 0.5.17 pins unconditionally at the end of
    ``prepare_mlp_sync_batch`` (pinned memory needs an accelerator): that module's ``torch.tensor`` drops
    ``pin_memory``. Set for the call, restored after."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def __enter__(self) -> None:
        from sglang.srt.layers import dp_attention
        from sglang.srt.model_executor import forward_batch_info
        from sglang.srt.runtime_context import get_parallel

        self._saved = [(m, n, getattr(m, n)) for m, n in ((dp_attention, "_ATTN_DP_RANK"),
                       (dp_attention, "_ATTN_DP_SIZE"), (forward_batch_info, "_is_cpu"), (forward_batch_info, "torch"))
                       if hasattr(m, n)]  # fmt: skip
        values = {"_ATTN_DP_RANK": self.rank, "_ATTN_DP_SIZE": self.world, "torch": _TorchUnpinned()}
        for module, name, _ in self._saved:
            setattr(module, name, values.get(name, True))
        from sglang.srt import runtime_context as rc

        place = dict(
            attn_dp_rank=self.rank, attn_dp_size=self.world, attn_tp_size=1, attn_tp_rank=0, attn_cp_size=1,
            attn_cp_rank=0, tp_rank=self.rank, tp_size=self.world, moe_ep_size=self.world, moe_dp_size=1,
            moe_tp_size=1,
        )  # fmt: skip
        known = rc._parallel_fields() if hasattr(rc, "_parallel_fields") else rc._PARALLEL_FIELDS
        self._override = get_parallel().override(**{k: v for k, v in place.items() if k in known})
        self._override.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._override.__exit__(*exc)
        for module, name, value in self._saved:
            setattr(module, name, value)


def _draft_view(batch: Any, shape: tuple[str, int], runner: Any, local: int, frozen_kv: bool = False) -> Any:
    """The draft ForwardBatch of ``shape``'s forward, built by the release's own code from ``batch`` (``frozen_kv``:
    the frozen-KV MTP draft decode's, with its ``FrozenKVMTPDraftInput``)."""
    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    forward, width = shape
    decode_tensors(batch)
    kwargs: dict[str, Any] = {}
    if "return_hidden_states_before_norm" in inspect.signature(inspect.unwrap(ForwardBatch.init_new)).parameters:
        kwargs = {"return_hidden_states_before_norm": False}
    if forward == "plain":
        return ForwardBatch.init_new(batch, runner, **kwargs)
    if forward == "decode":
        from sglang.srt.speculative.eagle_info import EagleDraftInput
        from sglang.srt.speculative.frozen_kv_mtp_info import FrozenKVMTPDraftInput

        # STAND-IN for the end of the release's prepare_for_draft (it first assigns the draft's KV slots, which needs
        # the req-to-token pool): the draft decode's widths (topk rows per request) and positions, then init_new.
        spec = (FrozenKVMTPDraftInput if frozen_kv else EagleDraftInput)(
            topk_p=torch.ones((local, width)), topk_index=torch.zeros((local, width), dtype=torch.long),
            hidden_states=torch.zeros((local, 4)),
        )  # fmt: skip
        spec.num_tokens_per_req = spec.num_tokens_for_logprob_per_req = width
        spec.positions = batch.seq_lens.repeat_interleave(width, dim=0)
        batch.spec_info = spec
        return ForwardBatch.init_new(batch, runner, **kwargs)
    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput

    batch.model_config = SimpleNamespace(vocab_size=1000)  # STAND-IN: prepare_for_draft_extend checks ids with it
    extend_input = EagleDraftExtendInput(hidden_states=torch.zeros((local * width, 4)), num_tokens_per_req=width,
                                         num_tokens_for_logprob_per_req=width)  # fmt: skip
    predict = torch.zeros(local * width, dtype=torch.int64)
    try:
        from sglang.srt.speculative.eagle_worker_common import prepare_for_draft_extend
    except ImportError:  # 0.5.15.post1: a method of the worker that reads nothing of the worker
        from sglang.srt.speculative.base_spec_worker import EagleDraftWorkerBase

        return EagleDraftWorkerBase.prepare_for_draft_extend(None, extend_input, batch, predict, width, runner, None)
    return prepare_for_draft_extend(extend_input, batch, predict, width, runner, None, **kwargs)


def _eager(view: Any, runner: Any) -> dict[str, Any]:
    """The draft's eager forward from its counts: ``prepare_mlp_sync_batch`` (SGLang calls it when the counts are
    gathered; the padding mode and the gathered buffer's length), then this rank's ``num_token_non_padded``
    (``set_local_num_token_non_padded``, 0.5.20+; None where the release lacks it), under the draft's backend
    context as the draft worker runs its forwards."""
    from sglang.srt.layers.moe.utils import speculative_moe_a2a_backend_context

    out: dict[str, Any] = {"dp_padding_mode": None, "global_dp_buffer_len": None}
    with speculative_moe_a2a_backend_context():
        if view.global_num_tokens_cpu is not None:
            view.prepare_mlp_sync_batch(runner)
            out["dp_padding_mode"] = view.dp_padding_mode.name
            out["global_dp_buffer_len"] = int(view.global_dp_buffer_len)
        # 0.5.20+ only: <= 0.5.19's adjust_num_token_non_padded_for_attn_tp reads other inputs (not this value).
        out["num_token_non_padded"] = None
        if hasattr(view, "set_local_num_token_non_padded"):
            try:
                view.set_local_num_token_non_padded(sharded=False)
                value = view.num_token_non_padded
                out["num_token_non_padded"] = None if value is None else int(value)
            except Exception as exc:  # noqa: BLE001 - recorded: both sides must fail alike
                out["num_token_non_padded"] = type(exc).__name__
    return out


def draft_rows(target: str, draft: str, counts: tuple[int, ...], gathered: bool = True,
               shape: tuple[str, int] = SHAPES[0], published: Any = None) -> list[dict[str, Any]]:  # fmt: skip
    """Each rank's draft ForwardBatch counts, draft-graph decision and replay bucket, and the eager forward's
    padding mode, buffer length and ``num_token_non_padded``, for this release: 0.5.23 (upstream's fix: the
    oracle) or 0.5.15.post1-0.5.20 (stock, or with the plugin applied). ``gathered`` False: the gathered lists are
    None, as under SGLANG_SCHEDULER_SKIP_ALL_GATHER. ``published``: this deployment's ServerArgs, already published
    (``rows_by_case``); None: publish them here."""
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.scheduler_components.dp_attn import _update_gather_batch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    sa = published if published is not None else server_args(target, draft, world=len(counts))
    upstream = "draft_require_mlp_tp_gather" in inspect.signature(_update_gather_batch).parameters
    target_gather, draft_gather = _answers_0523() if upstream else gather_answers(sa)
    answers = (target_gather, draft_gather) if upstream else (target_gather,)
    algo = SpeculativeAlgorithm.from_string("EAGLE")
    rows = []
    for rank, local in enumerate(counts):
        reqs = [
            Req(f"r{rank}-{i}", "", array("i", [1, 2, 3, 4]), SamplingParams(max_new_tokens=8)) for i in range(local)
        ]
        mode = ForwardMode.DECODE if local else ForwardMode.IDLE
        batch = ScheduleBatch(reqs=reqs, forward_mode=mode, spec_algorithm=algo)
        _update_gather_batch(batch, _sync_info(local, counts, gathered), *answers)
        runner = _draft_model_runner(sa)
        with _DpRank(rank, len(counts)):
            row = _frozen_kv_row(batch, shape, runner, local, draft_gather)
            view = _draft_view(batch, shape, runner, local)
            row.update(_row(view, _runner(draft_gather, shape)))
            row.update(_eager(view, runner))
        rows.append(row)
    return rows


def rows_by_case(chosen: list[Case]) -> dict[Case, list[dict[str, Any]]]:
    """``draft_rows`` of each case, publishing each deployment's ServerArgs once (publishing is most of a case's
    cost) rather than once per case."""
    out: dict[Case, list[dict[str, Any]]] = {}
    deployments = sorted({(t, d, len(c)) for t, d, c, _, _ in chosen})
    for target, draft, world in deployments:
        sa = server_args(target, draft, world=world)
        for case in chosen:
            if (case[0], case[1], len(case[2])) == (target, draft, world):
                out[case] = draft_rows(*case, published=sa)
    return out


class TorchNativeView:
    """STAND-IN: the runner's ServerArgs (read-only once resolved) with the torch_native attention backend, so that
    ``init_new`` computes extend positions on CPU."""

    attention_backend = "torch_native"

    def __init__(self, server_args: Any):
        self._server_args = server_args

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server_args, name)
