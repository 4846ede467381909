"""Test-only SGLang plugin ``launch_vote_probe`` (``SGLANG_PLUGINS=...,launch_vote_probe``), launch scenario c only.

Not a stand-in for the plugin under test: it never touches ``sglang_dp_mtp_fix`` (no import, no wrap, no attribute of
its). It does three things to SGLang, all outside the plugin, in every scheduler process of a launch that selects it:

1. Lifts ``disable_cuda_graph`` for the DP MLP-sync vote alone. The tier launches with ``--disable-cuda-graph`` (CPU),
   so SGLang's generic decode vote (``_local_decode_cuda_graph_vote``) is False for every batch and the plugin, which
   carries its draft vote only inside a "decode graph yes" value, carries nothing. The probe wraps the live
   ``dp_attn.prepare_mlp_sync_batch_raw`` (SGLang's function: the plugin wraps its caller, the sync entry, and only
   checks this one) and passes ``disable_cuda_graph=False``. Checked on 0.5.20's source: inside
   ``prepare_mlp_sync_batch_raw`` that argument is read only by ``_local_decode_cuda_graph_vote``; what the vote sets
   (``can_run_decode_cuda_graph`` on the batch and its ForwardBatch) is read only by graph runners
   (``decode_cuda_graph_runner.can_run_graph``, the draft and draft-extend runners' ``can_run_graph``, each behind
   ``runner and ...``), by two-batch overlap (off) and by workers this launch does not run; DP padding does not read it.
   On CPU no graph runner exists (``EagleDraftWorker._capture_cuda_graphs`` returns early on ``_is_cpu``;
   ``--disable-cuda-graph``: no decode runner), which the probe records per rank and the test asserts. So every batch
   still runs eager; only the votes are real.
2. Declares a need through the upstream API: on DP rank ``LAUNCH_VOTE_PROBE_EAGER_RANK`` (default 0) only, it sets
   ``requires_dp_attention_eager_forward`` on the scheduler's speculative worker INSTANCE (the hook #32209 defines on
   the speculative worker; the plugin adds it to ``EAGLEWorkerV2`` and, for PD-decode rounds, calls
   ``getattr(spec_worker, HOOK_NAME)(batch)``, so the instance attribute is what it calls). The probe's hook says True
   for decode batches holding a request whose rid starts with ``LAUNCH_VOTE_PROBE_EAGER_RID`` (the test chooses the
   rids, so the chosen rounds are those where that rank's batch holds such a request) and False otherwise. This is a
   speculative worker declaring "this batch needs a rank-consistent eager draft" - the seedless PD arrival of a DSA
   model, which the tiny CPU model (no DSA) cannot produce - not a replacement of anything the plugin does.
3. Observes: per MLP-sync round (counted in the wrapper of 1, every call: the sync is a collective, so the counts
   agree across ranks) and per draft step (a wrapper around ``prepare_for_draft``, re-pointed in
   ``eagle_worker_v2``, which imported it by name), one JSON line per draft step to
   ``$LAUNCH_VOTE_PROBE_DIR/rank<R>.jsonl``: the round, the batch (mode, rids), what the draft ForwardBatch carries
   (``can_run_dp_draft_cuda_graph`` - the plugin's vote, absent with the plugin off - and the generic
   ``can_run_decode_cuda_graph``; ``can_run_dp_cuda_graph`` on older releases), whether a graph runner exists,
   whether the plugin asked this rank's hook and what it answered, and what this rank's worker needs. Plus one
   ``meta`` line per rank at install.

4. Soak forcing (``bench/soak.py`` and the launch tier's short soak), only with ``LAUNCH_VOTE_PROBE_FORCE_RATE`` set:
   the hook is set on every rank, and in a fraction FORCE_RATE of the MLP-sync rounds one rank drawn at random needs
   the eager draft, if its decode batch holds a request whose rid starts with ``LAUNCH_VOTE_PROBE_FORCE_RID``
   (default ``soak-``; so a launch that also serves c's requests keeps c's chosen rounds). The draw is a function of
   (``LAUNCH_VOTE_PROBE_FORCE_SEED``, round) alone, the same on every rank, so the record of the draft step knows
   what the hook said before that round's sync (and an off launch records the same need, nobody asking).

Installed at the end of ``Scheduler.maybe_init_draft_worker`` (``probe_seam``, which the plugin does not target): by
then SGLang's ``load_plugins()`` has run every plugin, so the plugin resolved and fingerprinted its targets before the
probe wraps anything (a wrapper seen first would read to it as a foreign hook).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import random
from typing import Any

from probe_seam import after_draft_worker_init

HOOK_NAME = "requires_dp_attention_eager_forward"  # the upstream (#32209) worker hook
VOTE_ATTR = "can_run_dp_draft_cuda_graph"  # the plugin's vote on ScheduleBatch / ForwardBatch (read only)
PLUGIN_FLAG = "force_disable_draft_cuda_graph"  # the plugin's per-batch mark (read only)
ROUND = "_launch_vote_probe_round"
ASKED = "_launch_vote_probe_asked"
MARK = "_launch_vote_probe"
_MISSING = object()


class _State:
    rank: int | None = None
    round = 0
    out: Any = None
    eager_rank = int(os.environ.get("LAUNCH_VOTE_PROBE_EAGER_RANK", "0"))
    eager_rid = os.environ.get("LAUNCH_VOTE_PROBE_EAGER_RID", "vote-probe-eager")
    force_rate = float(os.environ.get("LAUNCH_VOTE_PROBE_FORCE_RATE") or 0)
    force_seed = int(os.environ.get("LAUNCH_VOTE_PROBE_FORCE_SEED") or 0)
    force_rid = os.environ.get("LAUNCH_VOTE_PROBE_FORCE_RID", "soak-")
    dp_size = 1


def register() -> None:
    if os.environ.get("LAUNCH_VOTE_PROBE_DIR"):
        after_draft_worker_init(_install, MARK)


def _emit(record: dict) -> None:
    _State.out.write(json.dumps(record) + "\n")
    _State.out.flush()


def _rids(batch: Any) -> list[str]:
    return [str(req.rid) for req in (getattr(batch, "reqs", None) or [])]


def _marked(batch: Any) -> bool:
    """The chosen rounds: a decode batch of this rank holding a request the test marked."""
    if batch is None or not batch.forward_mode.is_decode():
        return False
    return any(rid.startswith(_State.eager_rid) for rid in _rids(batch))


def forced_rank(round_: int) -> int | None:
    """Soak forcing: the rank drawn to need the eager draft in this MLP-sync round, or None (the same on every rank)."""
    if _State.force_rate <= 0:
        return None
    rng = random.Random(_State.force_seed * 1_000_003 + round_)
    return rng.randrange(_State.dp_size) if rng.random() < _State.force_rate else None


def needs_eager(batch: Any, round_: int | None) -> bool:
    """What this rank's worker needs for ``batch`` in MLP-sync round ``round_``: c's marked request on the eager
    rank, or a soak-forced round drawn for this rank whose decode batch holds a soak request."""
    if batch is None or not batch.forward_mode.is_decode():
        return False
    if _State.rank == _State.eager_rank and _marked(batch):
        return True
    return (
        round_ is not None
        and forced_rank(round_) == _State.rank
        and any(rid.startswith(_State.force_rid) for rid in _rids(batch))
    )


def requires_dp_attention_eager_forward(batch: Any) -> bool:
    """The worker hook (an instance attribute): records that it was asked, and its answer. The plugin asks it before
    the round's MLP sync, whose wrapper below counts that round: so the round is the next one."""
    answer = needs_eager(batch, _State.round + 1)
    setattr(batch, ASKED, answer)
    return answer


