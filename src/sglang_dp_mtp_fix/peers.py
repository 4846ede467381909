"""Start-up cross-rank check of the plugin's patch state (once per scheduler process).

Every rank of a DP group must run the same patches on the same code, or the group can split between the draft graph
and eager later and hang. Once SGLang has created its distributed groups (the end of the first
``Scheduler.__init__``), each rank where the plugin applied patches publishes a small state (plugin version,
per-patch statuses, the settings every rank must share, the fingerprints of the code it patched) under
``sglang_dp_mtp_fix/patch_state/<rank>`` in torch.distributed's default store, waits for every rank's entry with a
bounded timeout, and compares.

Why the store and not a collective: a rank without the plugin (or with ``SGLANG_DP_MTP_FIX=off``, or where the plugin
left SGLang stock) never takes part, so a collective would hang exactly the group it is meant to protect. A missing
entry after the timeout names that rank instead. Any difference raises :class:`PeerStateMismatch` from
``Scheduler.__init__``: SGLang's scheduler process logs the exception and signals its parent, so the launch stops with
this message (in ``auto`` and ``strict`` alike: a group with mixed patch state is never safe).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any

from sglang_dp_mtp_fix import _version
from sglang_dp_mtp_fix.core import Outcome
from sglang_dp_mtp_fix.errors import PeerCheckError, PeerStateMismatch

KEY_PREFIX = "sglang_dp_mtp_fix/patch_state/"
MISSING_HINT = (
    "plugin not installed/selected there, SGLANG_DP_MTP_FIX=off, or the plugin left SGLang stock there "
    "(skip list, bad configuration or unsupported code: see that rank's sglang-dp-mtp-fix log line)"
)


def local_state(
    outcomes: Sequence[Outcome], fingerprints: Mapping[str, str], settings: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """``settings``: the configuration every rank must share (``config.settings``: what a seedless arrival gets)."""
    # Read the version at call time (not at import) so a rank's state is always what this process runs.
    state: dict[str, Any] = {
        "plugin_version": _version.__version__,
        "patches": {o.id: o.status.value for o in outcomes},
        "fingerprints": dict(sorted(fingerprints.items())),
    }
    if settings:
        state["settings"] = dict(sorted(settings.items()))
    return state


def _flatten(state: Mapping[str, Any]) -> dict[str, str]:
    flat = {"plugin version": str(state.get("plugin_version"))}
    flat.update({str(pid): str(status) for pid, status in state.get("patches", {}).items()})
    flat.update({f"setting {name}": str(value) for name, value in state.get("settings", {}).items()})
    flat.update({f"fingerprint of {name}": str(fp) for name, fp in state.get("fingerprints", {}).items()})
    return flat


def _differences(reference: Mapping[str, Any], other: Mapping[str, Any]) -> str:
    ref, oth = _flatten(reference), _flatten(other)
    keys = sorted(ref.keys() | oth.keys())
    return "; ".join(f"{k}: {ref.get(k, '<none>')} vs {oth.get(k, '<none>')}" for k in keys if ref.get(k) != oth.get(k))


def compare(states: Mapping[int, Mapping[str, Any] | None], timeout_s: float) -> str | None:
    """None when every rank published the same state; else one message naming the ranks and the differences.

    The reference is the largest group of identical states (ties: the one holding the lowest rank), so every rank
    computes the same message.
    """
    missing = sorted(r for r, s in states.items() if s is None)
    groups: dict[str, list[int]] = {}
    for rank, state in sorted(states.items()):
        if state is not None:
            groups.setdefault(json.dumps(state, sort_keys=True), []).append(rank)
    problems = []
    if missing:
        problems.append(f"no patch-state from ranks {missing} within {timeout_s:g}s: {MISSING_HINT}")
    if len(groups) > 1:
        ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
        ref_text, ref_ranks = ordered[0]
        reference = json.loads(ref_text)
        for text, ranks in ordered[1:]:
            problems.append(f"ranks {ranks} differ from ranks {ref_ranks}: {_differences(reference, json.loads(text))}")
    if not problems:
        return None
    return (
        f"sglang-dp-mtp-fix: patch state differs across the {len(states)} ranks of this launch; stopping start-up "
        f"(a DP group with mixed patch state can hang): {' | '.join(problems)}"
    )


def _default_store() -> tuple[Any, int, int] | None:
    """(store, rank, world) of torch.distributed's default group, or None when there is none (single process)."""
    try:
        import torch.distributed as dist
    except Exception:  # noqa: BLE001 - no torch.distributed: nothing to compare with
        return None
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store(), dist.get_rank(), dist.get_world_size()


def check(
    outcomes: Sequence[Outcome],
    fingerprints: Mapping[str, str],
    timeout_s: float,
    settings: Mapping[str, str] | None = None,
) -> tuple[int, int] | None:
    """Publish this rank's state, wait for every rank's (bounded), compare. Returns (rank, world) when every rank
    agrees, None without a store (single process: nothing to compare). Raises PeerStateMismatch on a difference,
    PeerCheckError when the store itself fails (the caller decides by mode)."""
    try:
        found = _default_store()
    except Exception as exc:  # noqa: BLE001 - e.g. torch moved its private default-store accessor
        raise PeerCheckError(f"sglang-dp-mtp-fix: cross-rank patch-state check could not run: {exc!r}") from exc
    if found is None:
        return None
    store, rank, world = found
    keys = [f"{KEY_PREFIX}{r}" for r in range(world)]
    try:
        store.set(keys[rank], json.dumps(local_state(outcomes, fingerprints, settings), sort_keys=True))
        try:
            store.wait(keys, datetime.timedelta(seconds=timeout_s))
            present = set(range(world))
        except RuntimeError:  # DistStoreError on timeout: find out which ranks are missing
            present = {r for r in range(world) if store.check([keys[r]])}
        states = {r: (json.loads(store.get(keys[r])) if r in present else None) for r in range(world)}
    except Exception as exc:  # noqa: BLE001 - a broken store is reported, never a crash in auto
        raise PeerCheckError(f"sglang-dp-mtp-fix: cross-rank patch-state check could not run: {exc!r}") from exc
    problem = compare(states, timeout_s)
    if problem:
        raise PeerStateMismatch(problem)
    return rank, world
