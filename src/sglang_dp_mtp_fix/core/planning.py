"""Planning: classify and check every patch, changing nothing (``plan``), and the groups ``requires`` forms."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sglang_dp_mtp_fix import config as cfg
from sglang_dp_mtp_fix import importhook
from sglang_dp_mtp_fix.config import Config, Mode
from sglang_dp_mtp_fix.core.checks import check_deferred_patch, check_patch, stand_down_outcome
from sglang_dp_mtp_fix.core.model import HeldBack, Outcome, Patch, Resolved, StandDown, Status, Target, TargetProblem


def groups(patches: Sequence[Patch]) -> list[list[Patch]]:
    """Connected components of the ``requires`` relation (order preserved)."""
    by_id = {p.id: p for p in patches}
    parent = {p.id: p.id for p in patches}

    def find(x: str) -> str:
        while parent[x] != x:
            x = parent[x]
        return x

    for p in patches:
        for dep in p.requires:
            if dep not in by_id:
                raise ValueError(f"patch {p.id} requires unknown patch {dep}")
            parent[find(p.id)] = find(dep)
    comps: dict[str, list[Patch]] = {}
    for p in patches:
        comps.setdefault(find(p.id), []).append(p)
    return list(comps.values())


@dataclass
class Plan:
    """What a run would do: one outcome per patch, the load-time transaction, and the deferred patches it would arm.

    A deferred patch is never part of ``resolved``: its outcome stays ``not-loaded`` until it is checked, from its
    post-import hook (``PatchManager``), or here on request (``check_deferred_imported``, ``check_deferred_all``)."""

    outcomes: list[Outcome]
    resolved: dict[str, dict[Target, Resolved]] = field(default_factory=dict)  # patch id -> its checked targets
    deferred: list[Patch] = field(default_factory=list)  # not-loaded: armed by ``apply``

    def outcome(self, patch_id: str) -> Outcome:
        return next(o for o in self.outcomes if o.id == patch_id)

    def check_deferred_imported(self) -> Plan:
        """Check the deferred patches whose module is already imported (what their hook decides at once)."""
        self._check_deferred([p for p in self.deferred if importhook.is_imported(p.deferred_until_import or "")])
        return self

    def check_deferred_all(self) -> Plan:
        """Check every deferred patch, importing its module here (``doctor``: what a scheduler will see)."""
        self._check_deferred(list(self.deferred))
        return self

    def _check_deferred(self, patches: list[Patch]) -> None:
        for p in patches:
            imported = importhook.is_imported(p.deferred_until_import or "")
            outcome, _ = check_deferred_patch(p)
            if outcome.status is Status.APPLIED and not imported:
                outcome.reason = f"applied when {p.deferred_until_import} is imported ({outcome.reason})"
            self.outcome(p.id).take(outcome)
            self.deferred.remove(p)


def plan(patches: Sequence[Patch], config: Config) -> Plan:
    """Classify and check every patch without changing anything.

    Patches that depend on each other (``requires``) apply together or not at all, and one unsupported patch keeps
    SGLang fully stock (a DP group must never end up half-patched; deferred patches are then never armed)."""
    if config.error:
        reason = cfg.bad_configuration_reason(config.error)
        return Plan([Outcome(p.id, Status.UNSUPPORTED, reason, HeldBack.CONFIGURATION) for p in patches])
    outcomes: dict[str, Outcome] = {}
    resolved: dict[str, dict[Target, Resolved]] = {}
    skipped = _skipped(patches, config)
    for p in patches:
        if config.mode is Mode.OFF:
            outcomes[p.id] = Outcome(p.id, Status.DISABLED, cfg.kill_switch_reason())
        elif p.id in skipped:
            outcomes[p.id] = Outcome(p.id, Status.DISABLED, skipped[p.id])
        elif (off := p.switched_off(config)) is not None:
            outcomes[p.id] = Outcome(p.id, Status.DISABLED, off)
        elif (stood_down := _classify(p)) is not None:
            outcomes[p.id] = stood_down
        elif p.deferred_until_import:
            outcomes[p.id] = Outcome(p.id, Status.NOT_LOADED, _not_loaded_reason(p))
        else:
            outcomes[p.id], res = check_patch(p)
            if res is not None:
                resolved[p.id] = res
    _enforce_groups(patches, outcomes)
    bad = next((o for o in outcomes.values() if o.status is Status.UNSUPPORTED), None)
    if bad is not None:
        for o in outcomes.values():
            if o.status in (Status.APPLIED, Status.NOT_LOADED):
                why = f"not applied: SGLang kept fully stock because {bad.id} is unsupported"
                o.hold_back(HeldBack.OTHER_PATCH, why, blocked_by=bad.id)
        resolved = {}
    ordered = [outcomes[p.id] for p in patches]
    deferred = [p for p in patches if p.deferred_until_import and outcomes[p.id].status is Status.NOT_LOADED]
    return Plan(ordered, resolved, deferred)


def _skipped(patches: Sequence[Patch], config: Config) -> dict[str, str]:
    """Patch id -> why it is skipped: a patch the skip list names takes its whole group with it."""
    skipped: dict[str, str] = {}
    for grp in groups(patches):
        named = sorted(p.id for p in grp if p.id in config.skip)
        if named:
            ids = [p.id for p in grp]
            skipped.update({p.id: cfg.skip_reason(named, ids) for p in grp})
    return skipped


def _classify(p: Patch) -> Outcome | None:
    """The outcome when ``classify`` stands the patch down (or fails), else None."""
    try:
        p.classify()
    except StandDown as v:
        return stand_down_outcome(p.id, v)
    except TargetProblem as exc:
        return Outcome(p.id, Status.UNSUPPORTED, str(exc), HeldBack.OWN_CHECK)
    except Exception as exc:  # noqa: BLE001 - classification must never crash the host
        return Outcome(p.id, Status.UNSUPPORTED, f"feature detection failed: {exc!r}", HeldBack.OWN_CHECK)
    return None


def _enforce_groups(patches: Sequence[Patch], outcomes: dict[str, Outcome]) -> None:
    """A group applies only when every member does: the applied members of a mixed group are held back."""
    for grp in groups(patches):
        statuses = {outcomes[p.id].status for p in grp}
        if Status.APPLIED in statuses and statuses != {Status.APPLIED}:
            odd = outcomes[next(p for p in grp if outcomes[p.id].status is not Status.APPLIED).id]
            why = f"not applied: its group member {odd.id} is {odd.status.value} ({odd.reason})"
            for p in grp:
                if outcomes[p.id].status is Status.APPLIED:
                    outcomes[p.id].hold_back(HeldBack.GROUP_MEMBER, why, blocked_by=odd.id)


def _not_loaded_reason(p: Patch) -> str:
    return (
        f"{p.deferred_until_import} is not imported in this process (yet); the patch is checked and applied when it "
        "is imported"
    )
