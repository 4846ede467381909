"""Code that runs inside one CPU rank process.

REAL SGLang (unmodified, from the installed release): ``ServerArgs`` + publish, ``init_distributed_environment``
(gloo) + ``initialize_model_parallel``, ``ScheduleBatch``/``Req``/``SamplingParams``, ``EagleDraftInput`` (and its
``merge_batch``), ``SchedulerDisaggregationDecodeMixin.get_next_disagg_decode_batch_to_run``,
``SchedulerDPAttnAdapter.maybe_prepare_mlp_sync_batch``, ``prepare_mlp_sync_batch_raw`` with ``MLPSyncBatchInfo``
and ``_update_gather_batch``, ``EAGLEWorkerV2.requires_dp_attention_eager_forward`` (when the plugin adds it) and
``EAGLEDraftCudaGraphRunner.can_run_graph``.

STAND-INS (each needs a GPU model, KV pools or a live scheduler to exist for real), all named ``*StandIn``:
  * ``SchedulerStandIn``: the attributes ``get_next_disagg_decode_batch_to_run`` reads from a ``Scheduler``
    (no new prebuilt batch; ``update_running_batch`` returns the batch unchanged).
  * ``AdapterStandIn``: a ``SchedulerDPAttnAdapter`` (frozen; needs a model runner and KV pools) whose
    ``maybe_prepare_mlp_sync_batch`` is SGLang's real function and whose ``prepare_mlp_sync_batch`` calls the real
    ``prepare_mlp_sync_batch_raw`` with this rank's real process group.
  * ``model_runner`` / draft worker: ``SimpleNamespace`` with only the attributes the real code reads.
  * The EAGLE worker and the draft CUDA-graph runner are real classes created without ``__init__`` (which loads a
    model / captures graphs); only the attributes their real methods read are set.
  * ``ModelRunnerStandIn`` for the real ``ForwardBatch.init_new`` (a permissive null object: every attribute the
    real code reads is falsy/empty, as for a runner without LoRA, canaries, DCP or n-gram embeddings), and the
    decode tensors ``prepare_for_decode`` would set on the batch (``decode_tensors``).
  * ``draft_guard``: the stock seedless guard inside ``EagleDraftWorker.draft`` (``can_run and not idle and
    seed_dsa_topk_from_draft_extend and dsa_topk_indices is None``), evaluated on the seed the ``FutureMap`` would
    resolve; ``draft()`` itself needs a model.
"""

from __future__ import annotations

import bisect
import gc
import inspect
import os
import time
from array import array
from types import SimpleNamespace
from typing import Any

_ctx: dict[str, Any] = {}


def publish_server_args(sa: Any, rank: int = 0) -> None:
    """Make ``sa`` the process-wide ServerArgs the way this release's scheduler process does."""
    from sglang.srt import server_args as sa_mod

    try:
        from sglang.srt import runtime_context as rc
    except ImportError:
        rc = None
    if rc is None or not hasattr(rc, "publish"):
        sa_mod.set_global_server_args_for_scheduler(sa)
    elif "ranks" in inspect.signature(rc.publish).parameters:
        rc.publish(sa, role="scheduler", ranks=rc.SpawnRanks(world_rank=rank))
    else:
        rc.publish(sa, role="scheduler")


def setup(rank: int, world: int, port: int, model_path: str, load_plugins: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    import sglang  # noqa: F401
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.server_args import ServerArgs

    if load_plugins:
        from sglang.srt.plugins import load_plugins as sglang_load_plugins

        sglang_load_plugins()
    sa = ServerArgs(
        model_path=model_path, device="cpu", tp_size=world, dp_size=world, enable_dp_attention=True,
        skip_tokenizer_init=True, load_format="dummy",
    )  # fmt: skip
    publish_server_args(sa, rank)
    _ctx["server_args"] = sa  # the baseline deployment (configure() without a backend pair goes back to it)
    ps.init_distributed_environment(
        backend="gloo", world_size=world, rank=rank, local_rank=rank,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
    )  # fmt: skip
    if "tensor_model_parallel_size" in inspect.signature(ps.initialize_model_parallel).parameters:
        ps.initialize_model_parallel(tensor_model_parallel_size=world, attention_data_parallel_size=world)
    else:
        ps.initialize_model_parallel()
    import datetime

    import torch.distributed as dist

    # The draft step's emulated collectives run on their own group with a bounded timeout (10 s).
    _ctx["path_group"] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=10))
    _ctx.update(rank=rank, world=world)
    if os.environ.get(LOCAL_GATHER_ENV):
        _install_local_gather(dist)
    from importlib.metadata import version

    return {"rank": rank, "sglang": version("sglang"), "setup_s": round(time.perf_counter() - t0, 2)}


