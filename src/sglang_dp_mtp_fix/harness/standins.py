"""The harness's stand-ins: each replaces something that needs a GPU model, KV pools or a live scheduler to exist.

* ``SchedulerStandIn``: the attributes ``get_next_disagg_decode_batch_to_run`` reads from a ``Scheduler``
  (no new prebuilt batch; ``update_running_batch`` returns the batch unchanged).
* ``AdapterStandIn``: a ``SchedulerDPAttnAdapter`` (frozen; needs a model runner and KV pools) whose
  ``maybe_prepare_mlp_sync_batch`` is SGLang's real function and whose ``prepare_mlp_sync_batch`` calls the real
  ``prepare_mlp_sync_batch_raw`` with this rank's real process group.
* ``model_runner`` / draft worker: ``SimpleNamespace`` with only the attributes the real code reads.
* The EAGLE worker and the draft CUDA-graph runner (``draft_runner_standin``) are real classes created without
  ``__init__`` (which loads a model / captures graphs); only the attributes their real methods read are set.
* ``ModelRunnerStandIn`` for the real ``ForwardBatch.init_new`` (a permissive null object: every attribute the
  real code reads is falsy/empty, as for a runner without LoRA, canaries, DCP or n-gram embeddings), and the
  decode tensors ``prepare_for_decode`` would set on the batch (``decode_tensors``).
* ``draft_input_standin``: an ``EagleDraftInput`` with the fields the PD producer / overlap scheduler set.
* ``stock_guard_goes_eager``: the stock seedless guard inside ``EagleDraftWorker.draft`` (``can_run and not idle
  and seed_dsa_topk_from_draft_extend and dsa_topk_indices is None``), evaluated on the seed the ``FutureMap``
  would resolve; ``draft()`` itself needs a model.
* ``draft_step_rows``: the bucket choice at the top of the draft graph runner's replay.
"""

from __future__ import annotations

import bisect
import inspect
import os
import re
from types import SimpleNamespace
from typing import Any

from sglang_dp_mtp_fix.harness.context import CONTEXT, parameters

# Draft CUDA-graph batch sizes the emulated draft graph was captured at (as with --cuda-graph-bs 8 16 32 64 128): a
# replay pads up to the next captured size, while the eager path pads to the live maximum (GPU recipe's toy: 8 vs 3).
GRAPH_BUCKETS = (8, 16, 32, 64, 128)
# The draft runner stand-in's captured batch sizes (max_bs = the last): the same buckets up to 64.
DRAFT_CAPTURE_BS = GRAPH_BUCKETS[:4]


class AdapterStandIn:
    def __init__(self, world: int, get_idle_batch: Any, model_runner: Any, gathers: tuple[bool, bool]):
        from sglang.srt.distributed import parallel_state as ps
        from sglang.srt.managers.scheduler_components import dp_attn

        self._dp_attn = dp_attn
        target_gathers, draft_gathers = gathers
        params = parameters("prepare_mlp_sync_batch_raw", dp_attn.prepare_mlp_sync_batch_raw)
        kw: dict[str, Any] = dict(
            model_runner=model_runner, get_idle_batch=get_idle_batch, disable_cuda_graph=False,
            require_mlp_tp_gather=target_gathers, offload_tags=set(),
            disable_overlap_schedule=bool(os.environ.get("SGLANG_DP_MTP_FIX_HARNESS_DEVICE_GROUP")),
        )  # fmt: skip
        if "tp_group" in params:
            kw.update(dp_size=world, attn_tp_size=1, attn_cp_size=1, tp_group=ps.get_tp_group())
        if "draft_require_mlp_tp_gather" in params:  # 0.5.21+
            kw["draft_require_mlp_tp_gather"] = draft_gathers
        self._kw = {k: v for k, v in kw.items() if k in params}

    def get_require_mlp_sync(self) -> bool:
        return True

    def prepare_mlp_sync_batch(self, local_batch: Any) -> Any:
        return self._dp_attn.prepare_mlp_sync_batch_raw(local_batch, **self._kw)

    def maybe_prepare_mlp_sync_batch(self, batch: Any, need_sync: Any = None) -> Any:
        # SGLang's real method, looked up on the class at call time (so a plugin wrapper is used when applied).
        return self._dp_attn.SchedulerDPAttnAdapter.maybe_prepare_mlp_sync_batch(self, batch, need_sync)


class SchedulerStandIn:
    def __init__(self, running_batch: Any, spec_worker: Any, adapter: Any):
        self.running_batch = running_batch
        self.draft_worker = spec_worker
        self.dp_attn_adapter = adapter
        self.chunked_req = None
        self.enable_hisparse = False
        self.scheduler_stage_metrics = None  # 0.5.20+ stage decorator: no recorder

    def get_new_prebuilt_batch(self, *args: Any) -> None:
        return None

    def update_running_batch(self, batch: Any) -> Any:
        return batch


def draft_input_standin(seed: bool, overlap: bool, future_flag: bool | None, n: int) -> Any:
    """A real ``EagleDraftInput`` of ``n`` requests, with or without a DSA top-k seed, as overlap leaves it."""
    import torch
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    dev = CONTEXT.device
    di = EagleDraftInput(
        topk_p=torch.ones((n, 1), device=dev), topk_index=torch.zeros((n, 1), dtype=torch.long, device=dev),
        hidden_states=torch.zeros((n, 4), device=dev), bonus_tokens=torch.zeros((n,), dtype=torch.long, device=dev),
        dsa_topk_indices=torch.zeros((n, 8), dtype=torch.int32, device=dev) if seed else None,
    )  # fmt: skip
    if hasattr(di, "num_tokens_per_req"):
        # What the EAGLE worker sets before the draft decode (topk = 1): -1 (unset) would scale the draft's DP counts
        # negative in ForwardBatch.init_new (0.5.15.post1's can_run_graph then passes any size).
        di.num_tokens_per_req = di.num_tokens_for_logprob_per_req = 1
    if overlap:
        di.future_indices = torch.arange(n, device=dev)
        di.future_dsa_topk_indices_available = seed if future_flag is None else future_flag
    if "cuda_graph_compatible" in getattr(type(di), "__dataclass_fields__", {}):
        # 0.5.21+: STAND-IN for the PD producer (build_eagle_disagg_draft_input), which marks a seedless input
        # as not draft-graph compatible; merge_batch then ANDs it like the future flag.
        di.cuda_graph_compatible = seed if future_flag is None else bool(future_flag)
    return di


