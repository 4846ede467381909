"""Deployment hazards of the dp_draft_vote group that no patch can remove, checked once per scheduler at start-up.

SGLANG_SCHEDULER_SKIP_ALL_GATHER=1 with DP > 1: the scheduler gathers nothing in the DP MLP sync, so every rank
uses its own draft-graph vote (the plugin's ``_update_gather_batch`` falls back to the local vote; upstream 0.5.21
does the same). In an EAGLE deployment whose draft seeds DSA top-k from draft-extend and replays a draft CUDA
graph, a seedless PD-decode round then sends one rank eager and its peers through the graph: the #32209 hang.
The plugin cannot vote without a gather and must not add a collective, so it names the hazard instead.

Read from what the scheduler really uses: SGLang's own ``envs.SGLANG_SCHEDULER_SKIP_ALL_GATHER`` (which the DWDP
set-up also sets in-process), the scheduler's ``server_args`` and its spec worker as built.
"""

from __future__ import annotations

from typing import Any

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