# Benchmarks: SGLang's MLP-sync all-gather replaced by a local copy, so a rank's round is timed without waiting on
# (or spinning for) its peer. Never set by the tests.
LOCAL_GATHER_ENV = "SGLANG_DP_MTP_FIX_HARNESS_LOCAL_GATHER"
# Benchmarks: no cyclic GC inside a batch of rounds (collected before it instead). Never set by the tests.
QUIET_GC_ENV = "SGLANG_DP_MTP_FIX_HARNESS_QUIET_GC"


def _install_local_gather(dist: Any) -> None:
    """STAND-IN for ``torch.distributed.all_gather_into_tensor`` (bench only): every slot of the gathered tensor gets
    this rank's own row, as if every peer sent the same. The rest of SGLang's sync (its group objects, the tensors,
    the decoding of the gathered rows) is unchanged."""

    def all_gather_into_tensor(output: Any, input: Any, group: Any = None, async_op: bool = False) -> None:
        rows = output.numel() // input.numel()
        output.view(rows, input.numel()).copy_(input.reshape(1, -1).expand(rows, -1))

    dist.all_gather_into_tensor = all_gather_into_tensor


def _parameters(key: str, fn: Any) -> Any:
    """A function's parameters, looked up once per process (per-round introspection would skew the timings)."""
    cache = _ctx.setdefault("parameters", {})
    if key not in cache:
        cache[key] = inspect.signature(inspect.unwrap(fn)).parameters
    return cache[key]


def gather_answers() -> tuple[bool, bool]:
    """(target, draft) ``require_mlp_tp_gather`` of this process's published ServerArgs, from SGLang: the target's
    as the scheduler computes it, the draft runner's inside ``speculative_moe_a2a_backend_context()``. Once per
    configuration (``configure`` clears it): one scheduler process has one ServerArgs."""
    if "answers" not in _ctx:
        from sglang_dp_mtp_fix.harness.draft_counts import gather_answers as answers_of

        _ctx["answers"] = answers_of(_ctx["server_args"])
    return _ctx["answers"]  # type: ignore[no-any-return]


def configure(command: dict[str, Any]) -> dict[str, Any]:
    """One deployment on every rank together: ``{"backends": [TARGET, DRAFT] | None, "patched": bool}``.

    Publishes this rank's ServerArgs with ``--moe-a2a-backend TARGET --speculative-moe-a2a-backend DRAFT`` (the
    baseline ServerArgs of ``setup`` when None) and initializes the MoE config from it, as a scheduler process does
    at start; then applies the plugin afresh under it (its patches read the configuration at application, e.g.
    draft_token_counts' draft answer) or leaves SGLang stock."""
    from sglang_dp_mtp_fix.harness import draft_counts

    backends = command.get("backends")
    _ctx.setdefault("baseline", _ctx["server_args"])
    if backends:
        target, draft = backends
        _ctx["server_args"] = draft_counts.server_args(target, draft, world=_ctx["world"], rank=_ctx["rank"])
    else:
        _ctx["server_args"] = _ctx["baseline"]
        publish_server_args(_ctx["server_args"], _ctx["rank"])
        draft_counts.initialize_moe_config(_ctx["server_args"])
    _ctx.pop("answers", None)
    answers = gather_answers()
    plugin("restore")
    statuses = plugin({"command": "apply", "env": command.get("env") or {}})["statuses"] if command["patched"] else {}
    return {"rank": _ctx["rank"], "statuses": statuses, "target_gathers": answers[0], "draft_gathers": answers[1]}


