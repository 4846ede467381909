"""``PatchManager``: one process's patch state, over ``plan``, ``ChangeSet`` and ``DeferredPatches``."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from sglang_dp_mtp_fix.config import Config
from sglang_dp_mtp_fix.core.changes import ChangeRecord, ChangeSet, apply_transaction, rolled_back_reason
from sglang_dp_mtp_fix.core.checks import check_deferred_patch, source_digest
from sglang_dp_mtp_fix.core.deferred import DeferredPatches
from sglang_dp_mtp_fix.core.model import HeldBack, Outcome, Patch, Status, unsupported
from sglang_dp_mtp_fix.core.planning import groups, plan

logger = logging.getLogger("sglang_dp_mtp_fix")


class PatchManager:
    """Owns the application state of one process. Thread-safe; idempotent; restorable."""

    def __init__(self, patches: Sequence[Patch]):
        self.patches = list(patches)
        self._lock = threading.RLock()
        self._changes = ChangeSet()
        self._deferred = DeferredPatches()
        self.outcomes: list[Outcome] | None = None
        self.fingerprints: dict[str, str] = {}  # target name -> fingerprint of what was patched (empty when stock)
        # Called after a deferred patch was checked/applied from its post-import hook (not during ``apply``): the
        # plugin logs it, or stops the process in strict mode (an exception raised here fails that import).
        self.on_deferred: Callable[[Patch, Outcome], None] | None = None
        groups(self.patches)  # validates requires
        for p in self.patches:
            if p.deferred_until_import and (p.requires or any(p.id in q.requires for q in self.patches)):
                raise ValueError(f"deferred patch {p.id} must be its own group (no requires, required by none)")

    @property
    def ids(self) -> list[str]:
        return [p.id for p in self.patches]

    @property
    def applied(self) -> bool:
        return bool(self._changes)

    @property
    def awaiting_import(self) -> list[str]:
        """Deferred patches whose module has not been imported yet (their hook is armed)."""
        return self._deferred.ids

    def changes(self) -> list[ChangeRecord]:
        """Every attribute replaced in this process, in order (the plugin's own seams have ``patch_id`` None)."""
        with self._lock:
            return self._changes.records()

    def live_values(self) -> list[tuple[Any, str, Any]]:
        """(owner, attribute, value) of every attribute set in this process, the ``from X import Y`` copies re-pointed
        included (``changes`` leaves those out): what switching between two configurations in one process sets."""
        with self._lock:
            return self._changes.live_values()

    def install_seam(self, owner: Any, attr: str, new: Any) -> None:
        """Replace ``owner.attr`` by the plugin's own ``new`` (no patch's), undone by ``restore`` like the patches."""
        with self._lock:
            own = attr in owner.__dict__
            self._changes.replace(owner, attr, new, None, original=owner.__dict__.get(attr), own=own)

    def apply(self, config: Config) -> list[Outcome]:
        """Check everything, then apply the load-time patches in one transaction and arm the deferred ones."""
        with self._lock:
            if self._changes or self._deferred.ids:  # idempotent per process
                assert self.outcomes is not None
                return self.outcomes
            planned = plan(self.patches, config)
            try:
                todo = [(p, planned.resolved[p.id]) for p in self.patches if p.id in planned.resolved]
                self.fingerprints = apply_transaction(self._changes, todo, config)
            except Exception as exc:  # noqa: BLE001 - roll back and stay stock
                self.restore()
                planned.deferred.clear()
                for o in planned.outcomes:
                    if o.status in (Status.APPLIED, Status.NOT_LOADED):
                        o.hold_back(HeldBack.ROLLED_BACK, rolled_back_reason(exc))
            self.outcomes = planned.outcomes
            self._deferred.generation += 1
            for p in planned.deferred:
                self._deferred.arm(p, functools.partial(self._deferred_imported, p, config))
            return planned.outcomes

    def _deferred_imported(self, patch: Patch, config: Config, generation: int, from_hook: bool) -> None:
        """Check and apply one deferred patch as its own transaction, and update its Outcome in place (the held
        report line and the cross-rank check read that object). Nothing when restored since it was armed."""
        with self._lock:
            if not self._deferred.is_current(generation) or self.outcomes is None:
                return
            self._deferred.fired(patch.id)
            outcome = next(o for o in self.outcomes if o.id == patch.id)
            new, res = check_deferred_patch(patch)
            if res is not None:
                try:
                    self.fingerprints.update(apply_transaction(self._changes, [(patch, res)], config))
                except Exception as exc:  # noqa: BLE001 - roll this patch back, keep the others
                    self._changes.undo({patch.id})
                    new = unsupported(patch.id, HeldBack.ROLLED_BACK, rolled_back_reason(exc))
            outcome.take(new)
        if from_hook and self.on_deferred is not None:
            self.on_deferred(patch, outcome)  # may raise StrictModeAbort: the import fails, the process stops

    def peer_fingerprints(self) -> dict[str, str]:
        """What the start-up cross-rank check compares besides statuses: the fingerprints of the patched code, plus
        a digest of the source of every module a deferred patch still awaiting import will check (so a module
        imported after the check is still the same code on every rank). Read from disk, no import."""
        out = dict(self.fingerprints)
        awaiting = set(self._deferred.ids)
        for p in self.patches:
            if p.id in awaiting:
                for module in sorted({t.module for t in p.targets}):
                    out[f"source of {module}"] = source_digest(module)
        return out

    def restore(self) -> list[str]:
        """Put every original back, by identity, in reverse order.

        An attribute that another hook has since wrapped (e.g. SGLang's ``HookRegistry`` applied after us) is left
        in place rather than clobbering that hook; it is returned (and logged) as not restored.
        """
        with self._lock:
            self._deferred.cancel()
            self._deferred.generation += 1
            not_restored = self._changes.undo()
            self.outcomes = None
            self.fingerprints = {}
        if not_restored:
            logger.warning(
                "sglang-dp-mtp-fix: not restored because another hook wraps them now: %s", ", ".join(not_restored)
            )
        return not_restored

    def stand_down(self, ids: Iterable[str], reason: str) -> list[str]:
        """Put the patches ``ids`` (a whole group: the caller's decision) back to stock after application, e.g. at
        scheduler start when the deployment turns out to be one the group must not run in. Their outcomes become
        ``unsupported`` with ``reason``; the other patches stay as they are. Returns what could not be restored
        (another hook wraps it now)."""
        ids = set(ids)
        with self._lock:
            self._deferred.cancel(ids)
            not_restored = self._changes.undo(ids)
            names = {t.name for p in self.patches if p.id in ids for t in p.targets}
            self.fingerprints = {k: v for k, v in self.fingerprints.items() if k not in names}
            for o in self.outcomes or []:
                if o.id in ids:
                    o.hold_back(HeldBack.STOOD_DOWN, reason)
        return not_restored
