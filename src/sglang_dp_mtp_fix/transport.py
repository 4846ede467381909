"""The MLP-sync transport line: once per patched scheduler, at the end of its ``__init__`` (before its first MLP-sync
round), at INFO through the plugin's logger under SGLang's logging set-up (so it carries SGLang's rank prefix).

It names what the DP MLP sync gathers over (upstream #34664/#34665 ask for it): the backend (gloo or NCCL) of the
group, its size, this process's global and group rank, overlap scheduling on or off, the target's and the draft's
MLP-gather answers (``require_mlp_tp_gather``), and whether the draft-graph vote is active on this scheduler.

The group is SGLang's own choice in ``prepare_mlp_sync_batch_raw`` (a fingerprinted premise of draft_graph_vote, so
a release that changes it stands the vote down): the expanded WORLD group when ``world_dp_gather_enabled()``, the TP
device group without offload tags when overlap is off (or ``SGLANG_NCCL_ALL_GATHER_IN_OVERLAP_SCHEDULER_SYNC_BATCH``),
else the TP CPU group; no gather at all with one DP rank or ``SGLANG_SCHEDULER_SKIP_ALL_GATHER``. The backend is asked
of torch.distributed for that group object. Never raises.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_dp_mtp_fix.core import Status

logger = logging.getLogger("sglang_dp_mtp_fix")


def _env(name: str) -> bool:
    from sglang.srt.environ import envs

    var = getattr(envs, name, None)
    return bool(var.get()) if var is not None else False


def _world_gather() -> bool:
    try:
        from sglang.srt.layers.dp_attention import world_dp_gather_enabled
    except ImportError:  # before 0.5.17: no expanded WORLD gather
        return False
    return bool(world_dp_gather_enabled())


def _overlap_disabled(server_args: Any) -> bool:
    """What the sync reads: the published schedule settings (0.5.17+), the server args before (0.5.15.post1). The
    scheduler can turn overlap off after the server args were resolved (seen in a 0.5.20 launch with EAGLE)."""
    try:
        from sglang.srt.runtime_context import get_schedule

        return bool(get_schedule().disable_overlap_schedule)
    except Exception:  # noqa: BLE001 - no runtime context in this release
        return bool(server_args.disable_overlap_schedule)


def describe(scheduler: Any, vote: str) -> str:
    import torch.distributed as dist

    from sglang_dp_mtp_fix.patches._startup_checks import mlp_tp_gather

    server_args = scheduler.server_args
    dp_size = int(getattr(server_args, "dp_size", 1) or 1)
    tp_group = scheduler.tp_group
    offload = getattr(getattr(scheduler, "weight_updater", None), "offload_tags", None) or ()
    disabled = _overlap_disabled(server_args)
    overlap = bool(getattr(scheduler, "enable_overlap", not disabled))
    if dp_size == 1 or _env("SGLANG_SCHEDULER_SKIP_ALL_GATHER"):
        where = f"none (nothing gathered: dp_size={dp_size}, SGLANG_SCHEDULER_SKIP_ALL_GATHER)"
    else:
        if _world_gather():
            group, name = dist.group.WORLD, "the expanded WORLD group"
        elif not offload and (disabled or _env("SGLANG_NCCL_ALL_GATHER_IN_OVERLAP_SCHEDULER_SYNC_BATCH")):
            group, name = tp_group.device_group, "the TP device group"
        else:
            group, name = tp_group.cpu_group, "the TP CPU group"
        where = (
            f"{dist.get_backend(group)} on {name} (size {dist.get_world_size(group)}, group rank "
            f"{dist.get_rank(group)}, global rank {dist.get_rank()})"
        )
    target = mlp_tp_gather(server_args)
    draft: Any = "-"
    if getattr(scheduler, "draft_worker", None) is not None:
        from sglang.srt.layers.moe.utils import speculative_moe_a2a_backend_context

        with speculative_moe_a2a_backend_context():
            draft = mlp_tp_gather(server_args)
    return (
        f"sglang-dp-mtp-fix: MLP-sync transport: {where}; overlap {'on' if overlap else 'off'}; MLP gather target="
        f"{target} draft={draft}; draft-graph vote {vote}"
    )


def vote_state(manager: Any) -> str:
    """Whose draft-graph vote runs on this scheduler: the plugin's, SGLang's own (0.5.21+), or none."""
    status = next((o.status for o in manager.outcomes or [] if o.id == "draft_graph_vote"), None)
    if status is Status.APPLIED:
        return "active"
    return "SGLang's own (upstream)" if status is Status.SUPERSEDED else "NOT active"


def log_line(scheduler: Any, manager: Any) -> None:
    vote = vote_state(manager)
    try:
        line = describe(scheduler, vote)
    except Exception as exc:  # noqa: BLE001 - a diagnostic line must never crash the host
        line = f"sglang-dp-mtp-fix: MLP-sync transport not determined ({exc!r}); draft-graph vote {vote}"
    logger.info(line)