class AdapterStandIn:
    def __init__(self, world: int, get_idle_batch: Any, model_runner: Any):
        from sglang.srt.distributed import parallel_state as ps
        from sglang.srt.managers.scheduler_components import dp_attn

        self._dp_attn = dp_attn
        target_gathers, draft_gathers = gather_answers()
        params = _parameters("prepare_mlp_sync_batch_raw", dp_attn.prepare_mlp_sync_batch_raw)
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


def _draft_input(seed: bool, overlap: bool, future_flag: bool | None, n: int) -> Any:
    import torch
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    dev = _ctx.get("device", "cpu")
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


def _guard_exists() -> bool:
    if "guard" not in _ctx:
        from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker

        from sglang_dp_mtp_fix.patches._detect import _has_seedless_eager_fallback

        _ctx["guard"] = _has_seedless_eager_fallback(EagleDraftWorker.draft)
    return bool(_ctx["guard"])


def resolved_seed_present(spec_info: Any) -> bool:
    """The seed ``FutureMap._resolve_spec_extras`` leaves for the draft guard (flag decides under overlap)."""
    if getattr(spec_info, "future_indices", None) is not None:
        return bool(spec_info.future_dsa_topk_indices_available)
    return getattr(spec_info, "dsa_topk_indices", None) is not None