# The harness models stock SGLang's guard without the plugin's code (neither ``_detect`` nor
# ``future_seed_authority.draft_seed_present``): the patched arm's vote is cast on the plugin's reading of the seed,
# and the path a rank then takes must come from an independent reading, or a wrong one would agree with itself.
_STOCK_SEEDLESS_CHECK = re.compile(r"\.dsa_topk_indices\s+is\s+None\b")


def stock_seed_guard_exists() -> bool:
    """Whether this release's ``EagleDraftWorker.draft`` drops to eager for a missing DSA seed (from 0.5.15.post1,
    #30839; before it a seedless draft replays the graph). Read from its source once per process."""
    if CONTEXT.stock_seed_guard is None:
        from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker

        source = inspect.getsource(inspect.unwrap(EagleDraftWorker.draft))
        CONTEXT.stock_seed_guard = _STOCK_SEEDLESS_CHECK.search(source) is not None
    return CONTEXT.stock_seed_guard


def resolved_seed_present(spec_info: Any) -> bool:
    """The seed ``FutureMap._resolve_spec_extras`` leaves for the draft guard (flag decides under overlap)."""
    if getattr(spec_info, "future_indices", None) is not None:
        return bool(spec_info.future_dsa_topk_indices_available)
    return getattr(spec_info, "dsa_topk_indices", None) is not None


def stock_guard_goes_eager(state: dict[str, Any], is_idle: bool, spec_info: Any) -> bool:
    """STAND-IN for the seedless guard inside ``EagleDraftWorker.draft``: True when it sends this rank eager."""
    seed_flag = (
        bool(state.get("seed_from_draft_extend", True))
        and state.get("has_draft_worker", True)
        and stock_seed_guard_exists()
    )
    return (not is_idle) and bool(seed_flag) and spec_info is not None and not resolved_seed_present(spec_info)


class _Null:
    """Falsy, empty, callable: what a model runner without optional features answers."""

    def __bool__(self) -> bool:
        return False

    def __call__(self, *args: Any, **kwargs: Any) -> _Null:
        return _Null()

    def __getattr__(self, name: str) -> _Null:
        return _Null()

    def __gt__(self, other: Any) -> bool:
        return False

    __lt__ = __ge__ = __le__ = __gt__

    def __int__(self) -> int:
        return 0

    def __iter__(self) -> Any:
        return iter(())


class ModelRunnerStandIn(SimpleNamespace):
    def __getattr__(self, name: str) -> Any:
        return _Null()


def decode_tensors(batch: Any) -> None:
    """STAND-IN for ``prepare_for_decode``: the per-request tensors a decode/idle batch carries into init_new."""
    import torch

    n = len(batch.reqs)
    dev = CONTEXT.device
    batch.input_ids = torch.ones((n,), dtype=torch.int64, device=dev)
    batch.seq_lens = torch.full((n,), 4, dtype=torch.int64, device=dev)
    batch.seq_lens_cpu = torch.full((n,), 4, dtype=torch.int64)
    batch.orig_seq_lens = batch.seq_lens.clone()
    batch.req_pool_indices = torch.arange(n, dtype=torch.int64, device=dev)
    batch.out_cache_loc = torch.arange(n, dtype=torch.int64, device=dev)
    batch.seq_lens_sum = 4 * n


def draft_runner_standin(runner_cls: Any, spec_algo: Any) -> Any:
    runner = object.__new__(runner_cls)  # real class; __init__ captures CUDA graphs
    for name, value in dict(
        require_mlp_tp_gather=True, require_mlp_sync=True, disable_padding=False, max_bs=DRAFT_CAPTURE_BS[-1],
        capture_bs=list(DRAFT_CAPTURE_BS), num_tokens_per_bs=1, captured_req_width=1,
        model_runner=SimpleNamespace(spec_algorithm=spec_algo),
    ).items():  # fmt: skip
        setattr(runner, name, value)
    return runner


def draft_step_rows(view: Any, runner: Any, graph: bool) -> int | None:
    """The rows the draft step's gathered MoE runs with on this rank: the captured bucket it replays (graph) or the
    live maximum of the draft's counts (eager); None when the draft does not gather (its a2a backend dispatches).

    STAND-IN for the bucket choice at the top of ``EAGLEDraftCudaGraphRunner`` replay (its ``execute`` needs captured
    graphs): the size it pads (``max(global_num_tokens_cpu) // captured_req_width`` when the runner gathers, the
    local batch size otherwise), padded by SGLang's own ``_pad_to_bucket`` where the release has it."""
    counts = [c // runner.captured_req_width for c in getattr(view, "global_num_tokens_cpu", None) or []]
    if graph:
        size = max(counts, default=0) if runner.require_mlp_tp_gather else view.batch_size
        pad = getattr(type(runner), "_pad_to_bucket", None)
        if pad is not None:
            return int(pad(int(size), runner.capture_bs))
        return int(runner.capture_bs[bisect.bisect_left(runner.capture_bs, size)])
    return max(counts, default=0) if runner.require_mlp_tp_gather else None
