"""TEST-ONLY SGLang plugin ``seedless_trigger``: the seed's hang trigger on a model without DSA attention.

Not product code: it lives in bench/gpu/server/, is never installed with sglang-dp-mtp-fix, and acts only in a
scheduler process whose environment sets ``SEEDLESS_TRIGGER_DIR``. It never imports or touches the plugin.

What it emulates. The reported hang needs a *seeding* EAGLE draft worker (GLM-5.2 MTP with IndexShare: the draft
step reads a DSA top-k seed published by the previous draft-extend) and a PD arrival that has no seed yet. SGLang's
own guard in ``EagleDraftWorker.draft`` then sends that rank's draft step eager while a peer DP rank replays the
draft CUDA graph. The tiny Qwen3-MoE here has no DSA, so SGLang reads ``seed_dsa_topk_from_draft_extend = False``.

How (one seam, SGLang does the rest). ``EagleDraftWorker.__init__`` calls ``_init_dsa_index_share_state`` right
after loading the draft model and before it builds the draft attention backends and captures the draft and
draft-extend CUDA graphs. The wrapper lets SGLang read the hf_config first, then sets the values SGLang derives for
a GLM-5.2 IndexShare draft model: ``index_share_for_mtp_iteration`` (topk 1 only, as SGLang requires),
``dsa_index_topk = SEEDLESS_TRIGGER_TOPK`` (8) and so ``seed_dsa_topk_from_draft_extend``. SGLang then allocates
its seed buffers, each draft-extend publishes a seed for the next draft step, and a non-idle draft batch without a
seed goes eager. The hf_config is untouched, so PD metadata carries no seed and ``build_eagle_disagg_draft_input``
builds every PD arrival seedless for its first draft step. No DSA kernel runs; the model never reads the seed.

Observer. ``eagle_worker_v2.prepare_for_draft`` (the module name ``draft()`` calls) is re-pointed once the draft
worker exists (end of ``Scheduler.maybe_init_draft_worker``), and each draft step appends one JSON line to
``$SEEDLESS_TRIGGER_DIR/rank<R>.jsonl``: batch, seed shape, ``can_run`` (which holds the plugin's group vote where
it is applied), stock's guard on the same objects, and the path taken. SIGUSR1 dumps every thread's stack
(``faulthandler``) to ``stack-<pid>.txt`` there.

DSA model (``SEEDLESS_TRIGGER_OBSERVE_ONLY=1``): the model's own config seeds (GLM-5 MTP IndexShare), so the trigger's
wrapper is not installed at all and every seedless arrival is SGLang's own; only the observer runs. With
``SEEDLESS_TRIGGER_DSA=1`` it also records, after the draft worker exists (graphs captured, so replays never see it),
every eager DSA decode call whose query has more rows than its planned metadata (``dsa-decode-padded``: physical and
planned rows, the ``forward_decode`` in place, whether the padding rows came back zero) and every eager indexer call
on an IDLE batch (``dsa-idle-index``: rows, and whether every returned top-k index is -1). These calls go through
the plugin's ``dsa_decode_trim`` / ``dsa_idle_index`` wrappers where applied; the observer reads their results only.

Knobs: ``SEEDLESS_TRIGGER_INIT_COMMS=1`` runs one 1-element all-reduce on the device group of every SGLang group of
more than one rank at that same point on every rank, so that torch's NCCL communicators exist before the first
request (the steady state of a server that ran an eager collective before; torch creates them lazily).
``SEEDLESS_TRIGGER_PD=1`` (stage pd, a real KV transfer) records each PD arrival the decode commits (``arrival``:
whether the metadata buffer held a seed on the wire, whether the committed request carries one, whether its hidden
state row held any nonzero byte, whether the buffer's bootstrap room is the request's own) and, in every scheduler
of either role, the metadata buffers' item lengths (``aux-<pid>.json``: a prefill whose lengths differ addresses the
decode's slots with its own). ``SEEDLESS_TRIGGER_WEIGHTS=1`` records a digest of every target and draft weight
(``weights``), so that a prefill and a decode are seen to hold the same dummy weights.
``SEEDLESS_TRIGGER_TIME_DRAFT=1`` records each draft step's GPU time (CUDA events) and host time by path
(``draft-time``); ``SEEDLESS_TRIGGER_DX=1`` each eager metadata call of the draft-extend DSA backend, and whether
it took the host-sync branch (``dx-meta``, #33973). ``SEEDLESS_TRIGGER_CPU_VOTE=1`` (CPU dry runs only) makes
a ``--disable-cuda-graph`` launch carry the graph vote.
"""