def run_round(state: dict[str, Any]) -> dict[str, Any]:
    """One PD-decode scheduling round on this rank. ``state`` describes the rank's local situation:

    kind: "none" (no running batch) | "idle" (idle batch) | "decode"
    seed: bool (DSA top-k seed present), overlap: bool, future_flag: bool | None,
    merge_seedless_prebuilt: bool (a seeded running batch absorbs a seedless prebuilt batch, overlap-style),
    seed_from_draft_extend: bool, has_draft_worker: bool, num_reqs: int
    """
    import torch  # noqa: F401
    from sglang.srt.disaggregation.decode import SchedulerDisaggregationDecodeMixin
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    rank = _ctx["rank"]
    t0 = time.perf_counter()
    c0 = time.thread_time()
    spec_algo = SpeculativeAlgorithm.from_string("EAGLE")
    model_runner = SimpleNamespace(prefill_cuda_graph_runner=None, spec_algorithm=spec_algo, model_config=None)

    def idle_batch() -> Any:
        return ScheduleBatch(reqs=[], forward_mode=ForwardMode.IDLE, spec_algorithm=spec_algo)

    kind = state.get("kind", "decode")
    n = int(state.get("num_reqs", 1))
    if kind == "decode":
        reqs = [Req(f"r{rank}-{i}", "", array("i", [1, 2, 3, 4]), SamplingParams(max_new_tokens=8)) for i in range(n)]
        running = ScheduleBatch(reqs=reqs, forward_mode=ForwardMode.DECODE, spec_algorithm=spec_algo)
        spec = _draft_input(
            bool(state.get("seed", True)), bool(state.get("overlap", False)), state.get("future_flag"), n
        )
        if state.get("merge_seedless_prebuilt"):
            spec.merge_batch(_draft_input(False, True, False, 1))  # real EagleDraftInput.merge_batch
        running.spec_info = spec
    elif kind == "idle":
        running = idle_batch()
    else:
        running = ScheduleBatch(reqs=[], forward_mode=ForwardMode.DECODE, spec_algorithm=spec_algo)  # empty

    spec_worker = object.__new__(EAGLEWorkerV2)  # real class; __init__ would load a model
    spec_worker._draft_worker = (
        SimpleNamespace(seed_dsa_topk_from_draft_extend=bool(state.get("seed_from_draft_extend", True)))
        if state.get("has_draft_worker", True)
        else None
    )
    adapter = AdapterStandIn(_ctx["world"], idle_batch, model_runner)
    scheduler = SchedulerStandIn(running, spec_worker, adapter)
    fn = SchedulerDisaggregationDecodeMixin.get_next_disagg_decode_batch_to_run
    c1 = time.thread_time()
    if (
        len(_parameters("get_next_disagg_decode_batch_to_run", fn)) > 1
    ):  # 0.5.16+: (self, running_batch) -> NextBatchPlan
        batch = fn(scheduler, running).batch_to_run
    else:  # 0.5.15.post1: (self) -> Optional[ScheduleBatch]
        batch = fn(scheduler)
    # CPU time of SGLang's own round alone (get_next_disagg_decode_batch_to_run: the PD-decode round + MLP sync),
    # without building this round's batch
    round_cpu_ms = (time.thread_time() - c1) * 1e3
    sync_ms = (time.perf_counter() - t0) * 1e3
    sync_cpu_ms = (time.thread_time() - c0) * 1e3  # CPU time of this rank's round (excludes waiting on peers)
    if batch is None:  # nothing was gathered for this rank (no DP peers active)
        return {
            "rank": rank,
            "ran": False,
            "sync_ms": sync_ms,
            "sync_cpu_ms": sync_cpu_ms,
            "round_cpu_ms": round_cpu_ms,
        }

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
    # The guard exists from 0.5.15.post1 (#30839); on older releases a seedless draft replays the graph.
    seed_flag = (
        bool(state.get("seed_from_draft_extend", True)) and state.get("has_draft_worker", True) and _guard_exists()
    )
    spec_info = getattr(run_batch, "spec_info", None)
    guard_eager = (not is_idle) and seed_flag and spec_info is not None and not resolved_seed_present(spec_info)
    draft_graph = runner_graph and not guard_eager
    draft_rows = draft_step_rows(view, runner, draft_graph)
    cause = None
    if not draft_graph:
        if guard_eager and runner_graph:
            cause = "local seedless guard"
        elif guard_eager:
            cause = "own seedless batch"
        elif draft_vote is False:
            cause = "another rank's vote"
        elif (draft_step_rows(view, runner, False) or view.batch_size) > runner.max_bs:
            cause = "above the draft graph's max_bs"
        else:
            cause = "generic graph refused"
    return {
        "rank": rank,
        "ran": True,
        "idle": is_idle,
        "num_tokens": 0 if is_idle else len(run_batch.reqs),
        "global_num_tokens": list(getattr(run_batch, "global_num_tokens", None) or []),
        "decode_graph": decode_vote,  # target verify + draft extend follow the generic vote
        "draft_vote": draft_vote,
        "forward_batch_draft_vote": view.__dict__.get("can_run_dp_draft_cuda_graph"),
        "force_disable_draft_cuda_graph": getattr(batch, "force_disable_draft_cuda_graph", None),
        "runner_graph": runner_graph,
        "draft_path": "graph" if draft_graph else "eager",
        "draft_gathers": bool(runner.require_mlp_tp_gather),
        "draft_rows": draft_rows,
        "draft_bucket": draft_rows if draft_graph else None,
        "eager_cause": cause,
        "sync_ms": sync_ms,
        "sync_cpu_ms": sync_cpu_ms,
        "round_cpu_ms": round_cpu_ms,
    }


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
    dev = _ctx.get("device", "cpu")  # "cuda:<rank>" when bench/gpu drives the harness
    batch.input_ids = torch.ones((n,), dtype=torch.int64, device=dev)
    batch.seq_lens = torch.full((n,), 4, dtype=torch.int64, device=dev)
    batch.seq_lens_cpu = torch.full((n,), 4, dtype=torch.int64)
    batch.orig_seq_lens = batch.seq_lens.clone()
    batch.req_pool_indices = torch.arange(n, dtype=torch.int64, device=dev)
    batch.out_cache_loc = torch.arange(n, dtype=torch.int64, device=dev)
    batch.seq_lens_sum = 4 * n


