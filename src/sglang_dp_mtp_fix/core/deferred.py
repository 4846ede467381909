"""The deferred patches' post-import hooks: armed at load, fired once when their module is imported, cancelled by a
restore or a stand-down. The generation tells a hook armed before a restore that it must do nothing."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import ModuleType

from sglang_dp_mtp_fix import importhook
from sglang_dp_mtp_fix.core.model import Patch


class DeferredPatches:
    """Armed post-import hooks by patch id. Not thread-safe: its owner (``PatchManager``) holds the lock."""

    def __init__(self) -> None:
        self._hooks: dict[str, importhook.Hook] = {}
        self.generation = 0  # bumped by every apply and restore

    @property
    def ids(self) -> list[str]:
        """The patches whose module has not been imported yet (their hook is armed)."""
        return list(self._hooks)

    def arm(self, patch: Patch, on_import: Callable[[int, bool], None]) -> None:
        """Call ``on_import(generation, from_hook)`` once, when ``patch``'s module is imported: from its post-import
        hook, or at once (``from_hook`` False) when the module already is."""
        module, generation = patch.deferred_until_import or "", self.generation
        if importhook.is_imported(module):
            on_import(generation, False)
            return

        def hook(_module: ModuleType) -> None:
            on_import(generation, True)

        self._hooks[patch.id] = hook
        importhook.when_imported(module, hook)

    def fired(self, patch_id: str) -> None:
        self._hooks.pop(patch_id, None)

    def cancel(self, patch_ids: Iterable[str] | None = None) -> None:
        """Remove the hooks of ``patch_ids`` (all: None) that have not fired."""
        for pid in list(self._hooks) if patch_ids is None else [p for p in patch_ids if p in self._hooks]:
            importhook.cancel(self._hooks.pop(pid))

    def is_current(self, generation: int) -> bool:
        return generation == self.generation
