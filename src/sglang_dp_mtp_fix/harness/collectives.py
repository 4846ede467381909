"""Collectives around the round: counting the ones SGLang issues in its MLP sync, and emulating the draft step's."""

from __future__ import annotations

from typing import Any

from sglang_dp_mtp_fix.harness.context import CONTEXT

HIDDEN = 8  # row width of the emulated draft-step all-gathers
DRAFT_STEPS = 3  # --speculative-num-steps of the reproduced deployment


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


def path_collective(graph: bool, rows: int, guarded: bool = True) -> tuple[str, list[tuple[int, int]] | None]:
    """The draft step's collectives as this rank's chosen path would issue them: ``rows`` rows (the graph bucket, or
    the live maximum on the eager path) in each of the draft steps' all-gathers. Returns ("ok" | "split", every
    rank's (graph, rows) descriptor when guarded).

    Ranks on different paths issue all-gathers of different sizes: NCCL hangs, gloo aborts the process.
    Guarded (default): the harness first exchanges a fixed-size (path, rows) descriptor (its own pre-flight, not
    SGLang's) and only issues the real all-gathers when every rank agrees; otherwise it reports the split, naming
    the ranks. Unguarded: the all-gathers are issued as chosen, and a split ends in the real failure (the ranks
    abort or time out after 10 s); ``simulate --unguarded`` shows that once per arm.
    """
    import torch
    import torch.distributed as dist

    group = CONTEXT.path_group
    world = dist.get_world_size(group)
    paths = None
    if guarded:
        descriptor = torch.tensor([1 if graph else 0, rows], dtype=torch.int64)
        gathered = torch.empty((world * 2,), dtype=torch.int64)
        dist.all_gather_into_tensor(gathered, descriptor, group=group)
        paths = [(int(g), int(r)) for g, r in gathered.view(world, 2).tolist()]
        if len(set(paths)) > 1:
            return "split", paths
    for _ in range(DRAFT_STEPS):
        out = torch.empty((world * rows, HIDDEN))
        dist.all_gather_into_tensor(out, torch.full((rows, HIDDEN), float(CONTEXT.rank)), group=group)
    return "ok", paths