def real_forward_batch(batch: Any, spec_algo: Any) -> Any:
    """SGLang's real ``ForwardBatch.init_new`` (wrapped by the plugin when it is applied) on the synced batch, as the
    draft builds it: with the draft model runner (``is_draft_worker``, read by 0.5.21+ and draft_token_counts)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    decode_tensors(batch)
    runner = ModelRunnerStandIn(device=_ctx.get("device", "cpu"), spec_algorithm=spec_algo, is_draft_worker=True)
    init = ForwardBatch.init_new
    kwargs = {"return_hidden_states_before_norm": False}
    if "return_hidden_states_before_norm" not in _parameters("ForwardBatch.init_new", init):
        kwargs = {}
    return init(batch, runner, **kwargs)


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


# Draft CUDA-graph batch sizes the emulated draft graph was captured at (as with --cuda-graph-bs 8 16 32 64 128): a
# replay pads up to the next captured size, while the eager path pads to the live maximum (GPU recipe's toy: 8 vs 3).
GRAPH_BUCKETS = (8, 16, 32, 64, 128)
# The draft runner stand-in's captured batch sizes (max_bs = the last): the same buckets up to 64.
DRAFT_CAPTURE_BS = GRAPH_BUCKETS[:4]
HIDDEN = 8  # row width of the emulated draft-step all-gathers
DRAFT_STEPS = 3  # --speculative-num-steps of the reproduced deployment


def graph_rows(max_tokens: int) -> int:
    return next((b for b in GRAPH_BUCKETS if b >= max_tokens), max_tokens)


class CollectiveCounter:
    """Counts the torch.distributed collectives SGLang issues inside the MLP sync (harness instrumentation)."""

    NAMES = ("all_gather_into_tensor", "all_gather", "all_reduce", "broadcast", "gather", "all_gather_single")

    def __init__(self) -> None:
        self.count = 0
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> CollectiveCounter:
        import torch.distributed as dist

        for name in self.NAMES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._saved[name] = original

            def counted(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                self.count += 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed as dist

        for name, original in self._saved.items():
            setattr(dist, name, original)


def path_collective(result: dict[str, Any], guarded: bool = True) -> dict[str, Any]:
    """The draft step's collectives as this rank's chosen path would issue them.

    Graph replay gathers rows padded to the captured batch size; the eager path gathers rows padded to the live
    maximum. Ranks on different paths issue all-gathers of different sizes: NCCL hangs, gloo aborts the process.
    Guarded (default): the harness first exchanges a fixed-size (path, rows) descriptor (its own pre-flight, not
    SGLang's) and only issues the real all-gathers when every rank agrees; otherwise it reports the split, naming
    the ranks. Unguarded: the all-gathers are issued as chosen, and a split ends in the real failure (the ranks
    abort or time out after 10 s); ``simulate --unguarded`` shows that once per arm.
    """
    import torch
    import torch.distributed as dist

    group = _ctx["path_group"]
    world = dist.get_world_size(group)
    graph = result.get("draft_path") == "graph"
    if "draft_rows" in result:
        # A draft that does not gather has no gathered MoE: only its path is compared (1 row each).
        rows = result["draft_rows"] if result["draft_rows"] is not None else 1
    else:
        tokens = result.get("global_num_tokens") or [0]
        rows = graph_rows(max(tokens)) if graph else max(tokens)
    paths = None
    if guarded:
        descriptor = torch.tensor([1 if graph else 0, rows], dtype=torch.int64)
        gathered = torch.empty((world * 2,), dtype=torch.int64)
        dist.all_gather_into_tensor(gathered, descriptor, group=group)
        paths = [tuple(x) for x in gathered.view(world, 2).tolist()]
        if len(set(paths)) > 1:
            return {"collective": "split", "paths": paths}
    for _ in range(DRAFT_STEPS):
        out = torch.empty((world * rows, HIDDEN))
        dist.all_gather_into_tensor(out, torch.full((rows, HIDDEN), float(_ctx["rank"])), group=group)
    return {"collective": "ok", "paths": paths}


def run_rounds(states: list[dict[str, Any]], collective: bool = True) -> list[dict[str, Any]]:
    """Many rounds in a row (ranks stay in lock-step through SGLang's own sync); one reply for the batch.

    A state may carry ``"_unguarded": true`` to issue that round's draft-step collectives without the pre-flight.
    """
    out = []
    # Benchmarks: the cyclic GC collects between calls, never inside a timed round (its pauses were the largest
    # noise of the per-round timings: an A/A pair of stock arms differed by up to 11 us with it on).
    quiet_gc = bool(os.environ.get(QUIET_GC_ENV))
    if quiet_gc:
        gc.collect()
        gc.disable()
    try:
        for state in states:
            with CollectiveCounter() as counter:
                result = run_round(state)
            result["sync_collectives"] = counter.count
            if collective and result.get("ran"):
                result.update(path_collective(result, guarded=not state.get("_unguarded", False)))
            out.append(result)
    finally:
        if quiet_gc:
            gc.enable()
    return out


def _passthrough_seams(p: Any) -> list[str]:
    """Bench only: SGLang stock, except that every function the plugin wraps is wrapped by a wrapper that only calls
    the original (same seams, same number of frames, none of the plugin's work): the cost of wrapping those seams at
    all. The plugin is applied once to learn its seams, then restored."""
    import functools

    from sglang_dp_mtp_fix import stats

    p.register()
    seams = [(ch.owner, ch.attr, ch.original, ch.patch_id or "plugin") for ch in p.get_manager()._changes]
    p.restore()
    stats.activate(None)
    names = []
    for owner, attr, original, patch_id in seams:
        bound = isinstance(original, classmethod)
        if not (callable(original) or bound):
            continue  # an ADD (hook or class default): stock has no such attribute and never calls it
        func = original.__func__ if bound else original

        def through(*args: Any, _f: Any = func, **kwargs: Any) -> Any:
            return _f(*args, **kwargs)

        wrapper = functools.wraps(func)(through)
        setattr(owner, attr, classmethod(wrapper) if bound else wrapper)
        _ctx.setdefault("passthrough", []).append((owner, attr, original))
        names.append(f"{patch_id}:{getattr(owner, '__name__', owner)}.{attr}")
    return names


def _undo_passthrough() -> None:
    for owner, attr, original in reversed(_ctx.pop("passthrough", [])):
        setattr(owner, attr, original)


def plugin(command: str | dict[str, Any]) -> dict[str, Any]:
    """apply / restore the plugin in this rank (all ranks do it together), or read its vote counters.

    ``{"command": "apply", "env": {...}}`` applies under extra environment variables (e.g. the stats switch);
    ``{"command": "export_metrics", "env": {"PROMETHEUS_MULTIPROC_DIR": d}, "labels": {...}}`` exports the counters.
    """
    from sglang_dp_mtp_fix import plugin as p
    from sglang_dp_mtp_fix import stats

    env: dict[str, str] = {}
    command_labels: dict[str, str] = {}
    if isinstance(command, dict):
        env = dict(command.get("env") or {})
        command_labels = dict(command.get("labels") or {})
        command = command["command"]
    if command == "stats":
        counters = stats.active()
        return {"rank": _ctx["rank"], "stats": counters.total.as_dict() if counters else None}
    if command == "export_metrics":
        # What the end of Scheduler.__init__ does when SGLang runs with --enable-metrics, for a scheduler whose
        # metrics collector carries ``labels`` (the stand-in holds only what metrics.install reads).
        from sglang_dp_mtp_fix import _version, metrics
        from sglang_dp_mtp_fix.config import PROMETHEUS_DIR_ENV

        # Set before prometheus_client is imported (it picks multiprocess mode then, as in SGLang), unset after: a
        # later apply in this rank must not see metrics on.
        os.environ[PROMETHEUS_DIR_ENV] = env[PROMETHEUS_DIR_ENV]
        scheduler = SimpleNamespace(metrics_collector=SimpleNamespace(labels=dict(command_labels)))
        try:
            line = metrics.install(scheduler, p.get_manager().outcomes or [], _version.__version__)
        finally:
            os.environ.pop(PROMETHEUS_DIR_ENV)
        return {"rank": _ctx["rank"], "line": line}
    _undo_passthrough()
    if command == "passthrough":
        return {"rank": _ctx["rank"], "seams": _passthrough_seams(p)}
    if command == "apply":
        saved = {k: os.environ.get(k) for k in env}
        if env:
            p.restore()  # the configuration is read at application: re-apply under the new environment
            stats.activate(None)
        os.environ.update(env)
        try:
            outcomes = p.register()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        return {"rank": _ctx["rank"], "statuses": {o.id: o.status.value for o in outcomes}}
    p.restore()
    stats.activate(None)
    return {"rank": _ctx["rank"], "statuses": {}}
