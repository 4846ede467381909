"""The attributes one process has replaced, and how they are put back (wrapt's ``apply_patch``, with an undo).

Every replacement is recorded with its true original, re-pointed in the ``from X import Y`` copies other SGLang
modules hold, verified live, and undone by identity: an attribute another hook has wrapped since is left alone.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

from sglang_dp_mtp_fix import fingerprints as fp
from sglang_dp_mtp_fix.config import Config
from sglang_dp_mtp_fix.core.checks import describe
from sglang_dp_mtp_fix.core.model import MARKER, ORIGINAL, UNCHANGED, Kind, Patch, Resolved, Target

_MISSING = object()


class ChangeRecord(NamedTuple):
    """A read-only view of one replaced attribute."""

    owner: Any  # the module or class
    attr: str
    original: Any  # what ``undo`` puts back (None: the attribute did not exist)
    patch_id: str | None  # None: the plugin's own seam


class _Change:
    __slots__ = ("owner", "attr", "own", "original", "new", "patch_id", "rebinds")

    def __init__(self, owner: Any, attr: str, own: bool, original: Any, new: Any, patch_id: str | None) -> None:
        self.owner, self.attr, self.patch_id = owner, attr, patch_id
        self.own = own  # the original lived in owner's own __dict__ (else: inherited or absent, so undo deletes ours)
        self.original, self.new = original, new
        self.rebinds: list[tuple[Any, str]] = []  # (module, name) copies we re-pointed


class ChangeSet:
    """Replaced attributes in application order. Not thread-safe: its owner (``PatchManager``) holds the lock."""

    def __init__(self) -> None:
        self._changes: list[_Change] = []

    def __bool__(self) -> bool:
        return bool(self._changes)

    def __iter__(self) -> Iterator[ChangeRecord]:
        return iter(self.records())

    def live_values(self) -> list[tuple[Any, str, Any]]:
        """(owner, attribute, value) of every attribute set, its ``from X import Y`` copies included."""
        out: list[tuple[Any, str, Any]] = []
        for ch in self._changes:
            out.append((ch.owner, ch.attr, ch.new))
            out.extend((mod, name, ch.new) for mod, name in ch.rebinds)
        return out

    def records(self) -> list[ChangeRecord]:
        return [ChangeRecord(ch.owner, ch.attr, ch.original, ch.patch_id) for ch in self._changes]

    def replace(self, owner: Any, attr: str, new: Any, patch_id: str | None, *, original: Any, own: bool) -> None:
        """Set ``owner.attr = new`` and record it, with ``original`` (``own``: it lives in owner's own ``__dict__``;
        else undo deletes ours). On an attribute already changed here the new value goes on top (stacking) and the one
        change keeps the true original, so undo, rebinding and verification see a single wrapper."""
        setattr(owner, attr, new)
        below = self._at(owner, attr)
        if below is None:
            self._changes.append(_Change(owner, attr, own, original, new, patch_id))
        else:
            below.new = new

    def rebind_copies(self, patch_ids: Collection[str | None] | None = None) -> None:
        """Re-point ``from X import Y`` copies of replaced module functions in every imported SGLang module.

        One pass over ``sys.modules`` for all changes (what SGLang's ``HookRegistry._propagate_patch`` does per hook).
        """
        mine = self._select(patch_ids)
        by_original = {id(ch.original): ch for ch in mine if inspect.ismodule(ch.owner) and ch.original is not None}
        if not by_original:
            return
        wanted = by_original.keys()
        for mod in _sglang_modules():
            namespace = vars(mod)
            # Almost no module holds a copy: an identity test over its values at C speed skips the rest.
            if wanted.isdisjoint(map(id, namespace.values())):
                continue
            for name, val in list(namespace.items()):
                ch = by_original.get(id(val))
                if ch is not None and val is ch.original and mod is not ch.owner:
                    setattr(mod, name, ch.new)
                    ch.rebinds.append((mod, name))

    def verify(self, patch_ids: Collection[str | None] | None = None) -> None:
        """Raise RuntimeError unless every recorded attribute and re-pointed copy holds our value now."""
        for ch in self._select(patch_ids):
            if ch.owner.__dict__.get(ch.attr) is not ch.new:
                raise RuntimeError(f"{describe(ch.owner)}.{ch.attr} is not our wrapper after application")
            for mod, name in ch.rebinds:
                if mod.__dict__.get(name) is not ch.new:
                    raise RuntimeError(f"copy {mod.__name__}.{name} was not re-pointed")

    def undo(self, patch_ids: Collection[str | None] | None = None) -> list[str]:
        """Put back the changes of ``patch_ids`` (all: None) in reverse order, by identity; returns the attributes
        another hook holds now, which stay as they are. A change leaves the set only once it is undone, so if a step
        raises, every change not yet undone is still here for a later ``undo``."""
        not_restored = []
        for ch in reversed(list(self._select(patch_ids))):
            if not _undo_one(ch):
                not_restored.append(f"{describe(ch.owner)}.{ch.attr}")
            self._changes.remove(ch)
        return not_restored

    def _at(self, owner: Any, attr: str) -> _Change | None:
        return next((ch for ch in self._changes if ch.owner is owner and ch.attr == attr), None)

    def _select(self, patch_ids: Collection[str | None] | None) -> Iterator[_Change]:
        return (ch for ch in self._changes if patch_ids is None or ch.patch_id in patch_ids)


def _undo_one(ch: _Change) -> bool:
    """Undo one change; False when another hook holds the attribute now (left in place)."""
    for mod, name in ch.rebinds:
        if mod.__dict__.get(name) is ch.new:
            setattr(mod, name, ch.original)
    live = ch.owner.__dict__.get(ch.attr, _MISSING)
    if live is not ch.new and not (live is _MISSING and not ch.own):
        return False
    if ch.own:
        setattr(ch.owner, ch.attr, ch.original)
    elif live is not _MISSING:
        delattr(ch.owner, ch.attr)
    return True


def apply_patch(changes: ChangeSet, patch: Patch, resolved: dict[Target, Resolved], config: Config) -> None:
    """Install ``patch``'s replacements. A target an earlier patch already wraps is wrapped again, on top (wrapt's
    way), but only by a patch that requires that one: the two then apply, stand down and restore together."""
    stacked: dict[Target, _Change] = {}
    for target, res in resolved.items():
        below = changes._at(res.owner, res.attr) if target.kind is Kind.WRAP else None
        if below is not None:
            if below.patch_id not in patch.requires:
                raise RuntimeError(f"{target.name} is wrapped by {below.patch_id}, which {patch.id} does not require")
            stacked[target] = below
    view = {t: replace(r, raw=stacked[t].new) if t in stacked else r for t, r in resolved.items()}
    new_values = patch.replacements(view, config)
    for target, res in resolved.items():
        if target.kind is Kind.CHECK:
            continue
        new = new_values[target]
        if new is UNCHANGED and target.kind is Kind.WRAP:
            continue
        original = stacked[target].original if target in stacked else res.raw
        live_new = fp.function_of(new)
        try:
            setattr(live_new, MARKER, patch.id)
            if original is not None:
                setattr(live_new, ORIGINAL, fp.function_of(original))
        except (AttributeError, TypeError):
            pass  # plain values (class defaults) carry no marker
        changes.replace(res.owner, res.attr, new, patch.id, original=original, own=res.own)


def apply_transaction(
    changes: ChangeSet, todo: Sequence[tuple[Patch, dict[Target, Resolved]]], config: Config
) -> dict[str, str]:
    """Apply the patches of ``todo``, re-point the copies and verify, as one step; returns the fingerprints of the
    patched code (target name -> fingerprint). Raises on any problem: the caller undoes those patches."""
    for patch, resolved in todo:
        apply_patch(changes, patch, resolved, config)
    ids = {patch.id for patch, _ in todo}
    changes.rebind_copies(ids)
    changes.verify(ids)
    return {t.name: r.fingerprint for _, res in todo for t, r in res.items() if r.fingerprint}


def rolled_back_reason(exc: Exception) -> str:
    return f"application failed and was rolled back: {type(exc).__name__}: {exc}"


def _sglang_modules() -> Iterable[Any]:
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "sglang" or name.startswith("sglang.")):
            continue
        yield mod