from __future__ import annotations

import faulthandler
import functools
import inspect
import json
import os
import signal
import sys
import threading
import time
from typing import Any

_MARK = "_seedless_trigger_wrapped"
_state: dict[str, Any] = {"out": None, "rank": None, "step": 0, "worker": None}


def register() -> None:
    records = os.environ.get("SEEDLESS_TRIGGER_DIR")
    scheduler_mod = sys.modules.get("sglang.srt.managers.scheduler")
    if not records or scheduler_mod is None:  # asked for, and a scheduler process (it imports the scheduler first)
        return
    # kept referenced for the life of the process: faulthandler writes to its descriptor from the signal handler
    _state["stack_file"] = open(os.path.join(records, f"stack-{os.getpid()}.txt"), "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=_state["stack_file"], all_threads=True)
    _dump_on_request(records)

    if os.environ.get("SEEDLESS_TRIGGER_OBSERVE_ONLY") != "1":
        _install_trigger()
    if os.environ.get("SEEDLESS_TRIGGER_PD") == "1":
        _observe_pd(records)
    init_draft = scheduler_mod.Scheduler.__dict__["maybe_init_draft_worker"]
    if getattr(init_draft, _MARK, False):
        return

    @functools.wraps(init_draft)
    def maybe_init_draft_worker(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = init_draft(self, *args, **kwargs)
        _observe(self, records)
        if os.environ.get("SEEDLESS_TRIGGER_WEIGHTS") == "1":
            _weights(self)
        return out

    setattr(maybe_init_draft_worker, _MARK, True)
    scheduler_mod.Scheduler.maybe_init_draft_worker = maybe_init_draft_worker


def _install_trigger() -> None:
    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker

    read_config = EagleDraftWorker.__dict__["_init_dsa_index_share_state"]
    if getattr(read_config, _MARK, False):
        return
    width = int(os.environ.get("SEEDLESS_TRIGGER_TOPK", "8"))

    @functools.wraps(read_config)
    def seeding_state(self: Any) -> None:
        read_config(self)
        self.index_share_for_mtp_iteration = self.topk == 1
        self.dsa_index_topk = width
        self.seed_dsa_topk_from_draft_extend = self.index_share_for_mtp_iteration

    setattr(seeding_state, _MARK, True)
    EagleDraftWorker._init_dsa_index_share_state = seeding_state


def _write(rec: dict[str, Any]) -> None:
    _state["out"].write(json.dumps(rec) + "\n")


def _observe(scheduler: Any, records: str) -> None:
    from sglang.srt.speculative import eagle_worker_v2

    rank = int(scheduler.ps.attn_dp_rank)
    _state["rank"] = rank
    _state["out"] = open(os.path.join(records, f"rank{rank}.jsonl"), "a", buffering=1)  # noqa: SIM115
    worker = _state["worker"] = getattr(scheduler.draft_worker, "_draft_worker", None)
    _write({"kind": "meta", "rank": rank, "pid": os.getpid(), "t": time.time(),
            "seeding": getattr(worker, "seed_dsa_topk_from_draft_extend", None),
            "dsa_index_topk": getattr(worker, "dsa_index_topk", None),
            "overlap": bool(getattr(scheduler, "enable_overlap", False))})  # fmt: skip
    if os.environ.get("SEEDLESS_TRIGGER_INIT_COMMS") == "1":
        _create_torch_communicators(rank)
    if os.environ.get("SEEDLESS_TRIGGER_CPU_VOTE") == "1":
        _cpu_vote()
    if os.environ.get("SEEDLESS_TRIGGER_DSA") == "1":
        _observe_dsa()
    if os.environ.get("SEEDLESS_TRIGGER_TIME_DRAFT") == "1" and worker is not None:
        _time_draft(worker)
    if os.environ.get("SEEDLESS_TRIGGER_DX") == "1" and worker is not None:
        _observe_draft_extend_metadata(worker)

    # 0.5.16+: a module function that EagleDraftWorker.draft calls by name; 0.5.15.post1: a method of the draft worker
    owner = eagle_worker_v2 if "prepare_for_draft" in eagle_worker_v2.__dict__ else worker
    prepare = owner.prepare_for_draft

    @functools.wraps(prepare)
    def prepare_for_draft(draft_input: Any, pool: Any, batch: Any, runner: Any, *rest: Any, **kw: Any) -> Any:
        forward_batch, can_run = prepare(draft_input, pool, batch, runner, *rest, **kw)
        try:
            _record(draft_input, batch, forward_batch, can_run)
        except Exception as exc:  # noqa: BLE001 - the observer never changes the run
            _write({"kind": "observer-error", "rank": _state["rank"], "error": repr(exc)})
        return forward_batch, can_run

    owner.prepare_for_draft = prepare_for_draft


def _observe_pd(records: str) -> None:
    """Stage pd: the metadata buffers' item lengths of this process, and each arrival the decode commits."""
    from sglang.srt.disaggregation import decode as decode_mod
    from sglang.srt.disaggregation import utils as pd_utils

    init = pd_utils.MetadataBuffers.__init__

    @functools.wraps(init)
    def metadata_buffers_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        try:
            _, lens, items = self.get_buf_infos()
            with open(os.path.join(records, f"aux-{os.getpid()}.json"), "w") as f:
                json.dump({"pid": os.getpid(), "role": os.environ.get("SEEDLESS_TRIGGER_ROLE"),
                           "item_lens": list(items), "data_lens": list(lens),
                           "hidden": list(self.output_hidden_states.shape),
                           "hidden_dtype": str(self.output_hidden_states.dtype)}, f)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - the observer never changes the run
            with open(os.path.join(records, f"aux-{os.getpid()}.json"), "w") as f:
                json.dump({"pid": os.getpid(), "error": repr(exc)}, f)

    pd_utils.MetadataBuffers.__init__ = metadata_buffers_init
    queue = decode_mod.DecodeTransferQueue
    commit = queue._commit_transfer_to_req

    @functools.wraps(commit)
    def commit_transfer_to_req(self: Any, decode_req: Any, *args: Any, **kwargs: Any) -> Any:
        wire: dict[str, Any] = {}
        try:
            idx, bufs = decode_req.metadata_buffer_index, self.metadata_buffers
            seed_buf = getattr(bufs, "output_dsa_topk_indices", None)
            wire = {"idx": int(idx), "wire_seed": None if seed_buf is None else bool((seed_buf[idx] >= 0).any()),
                    "hidden_nonzero": int(bufs.output_hidden_states[idx].count_nonzero()),
                    "room_in_buffer": int(bufs.bootstrap_room[idx, 0].item())}  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            wire = {"wire_error": repr(exc)}
        out = commit(self, decode_req, *args, **kwargs)
        if _state["out"] is not None:
            req = decode_req.req
            _write({"kind": "arrival", "rank": _state["rank"], "t": round(time.time(), 4), "rid": str(req.rid),
                    "room": getattr(req, "bootstrap_room", None), "prompt_len": len(req.origin_input_ids or []),
                    "committed_seed": getattr(req, "output_dsa_topk_indices", None) is not None, **wire})  # fmt: skip
        return out

    queue._commit_transfer_to_req = commit_transfer_to_req


def _weights(scheduler: Any) -> None:
    """A digest of every weight of the target and the draft model on this rank (dummy weights depend only on each
    tensor's size and dtype, so a prefill and a decode of the same parallel layout should hold the same bytes)."""
    import hashlib

    import torch

    try:
        models = {"target": scheduler.tp_worker.model_runner.model}
        dw = getattr(scheduler, "draft_worker", None)
        inner = getattr(dw, "_draft_worker", None) or dw
        runner = getattr(inner, "draft_runner", None) or getattr(inner, "model_runner", None)
        if dw is not None and runner is not None:
            models["draft"] = runner.model
        for name, model in models.items():
            whole, per = hashlib.sha256(), {}
            for key, t in sorted(model.state_dict().items()):
                raw = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
                whole.update(key.encode() + raw)
                per[key] = hashlib.sha256(raw).hexdigest()[:10]
            _write({"kind": "weights", "rank": _state["rank"], "model": name, "params": len(per),
                    "digest": whole.hexdigest()[:16], "per_param": per})  # fmt: skip
    except Exception as exc:  # noqa: BLE001
        _write({"kind": "observer-error", "rank": _state["rank"], "error": f"weights: {exc!r}"})


def _dump_on_request(records: str) -> None:
    """A second way to each thread's stack: a daemon thread that, when ``dump-<pid>.req`` appears, writes
    ``faulthandler.dump_traceback`` to ``stack-<pid>-thread.txt``. It needs the GIL, which a rank blocked in NCCL,
    gloo or a CUDA wait has released; the SIGUSR1 file came back empty in the DP4/DP8 probes of 2026-12-07."""
    request = os.path.join(records, f"dump-{os.getpid()}.req")

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.path.exists(request):
                with open(os.path.join(records, f"stack-{os.getpid()}-thread.txt"), "a") as f:
                    faulthandler.dump_traceback(file=f, all_threads=True)
                    f.write("\n")
                os.unlink(request)

    threading.Thread(target=watch, name="seedless-trigger-dump", daemon=True).start()


def _time_draft(worker: Any) -> None:
    """Each draft step's own time, by path: CUDA events around ``EagleDraftWorker.draft`` (read a step later, when
    the end event has completed, so the observer adds no synchronisation) and the host time of the call."""
    import torch

    draft = worker.draft
    pending: list[tuple[int, str, Any, Any, float]] = []

    @functools.wraps(draft)
    def timed_draft(*args: Any, **kwargs: Any) -> Any:
        while pending and pending[0][3].query():
            step, path, start, end, host_ms = pending.pop(0)
            _write({"kind": "draft-time", "rank": _state["rank"], "step": step, "path": path,
                    "gpu_ms": round(start.elapsed_time(end), 4), "host_ms": host_ms})  # fmt: skip
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        start.record()
        out = draft(*args, **kwargs)
        end.record()
        host_ms = round(1000 * (time.perf_counter() - t), 4)
        pending.append((_state["step"], _state.get("path", "?"), start, end, host_ms))
        return out

    worker.draft = timed_draft


def _observe_draft_extend_metadata(worker: Any) -> None:
    """#33973: each eager metadata call of the draft worker's DSA backends (a graph replay makes none). Without a host
    mirror of the sequence lengths (``seq_lens_cpu`` None) the DSA backend reads them back from the device, a host
    sync; the record says which branch ran, on which backend, and how long the call held the host."""
    from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend

    init_meta = DeepseekSparseAttnBackend.init_forward_metadata

    @functools.wraps(init_meta)
    def init_forward_metadata(self: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
        which = "extend" if self is getattr(worker, "draft_extend_attn_backend", None) else None
        no_mirror = getattr(forward_batch, "seq_lens_cpu", None) is None
        t = time.perf_counter()
        out = init_meta(self, forward_batch, *args, **kwargs)
        if which is not None:
            try:
                _write({"kind": "dx-meta", "rank": _state["rank"], "step": _state["step"], "t": round(time.time(), 4),
                        "mode": forward_batch.forward_mode.name, "bs": int(forward_batch.batch_size),
                        "host_sync_branch": no_mirror, "ms": round(1000 * (time.perf_counter() - t), 3)})  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - the observer never changes the run
                _write({"kind": "observer-error", "rank": _state["rank"], "error": repr(exc)})
        return out

    DeepseekSparseAttnBackend.init_forward_metadata = init_forward_metadata


def _create_torch_communicators(rank: int) -> None:
    import torch
    from sglang.srt.distributed import parallel_state

    names = []
    for name in sorted(parallel_state._groups):
        group = parallel_state._groups[name]()
        if group is None or group.world_size < 2 or group.device_group is None:
            continue
        torch.distributed.all_reduce(torch.zeros(1, device=group.device), group=group.device_group)
        names.append(name)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    _write({"kind": "init-comms", "rank": rank, "groups": names})


def _cpu_vote() -> None:
    from sglang.srt.managers.scheduler_components import dp_attn

    raw = dp_attn.prepare_mlp_sync_batch_raw
    sig = inspect.signature(raw)

    @functools.wraps(raw)
    def prepare_mlp_sync_batch_raw(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        bound.arguments["disable_cuda_graph"] = False
        return raw(*bound.args, **bound.kwargs)

    dp_attn.prepare_mlp_sync_batch_raw = prepare_mlp_sync_batch_raw


def _record(draft_input: Any, batch: Any, forward_batch: Any, can_run: Any) -> None:
    _state["step"] += 1
    if _state["step"] == 1:  # the draft graphs are captured after the draft worker exists: read them at first use
        runner = getattr(_state["worker"], "cuda_graph_runner_for_draft_extend", None)
        _write({"kind": "graphs", "rank": _state["rank"], "draft_extend_graph": runner is not None,
                "draft_graph": getattr(_state["worker"], "cuda_graph_runner", None) is not None})  # fmt: skip
    idle = forward_batch.forward_mode.is_idle()
    seed = getattr(draft_input, "dsa_topk_indices", None)
    seeding = bool(getattr(_state["worker"], "seed_dsa_topk_from_draft_extend", False))
    guard = bool(can_run) and not idle and seeding and seed is None  # EagleDraftWorker.draft's own test
    gnt = forward_batch.global_num_tokens_cpu
    reqs = batch.reqs or []
    _state["path"] = "graph" if can_run and not guard else "eager"
    _write({"kind": "draft", "rank": _state["rank"], "step": _state["step"], "t": round(time.time(), 4),
            "mode": forward_batch.forward_mode.name, "bs": len(reqs), "rids": [str(r.rid) for r in reqs][:8],
            "global_num_tokens": None if gnt is None else list(gnt),
            "seed": None if seed is None else list(seed.shape), "can_run": bool(can_run),
            "stock_guard_eager": guard, "path": _state["path"]})  # fmt: skip


def _observe_dsa() -> None:
    import gc

    import torch
    from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer
    from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend

    def eager() -> bool:
        return not torch.cuda.is_current_stream_capturing()

    decode = DeepseekSparseAttnBackend.forward_decode  # the plugin's dsa_decode_trim wrapper where it is applied

    @functools.wraps(decode)
    def forward_decode(self: Any, q: Any, *args: Any, **kwargs: Any) -> Any:
        out = decode(self, q, *args, **kwargs)
        try:
            seqlens = getattr(getattr(self, "forward_metadata", None), "cache_seqlens_int32", None)
            planned = None if seqlens is None else int(seqlens.shape[0])
            if planned is not None and planned < q.shape[0] and eager():
                pad = out.reshape(out.shape[0], -1)[planned:]
                _write({"kind": "dsa-decode-padded", "rank": _state["rank"], "step": _state["step"],
                        "t": round(time.time(), 4), "physical": int(q.shape[0]), "planned": planned,
                        "out_rows": int(out.shape[0]), "pad_zero": bool(pad.abs().amax().item() == 0),
                        "impl": str(getattr(self, "dsa_decode_impl", "")),
                        "forward_decode": code_of(decode)})  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - the observer never changes the run
            _write({"kind": "observer-error", "rank": _state["rank"], "error": repr(exc)})
        return out

    DeepseekSparseAttnBackend.forward_decode = forward_decode

    # Indexer binds its forward at construction (MultiPlatformOp._forward_method): wrap each instance's bound method
    def observe_indexer(bound: Any) -> Any:
        @functools.wraps(bound)
        def forward(x: Any, q_lora: Any, positions: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
            out = bound(x, q_lora, positions, forward_batch, *args, **kwargs)
            try:
                if forward_batch.forward_mode.is_idle() and eager():
                    rows = (x[0] if isinstance(x, tuple) else x).shape[0]
                    _write({"kind": "dsa-idle-index", "rank": _state["rank"], "step": _state["step"],
                            "t": round(time.time(), 4), "rows": int(rows),
                            "topk": None if out is None else list(out.shape),
                            "all_invalid": None if out is None else bool((out < 0).all().item()),
                            "forward": code_of(bound)})  # fmt: skip
            except Exception as exc:  # noqa: BLE001
                _write({"kind": "observer-error", "rank": _state["rank"], "error": repr(exc)})
            return out

        return forward

    indexers = [o for o in gc.get_objects() if isinstance(o, Indexer)]
    for ix in indexers:  # 0.5.20 resolves the method lazily (kernels/fused_op.py): resolve it now, as its forward does
        bound = ix._forward_method
        if bound is None and hasattr(ix, "_resolve_forward_method"):
            bound = ix._resolve_forward_method()
        if callable(bound):
            ix._forward_method = observe_indexer(bound)
    _write({"kind": "dsa-observer", "rank": _state["rank"], "indexers": len(indexers),
            "forward_decode": code_of(decode)})  # fmt: skip


def code_of(fn: Any) -> str:
    """Where the function in place was written (functools.wraps copies the name, not the code): the plugin's wrapper
    or SGLang's own body."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    return "?" if code is None else f"{code.co_filename.rsplit('/site-packages/', 1)[-1]}:{code.co_name}"
