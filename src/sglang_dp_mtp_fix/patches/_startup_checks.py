"""Deployment hazards of the dp_draft_vote group that no patch can remove, checked once per scheduler at start-up.

SGLANG_SCHEDULER_SKIP_ALL_GATHER=1 with DP > 1: the scheduler gathers nothing in the DP MLP sync, so every rank
uses its own draft-graph vote (the plugin's ``_update_gather_batch`` falls back to the local vote; upstream 0.5.21
does the same). In an EAGLE deployment whose draft seeds DSA top-k from draft-extend and replays a draft CUDA
graph, a seedless PD-decode round then sends one rank eager and its peers through the graph: the #32209 hang.
The plugin cannot vote without a gather and must not add a collective, so it names the hazard instead.

A draft MoE a2a backend whose MLP-gather answer differs from the target's is fixed by ``draft_token_counts``; where
that patch is not applied, the configuration stands the draft-vote group down (``CHECKS``): ``auto`` puts the group
back to stock on that scheduler, ``strict`` stops.

Read from what the scheduler really uses: SGLang's own ``envs.SGLANG_SCHEDULER_SKIP_ALL_GATHER`` (which the DWDP
set-up also sets in-process), the scheduler's ``server_args`` and its spec worker as built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

SKIP_ENV = "SGLANG_SCHEDULER_SKIP_ALL_GATHER"


def _skip_all_gather_set() -> bool:
    from sglang.srt.environ import envs

    return bool(getattr(envs, SKIP_ENV).get())


def skip_all_gather_hazard(scheduler: Any) -> str | None:
    """The one line naming the hazard for this scheduler, or None when its configuration cannot split on it."""
    server_args = getattr(scheduler, "server_args", None)
    dp_size = int(getattr(server_args, "dp_size", 1) or 1)
    if dp_size <= 1 or not getattr(server_args, "enable_dp_attention", False):
        return None  # one DP rank (or no DP attention): nothing to agree on
    draft_worker = getattr(getattr(scheduler, "draft_worker", None), "_draft_worker", None)
    if draft_worker is None or not getattr(draft_worker, "seed_dsa_topk_from_draft_extend", False):
        return None  # not EAGLE with DSA seeds: the seedless eager fallback cannot trigger
    if getattr(draft_worker, "cuda_graph_runner", None) is None:
        return None  # no draft CUDA graph: every rank drafts eagerly
    if not _skip_all_gather_set():
        return None
    algorithm = getattr(server_args, "speculative_algorithm", None)
    return (
        f"sglang-dp-mtp-fix: {SKIP_ENV}=1 with dp_size={dp_size} in an {algorithm} deployment with DSA top-k seeds: "
        "nothing is gathered in the DP MLP sync, so each DP rank uses its own draft-graph vote and a seedless "
        f"PD-decode round can split the ranks between draft graph and eager (hang); unset {SKIP_ENV} "
        "(upstream 0.5.21 has the same hole)"
    )


def takes_server_args(require_mlp_tp_gather: Callable[..., Any]) -> bool:
    """Whether SGLang's ``require_mlp_tp_gather`` takes the server args positionally (up to 0.5.17); later releases
    read the published ones (0.5.21+ also take a keyword-only ``moe_a2a_backend``)."""
    import inspect

    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return any(p.kind in kinds for p in inspect.signature(require_mlp_tp_gather).parameters.values())


def mlp_tp_gather(server_args: Any) -> bool:
    """SGLang's own ``require_mlp_tp_gather`` (takes the server args up to 0.5.17, reads the published ones after)."""
    from sglang.srt.utils.common import require_mlp_tp_gather

    if takes_server_args(require_mlp_tp_gather):
        return bool(require_mlp_tp_gather(server_args))
    return bool(require_mlp_tp_gather())


def draft_token_counts_hazard(scheduler: Any) -> str | None:
    """The line naming a draft MoE a2a backend whose MLP-gather answer differs from the target's, or None.

    On 0.5.15.post1-0.5.20 the draft CUDA-graph runner decides ``require_mlp_tp_gather`` inside
    ``speculative_moe_a2a_backend_context()`` (the draft backend), but ``batch.global_num_tokens`` is shaped by the
    scheduler's answer (the target backend). When they differ, the draft graph's eligibility and bucket come from
    the wrong per-rank list: with the target not gathering and the draft gathering, each rank buckets its own count
    while the draft's gathered MoE needs one bucket for all, and ranks split between draft graph and eager
    (tests/test_draft_token_counts.py). The ``draft_token_counts`` patch (upstream 0.5.21's
    ``draft_global_num_tokens``) removes it; this check runs only where that patch is not applied.
    """
    from sglang.srt.layers.moe.utils import speculative_moe_a2a_backend_context

    server_args = getattr(scheduler, "server_args", None)
    if getattr(scheduler, "draft_worker", None) is None or not getattr(server_args, "enable_dp_attention", False):
        return None
    target = mlp_tp_gather(server_args)
    with speculative_moe_a2a_backend_context():
        draft = mlp_tp_gather(server_args)
    if not draft or target:
        # Same answer: consistent. Target gathers, draft does not: the draft buckets per rank as a stock
        # no-gather (a2a) deployment does by design; not shown to split (docs/compatibility.md).
        return None
    return (
        f"sglang-dp-mtp-fix: --speculative-moe-a2a-backend {getattr(server_args, 'speculative_moe_a2a_backend', None)} "
        f"differs from --moe-a2a-backend {getattr(server_args, 'moe_a2a_backend', None)} in its MLP gather "
        f"(draft require_mlp_tp_gather={draft}, target {target}): SGLang sizes the draft graph from the target's "
        "per-rank token counts, so DP ranks can pick different draft graph buckets or paths (hang); use the same "
        "backend for both, or let draft_token_counts apply (upstream 0.5.21 gives the draft its own counts)"
    )


class StartupCheck(NamedTuple):
    check: Callable[[Any], str | None]  # the line naming the hazard for a scheduler, or None
    stands_down_group_of: str | None  # auto puts this patch's whole group back to stock; None: a warning only
    fixed_by: str | None  # the patch that removes the hazard where it is applied (the check is skipped then)


# The skip-all-gather hole is a warning: the vote group still keeps every seeded round consistent there, and upstream
# 0.5.21 has the same hole. Differing draft MoE a2a backends are fixed by draft_token_counts; only where that patch is
# not applied does the hazard stand the draft-vote group down (the draft vote would be sized wrongly).
CHECKS: tuple[StartupCheck, ...] = (
    StartupCheck(skip_all_gather_hazard, stands_down_group_of=None, fixed_by=None),
    StartupCheck(draft_token_counts_hazard, stands_down_group_of="draft_graph_vote", fixed_by="draft_token_counts"),
)
