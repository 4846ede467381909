"""What one rank process is: its rank and world, its process group for the emulated draft step, the ServerArgs it
has published, and what it looked up once. The bottom layer of the harness: it imports nothing of it."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RankContext:
    rank: int = 0
    world: int = 1
    device: str = "cpu"  # "cuda:<rank>" when bench/gpu drives the harness
    server_args: Any = None  # the ServerArgs this rank has published (``configure`` publishes another)
    baseline_server_args: Any = None  # setup's: ``configure`` without a backend pair goes back to it
    path_group: Any = None  # the emulated draft-step collectives run on this group (bounded timeout)
    # (target, draft) ``require_mlp_tp_gather`` of ``server_args``; None until asked (``configure`` clears it)
    gather_answers: tuple[bool, bool] | None = None
    stock_seed_guard: bool | None = None  # whether the release's draft has the seedless guard; None until asked
    parameters: dict[str, Mapping[str, inspect.Parameter]] = field(default_factory=dict)


# The one rank this process is (a rank process runs one rank; bench/gpu sets its fields itself).
CONTEXT = RankContext()


def parameters(key: str, fn: Any) -> Mapping[str, inspect.Parameter]:
    """A function's parameters, looked up once per process (per-round introspection would skew the timings)."""
    cache = CONTEXT.parameters
    if key not in cache:
        cache[key] = inspect.signature(inspect.unwrap(fn)).parameters
    return cache[key]


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