def _install(scheduler: Any) -> None:
    from sglang.srt.managers.scheduler_components import dp_attn
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.speculative import eagle_worker_common, eagle_worker_v2

    _State.rank = int(scheduler.ps.attn_dp_rank)
    _State.dp_size = int(scheduler.server_args.dp_size)
    out_dir = os.environ["LAUNCH_VOTE_PROBE_DIR"]
    _State.out = open(os.path.join(out_dir, f"rank{_State.rank}.jsonl"), "a", buffering=1)  # noqa: SIM115
    worker = scheduler.draft_worker
    if worker is not None and (_State.rank == _State.eager_rank or _State.force_rate > 0):
        setattr(worker, HOOK_NAME, requires_dp_attention_eager_forward)

    sync_raw = dp_attn.prepare_mlp_sync_batch_raw
    signature = inspect.signature(sync_raw)

    @functools.wraps(sync_raw)
    def prepare_mlp_sync_batch_raw(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        local_batch = bound.arguments.get("local_batch")
        # What the plugin's hook call left on this batch this round (popped: the running batch is reused next round)
        asked = vars(local_batch).pop(ASKED, None) if local_batch is not None else None
        given = bound.arguments["disable_cuda_graph"]
        bound.arguments["disable_cuda_graph"] = False  # the vote alone: see the module docstring, point 1
        _State.round += 1
        result = sync_raw(*bound.args, **bound.kwargs)
        info = {"round": _State.round, "asked": asked, "disable_cuda_graph_given": given}
        for batch in (result, getattr(result, "inner_idle_batch", None)):
            if batch is not None:
                setattr(batch, ROUND, info)
        return result

    dp_attn.prepare_mlp_sync_batch_raw = prepare_mlp_sync_batch_raw

    # 0.5.16+: a module function imported by name into eagle_worker_v2. 0.5.15.post1 has it as a method of
    # base_spec_worker.EagleDraftWorkerBase: not probed yet (that release does not launch on CPU here), so say so.
    prepare = eagle_worker_v2.__dict__.get("prepare_for_draft")
    if prepare is None:
        raise RuntimeError("launch_vote_probe: eagle_worker_v2 has no module-level prepare_for_draft on this release")
    # the generic vote on ForwardBatch: can_run_decode_cuda_graph from 0.5.19, can_run_dp_cuda_graph before
    fields = getattr(ForwardBatch, "__dataclass_fields__", {})
    generic_field = "can_run_decode_cuda_graph" if "can_run_decode_cuda_graph" in fields else "can_run_dp_cuda_graph"

    @functools.wraps(prepare)
    def prepare_for_draft(draft_input: Any, req_to_token_pool: Any, batch: Any, cuda_graph_runner: Any, *rest: Any,
                          **kwargs: Any) -> Any:  # fmt: skip
        forward_batch, can_run = prepare(draft_input, req_to_token_pool, batch, cuda_graph_runner, *rest, **kwargs)
        info = getattr(batch, ROUND, None) or {}
        vote = getattr(forward_batch, VOTE_ATTR, _MISSING)
        flag = getattr(batch, PLUGIN_FLAG, _MISSING)
        _emit(
            {
                "kind": "draft",
                "rank": _State.rank,
                "round": info.get("round"),
                "mode": batch.forward_mode.name,
                "rids": _rids(batch),
                "vote": None if vote is _MISSING else bool(vote),
                "generic": bool(getattr(forward_batch, generic_field)),
                "graph_runner": cuda_graph_runner is not None,
                "can_run": bool(can_run),
                "asked": info.get("asked"),
                "needs_eager": needs_eager(batch, info.get("round")),
                "plugin_flag": None if flag is _MISSING else bool(flag),
                "disable_cuda_graph_given": info.get("disable_cuda_graph_given"),
            }
        )
        return forward_batch, can_run

    for module in (eagle_worker_common, eagle_worker_v2):
        if module.__dict__.get("prepare_for_draft") is prepare:
            module.prepare_for_draft = prepare_for_draft

    target_runner = getattr(scheduler.tp_worker.model_runner, "decode_cuda_graph_runner", _MISSING)
    _emit(
        {
            "kind": "meta",
            "rank": _State.rank,
            "pid": os.getpid(),
            "worker": type(worker).__name__,
            "hook_on_instance": HOOK_NAME in vars(worker) if worker is not None else False,
            "hook_on_class": hasattr(type(worker), HOOK_NAME),
            "enable_overlap": bool(getattr(scheduler, "enable_overlap", False)),
            "draft_graph_runner": getattr(getattr(worker, "draft_worker", None), "cuda_graph_runner", None) is not None,
            "target_decode_graph_runner": target_runner is not None and target_runner is not _MISSING,
        }
    )
