"""The patching core: it knows no patch.

Lifecycle (modelled on OpenTelemetry's ``BaseInstrumentor``): every patch declares its targets; a run first
classifies each patch (disabled / superseded / not-affected), then checks *every* target of every patch it would
apply (import, feature detection, source fingerprint), and only if all checks pass applies all of them in one
transaction, verifies the live attributes (including ``from X import Y`` copies in other SGLang modules), and
rolls everything back by identity if anything goes wrong. ``restore()`` puts every original back.

Patches that depend on each other (``requires``) form a group that applies together or not at all; a problem in
any patch leaves SGLang fully stock (non-negotiable: a DP group must never end up half-patched).

Deferred patches (``Patch.deferred_until_import = "module.name"``): a standalone patch (no ``requires``, required by
none) whose targets live in a module that many processes never need. Loading the plugin then does not import that
module: ``classify()`` (which must not import it) runs at load; the checks that need the module
(``check_imported()``, target resolution and fingerprints) and the application run when the module is imported,
from a post-import hook (``importhook``), or at once when it already is. Until then the patch's status is
``not-loaded``. The deferred patch is its own transaction: a problem at that moment leaves that patch stock (its
targets by identity) and is reported through ``PatchManager.on_deferred``; the patches applied at load stay. It is
armed only when the load-time transaction applied or stood down cleanly (a load-time problem keeps everything stock,
deferred patches included). Every rank runs the same code, so the verdict at the hook is the same on every rank;
``peer_fingerprints()`` adds the source digests of the modules a pending patch will check, so the start-up
cross-rank check also covers a module imported only after it ran.
"""

from __future__ import annotations

import enum
import hashlib
import importlib
import importlib.util
import inspect
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sglang_dp_mtp_fix import fingerprint as fp
from sglang_dp_mtp_fix import importhook
from sglang_dp_mtp_fix.config import Config, Mode

# Releases the patches were written against: a target fingerprint must have been seen in one of these.
AFFECTED_RELEASES = ("0.5.15.post1", "0.5.16", "0.5.17", "0.5.18", "0.5.19", "0.5.20")
MARKER = "__sglang_dp_mtp_fix_patch__"
_MISSING = object()


class Status(str, enum.Enum):
    APPLIED = "applied"
    SUPERSEDED = "superseded"
    NOT_AFFECTED = "not-affected"
    DISABLED = "disabled"
    UNSUPPORTED = "unsupported"
    NOT_LOADED = "not-loaded"  # deferred patch whose module this process has not imported (yet)


class Kind(str, enum.Enum):
    WRAP = "wrap"  # replace a function/method/classmethod by a wrapper built from the original
    CHECK = "check"  # code the patch relies on but does not change: fingerprint only
    ADD = "add"  # a new attribute on a class; it must not exist yet


@dataclass(frozen=True)
class Target:
    module: str
    qualname: str  # "func", "Class.method" or, for ADD, the class ("Class")
    kind: Kind = Kind.WRAP
    attr: str | None = None  # ADD: the new attribute's name
    required: bool = True  # False: the target exists only in some releases (absence is fine, drift is not)
    fingerprinted: bool = True
    # Alternatives: the optional targets of one patch sharing a label are one premise whose home differs by release
    # (e.g. moved to another module); at least one of them must be present, else the premise has vanished.
    one_of: str = ""

    @property
    def name(self) -> str:
        suffix = f".{self.attr}" if self.kind is Kind.ADD else ""
        return f"{self.module}:{self.qualname}{suffix}"


class TargetProblem(Exception):
    """A target is not the code the patch was written for."""


class Verdict(Exception):
    """Raised by ``Patch.classify`` to stand a patch down with a status other than ``unsupported``."""

    def __init__(self, status: Status, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass
class Resolved:
    target: Target
    owner: Any  # module or class holding the attribute
    attr: str
    raw: Any  # owner.__dict__[attr] (or None for ADD / inherited)
    own: bool  # attr defined in owner's own __dict__
    matched: tuple[str, ...] = ()  # releases whose source has this target's fingerprint
    fingerprint: str | None = None  # the live source's fingerprint (compared across ranks at start-up)


class Patch:
    """Base class of a patch. Subclasses set the class attributes and implement ``replacements``."""

    id: str = ""
    summary: str = ""
    requires: tuple[str, ...] = ()
    targets: tuple[Target, ...] = ()

    deferred_until_import: str | None = None  # a module name: checked and applied when it is imported (see above)

    def classify(self) -> None:
        """Raise ``Verdict`` when the installed SGLang already has the fix or is not affected.

        For a deferred patch it runs at load and must not import ``deferred_until_import``."""

    def check_imported(self) -> None:
        """Feature detection that needs the imported modules: runs right before the targets are checked (for a
        deferred patch: once its module is imported). Raise ``Verdict`` or ``TargetProblem``."""

    config: Config = Config()  # set by the manager before ``replacements`` (load-time choices such as stats)

    def replacements(self, resolved: dict[Target, Resolved]) -> dict[Target, Any]:
        """New values for WRAP and ADD targets. Keep originals in closures, never in module globals."""
        raise NotImplementedError


@dataclass
class Outcome:
    id: str
    status: Status
    reason: str

    def as_dict(self) -> dict[str, str]:
        return {"id": self.id, "status": self.status.value, "reason": self.reason}


@dataclass
class _Change:
    owner: Any
    attr: str
    own: bool
    original: Any
    new: Any
    rebinds: list[tuple[Any, str]] = field(default_factory=list)  # (module, name) copies we re-pointed
    patch_id: str | None = None  # the patch that made it (None: the plugin's own seams)


class _AbsentModule(Exception):
    """An optional target's module does not exist in this release (absence, not breakage)."""


def _import_owner(target: Target) -> tuple[Any, str]:
    try:
        obj: Any = importlib.import_module(target.module)
    except Exception as exc:  # noqa: BLE001 - any import failure means "not the code we know"
        if isinstance(exc, ModuleNotFoundError) and not target.required and exc.name == target.module:
            raise _AbsentModule(target.module) from exc
        raise TargetProblem(f"{target.module} cannot be imported ({type(exc).__name__}: {exc})") from exc
    parts = target.qualname.split(".")
    if target.kind is Kind.ADD:
        parts = [*parts, target.attr or ""]
    for part in parts[:-1]:
        if not hasattr(obj, part):
            raise TargetProblem(f"{target.name} is missing ({part!r} not found)")
        obj = getattr(obj, part)
    return obj, parts[-1]


def resolve(target: Target) -> Resolved | None:
    """Resolve and check one target. Returns None for an absent optional target; raises TargetProblem."""
    try:
        owner, attr = _import_owner(target)
    except _AbsentModule:
        return None
    own = attr in getattr(owner, "__dict__", {})
    if target.kind is Kind.ADD:
        if not inspect.isclass(owner):
            raise TargetProblem(f"{target.name}: {target.qualname} is not a class")
        if hasattr(owner, attr):
            raise TargetProblem(f"{target.name} already exists (added by SGLang or another plugin)")
        return Resolved(target, owner, attr, None, False)
    if not hasattr(owner, attr):
        if not target.required:
            return None
        raise TargetProblem(f"{target.name} is missing")
    raw = owner.__dict__[attr] if own else inspect.getattr_static(owner, attr)
    live = fp.function_of(raw)
    if not callable(live):
        raise TargetProblem(f"{target.name} is not callable")
    # WRAP and CHECK alike: a hook around code we wrap, or around code we rely on unchanged (CHECK), means the
    # behaviour is no longer the fingerprinted code (the fingerprint alone would see through the wrapper).
    if getattr(live, MARKER, None) is None and _foreign_hook(live):  # a marker: ours (re-application is idempotent)
        raise TargetProblem(f"{target.name} is already wrapped by another hook ({_describe(live)})")
    fingerprint, matched = _check_fingerprint(target, raw) if target.fingerprinted else (None, ())
    return Resolved(target, owner, attr, raw, own, matched, fingerprint)


def _foreign_hook(live: Any) -> bool:
    """True when the live callable's code is not SGLang's own (another plugin or SGLang's HookRegistry wrapper).

    Stock decorators (e.g. ``scheduler_nvtx_method``) also set ``__wrapped__``; their code lives inside SGLang.
    """
    code = getattr(live, "__code__", None)
    if code is None:
        return True  # a proxy object (wrapt, functools.partial, ...) sits where a function should
    sglang_root = sys.modules["sglang"].__file__ or ""
    root = sglang_root.rsplit("/", 1)[0] + "/"
    filename = code.co_filename
    if filename.endswith(_STOCK_DECORATOR_FILES) and getattr(live, "__wrapped__", None) is not None:
        return _foreign_hook(live.__wrapped__)  # SGLang's own ``@torch.inference_mode()``: judge what it wraps
    return not filename.startswith(root) or filename.endswith("plugins/hook_registry.py")


# Decorators SGLang itself puts on functions whose wrapper code lives outside SGLang (torch.inference_mode/no_grad,
# contextlib.contextmanager).
_STOCK_DECORATOR_FILES = ("torch/utils/_contextlib.py", "/contextlib.py")


def _describe(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"


def _check_fingerprint(target: Target, raw: Any) -> tuple[str, tuple[str, ...]]:
    """(fingerprint, releases it was seen in); raises TargetProblem unless one of them is an affected release."""
    live = fp.function_of(raw)
    live = getattr(live, "__sglang_dp_mtp_fix_original__", live)
    try:
        got = fp.fingerprint_object(live, fp.known_texts(target.name))
    except (OSError, TypeError, SyntaxError) as exc:
        raise TargetProblem(f"{target.name}: source unavailable for fingerprinting ({exc})") from exc
    seen_in = fp.releases_with(target.name, got)
    if not any(r in AFFECTED_RELEASES for r in seen_in):
        known = sorted(fp.known_fingerprints().get("targets", {}).get(target.name, {}))
        where = f"seen in {', '.join(seen_in)}" if seen_in else "unknown"
        raise TargetProblem(
            f"{target.name} source drifted: fingerprint {got} ({where}) is not one of the {len(known)} "
            f"known for {AFFECTED_RELEASES[0]}..{AFFECTED_RELEASES[-1]}"
        )
    return got, tuple(seen_in)


def _check_alternatives(targets: Sequence[Target], res: dict[Target, Resolved]) -> None:
    """Each ``one_of`` set must have at least one present member: a premise that vanished is not "optional"."""
    labels: dict[str, list[Target]] = {}
    for t in targets:
        if t.one_of:
            labels.setdefault(t.one_of, []).append(t)
    for label, alternatives in labels.items():
        if not any(t in res for t in alternatives):
            names = " / ".join(t.name for t in alternatives)
            raise TargetProblem(f"{label} is missing: none of its known homes is present ({names})")


def _checked_reason(res: dict[Target, Resolved]) -> str:
    fingerprinted = [r.matched for r in res.values() if r.target.fingerprinted]
    common = set(AFFECTED_RELEASES).intersection(*fingerprinted) if fingerprinted else set()
    as_of = ", ".join(r for r in AFFECTED_RELEASES if r in common) or "mixed releases"
    n, f = len(res), len(fingerprinted)
    return (
        f"{n} target{'s' if n != 1 else ''} checked; "
        f"{f} source fingerprint{'s match' if f != 1 else ' matches'} SGLang {as_of}"
    )


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


class PatchManager:
    """Owns the application state of one process. Thread-safe; idempotent; restorable."""

    def __init__(self, patches: Sequence[Patch]):
        self.patches = list(patches)
        self._lock = threading.RLock()
        self._changes: list[_Change] = []
        self.outcomes: list[Outcome] | None = None
        self.fingerprints: dict[str, str] = {}  # target name -> fingerprint of what was patched (empty when stock)
        self._pending: dict[str, importhook.Hook] = {}  # deferred patch id -> its armed post-import hook
        self._generation = 0  # bumped by apply/restore: a hook armed before a restore does nothing
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
    def pending(self) -> list[str]:
        """Deferred patches whose module has not been imported yet (their hook is armed)."""
        return list(self._pending)

    # -- planning --------------------------------------------------------------------------------------------
    def plan(
        self, config: Config, import_deferred: bool = False, *, check_deferred: bool = True
    ) -> tuple[list[Outcome], dict[str, dict[Target, Resolved]]]:
        """Classify and check every patch without changing anything.

        A deferred patch is never part of the returned transaction. Its outcome is what its post-import hook decides
        when its module is already imported (or, with ``import_deferred`` (doctor), after importing it here), else
        ``not-loaded``; ``check_deferred=False`` (``apply``, which checks them when it arms them) leaves every
        deferred patch that ``classify`` let through ``not-loaded``."""
        outcomes: dict[str, Outcome] = {}
        resolved: dict[str, dict[Target, Resolved]] = {}
        if config.error:
            for p in self.patches:
                outcomes[p.id] = Outcome(p.id, Status.UNSUPPORTED, f"not applied: bad configuration: {config.error}")
            return [outcomes[p.id] for p in self.patches], {}
        skipped_groups: dict[str, str] = {}
        for grp in groups(self.patches):
            named = sorted(p.id for p in grp if p.id in config.skip)
            if named and len(grp) > 1:
                for p in grp:
                    skipped_groups[p.id] = (
                        f"skipped by SGLANG_DP_MTP_FIX_SKIP ({', '.join(named)}); its group "
                        f"{'+'.join(q.id for q in grp)} applies together or not at all"
                    )
            elif named:
                skipped_groups[grp[0].id] = "skipped by SGLANG_DP_MTP_FIX_SKIP"
        for p in self.patches:
            if config.mode is Mode.OFF:
                outcomes[p.id] = Outcome(p.id, Status.DISABLED, "kill switch SGLANG_DP_MTP_FIX=off")
                continue
            if p.id in skipped_groups:
                outcomes[p.id] = Outcome(p.id, Status.DISABLED, skipped_groups[p.id])
                continue
            try:
                p.classify()
            except Verdict as v:
                outcomes[p.id] = Outcome(p.id, v.status, v.reason)
                continue
            except TargetProblem as exc:
                outcomes[p.id] = Outcome(p.id, Status.UNSUPPORTED, str(exc))
                continue
            except Exception as exc:  # noqa: BLE001 - classification must never crash the host
                outcomes[p.id] = Outcome(p.id, Status.UNSUPPORTED, f"feature detection failed: {exc!r}")
                continue
            if p.deferred_until_import:
                outcomes[p.id] = Outcome(p.id, Status.NOT_LOADED, _not_loaded_reason(p))
                continue
            outcome, res = self._check(p)
            outcomes[p.id] = outcome
            if res is not None:
                resolved[p.id] = res
        self._enforce_groups(outcomes)
        # Never half-patched: one unsupported patch keeps SGLang fully stock (deferred patches are never armed then).
        bad = [o for o in outcomes.values() if o.status is Status.UNSUPPORTED]
        if bad:
            first = bad[0]
            for o in outcomes.values():
                if o.status in (Status.APPLIED, Status.NOT_LOADED):
                    o.status = Status.UNSUPPORTED
                    o.reason = f"not applied: SGLang kept fully stock because {first.id} is unsupported"
            resolved = {}
        elif check_deferred:
            for p in self.patches:
                if outcomes[p.id].status is not Status.NOT_LOADED:
                    continue
                imported = importhook.is_imported(p.deferred_until_import or "")
                if imported or import_deferred:
                    outcome, _ = self._check_deferred(p)
                    if outcome.status is Status.APPLIED and not imported:
                        outcome.reason = f"applied when {p.deferred_until_import} is imported ({outcome.reason})"
                    outcomes[p.id] = outcome
        return [outcomes[p.id] for p in self.patches], resolved

    def _check(self, p: Patch) -> tuple[Outcome, dict[Target, Resolved] | None]:
        """``check_imported`` and every target of one patch: (outcome, resolved targets or None)."""
        try:
            p.check_imported()
            res = {}
            for t in p.targets:
                r = resolve(t)
                if r is not None:
                    res[t] = r
            _check_alternatives(p.targets, res)
        except Verdict as v:
            return Outcome(p.id, v.status, v.reason), None
        except TargetProblem as exc:
            return Outcome(p.id, Status.UNSUPPORTED, str(exc)), None
        except Exception as exc:  # noqa: BLE001
            return Outcome(p.id, Status.UNSUPPORTED, f"target check failed: {exc!r}"), None
        return Outcome(p.id, Status.APPLIED, _checked_reason(res)), res

    def _check_deferred(self, p: Patch) -> tuple[Outcome, dict[Target, Resolved] | None]:
        module = p.deferred_until_import or ""
        try:
            importlib.import_module(module)  # already imported when called from the hook
        except Exception as exc:  # noqa: BLE001 - e.g. a CUDA-only dependency missing in this process
            return Outcome(
                p.id,
                Status.NOT_AFFECTED,
                f"{module} cannot be imported here ({type(exc).__name__}: {exc}); this process cannot run that code, "
                "so there is nothing to patch",
            ), None
        return self._check(p)

    def _enforce_groups(self, outcomes: dict[str, Outcome]) -> None:
        for grp in groups(self.patches):
            statuses = {outcomes[p.id].status for p in grp}
            if Status.APPLIED in statuses and statuses != {Status.APPLIED}:
                odd = next(p for p in grp if outcomes[p.id].status is not Status.APPLIED)
                for p in grp:
                    if outcomes[p.id].status is Status.APPLIED:
                        outcomes[p.id] = Outcome(
                            p.id,
                            Status.UNSUPPORTED,
                            f"not applied: its group member {odd.id} is {outcomes[odd.id].status.value} "
                            f"({outcomes[odd.id].reason})",
                        )

    # -- application -----------------------------------------------------------------------------------------
    def apply(self, config: Config) -> list[Outcome]:
        with self._lock:
            if self._changes or self._pending:  # idempotent per process
                assert self.outcomes is not None
                return self.outcomes
            outcomes, resolved = self.plan(config, check_deferred=False)
            to_apply = [p for p in self.patches if p.id in resolved]
            try:
                for p in to_apply:
                    p.config = config
                    self._apply_patch(p, resolved[p.id])
                self._rebind_module_copies(self._changes)
                self._verify(self._changes)
                self.fingerprints = {
                    t.name: r.fingerprint for res in resolved.values() for t, r in res.items() if r.fingerprint
                }
            except Exception as exc:  # noqa: BLE001 - roll back and stay stock
                self.restore()
                reason = f"application failed and was rolled back: {type(exc).__name__}: {exc}"
                for o in outcomes:
                    if o.status in (Status.APPLIED, Status.NOT_LOADED):
                        o.status, o.reason = Status.UNSUPPORTED, reason
            self.outcomes = outcomes
            self._generation += 1
            for p in self.patches:
                if p.deferred_until_import and next(o for o in outcomes if o.id == p.id).status is Status.NOT_LOADED:
                    self._arm(p, config)
            return outcomes

    # -- deferred patches --------------------------------------------------------------------------------------
    def _arm(self, patch: Patch, config: Config) -> None:
        """Apply ``patch`` when its module is imported (now, if it already is). Called under the lock."""
        module, generation = patch.deferred_until_import or "", self._generation

        def hook(_module: Any) -> None:
            outcome = self._apply_deferred(patch, config, generation)
            if outcome is not None and self.on_deferred is not None:
                self.on_deferred(patch, outcome)  # may raise StrictModeAbort: the import fails, the process stops

        if importhook.is_imported(module):
            self._apply_deferred(patch, config, generation)  # during apply(): reported with the other outcomes
            return
        self._pending[patch.id] = hook
        importhook.when_imported(module, hook)

    def _apply_deferred(self, patch: Patch, config: Config, generation: int) -> Outcome | None:
        """Check and apply one deferred patch as its own transaction; updates its Outcome in place (the object in
        ``self.outcomes``, so the held report line and the cross-rank check see it). None when restored since."""
        with self._lock:
            if generation != self._generation or self.outcomes is None:
                return None
            self._pending.pop(patch.id, None)
            outcome = next(o for o in self.outcomes if o.id == patch.id)
            new, res = self._check_deferred(patch)
            if res is not None:
                start = len(self._changes)
                try:
                    patch.config = config
                    self._apply_patch(patch, res)
                    added = self._changes[start:]
                    self._rebind_module_copies(added)
                    self._verify(added)
                    self.fingerprints.update({t.name: r.fingerprint for t, r in res.items() if r.fingerprint})
                except Exception as exc:  # noqa: BLE001 - roll this patch back, keep the others
                    self._undo(start)
                    why = f"application failed and was rolled back: {type(exc).__name__}: {exc}"
                    new = Outcome(patch.id, Status.UNSUPPORTED, why)
            outcome.status, outcome.reason = new.status, new.reason
            return outcome

    def peer_fingerprints(self) -> dict[str, str]:
        """What the start-up cross-rank check compares besides statuses: the fingerprints of the patched code, plus
        a digest of the source of every module a still-pending deferred patch will check when it is imported (so a
        module imported after the check is still the same code on every rank). Read from disk, no import."""
        out = dict(self.fingerprints)
        for p in self.patches:
            if p.id in self._pending:
                for module in sorted({t.module for t in p.targets}):
                    out[f"source of {module}"] = _source_digest(module)
        return out

    def _apply_patch(self, patch: Patch, resolved: dict[Target, Resolved]) -> None:
        # A target an earlier patch of this manager already wraps is wrapped again, on top (wrapt's way), but only
        # by a patch that requires that one: the two then apply, stand down and restore together. One change per
        # attribute keeps the true original, so undo, rebinding and verification see a single wrapper.
        stacked: dict[Target, _Change] = {}
        for target, res in resolved.items():
            below = self._change_at(res.owner, res.attr) if target.kind is Kind.WRAP else None
            if below is not None:
                if below.patch_id not in patch.requires:
                    raise RuntimeError(f"{target.name} is wrapped by {below.patch_id}, which {patch.id} does not require")
                stacked[target] = below
        view = {t: replace(r, raw=stacked[t].new) if t in stacked else r for t, r in resolved.items()}
        new_values = patch.replacements(view)
        for target, res in resolved.items():
            if target.kind is Kind.CHECK:
                continue
            new = new_values[target]
            below = stacked.get(target)
            original = below.original if below is not None else res.raw
            live_new = fp.function_of(new)
            try:
                setattr(live_new, MARKER, patch.id)
                if original is not None:
                    live_new.__sglang_dp_mtp_fix_original__ = fp.function_of(original)
            except (AttributeError, TypeError):
                pass  # plain values (class defaults) carry no marker
            setattr(res.owner, res.attr, new)
            if below is not None:
                below.new = new
            else:
                self._changes.append(_Change(res.owner, res.attr, res.own, original, new, patch_id=patch.id))

    def _change_at(self, owner: Any, attr: str) -> _Change | None:
        return next((ch for ch in self._changes if ch.owner is owner and ch.attr == attr), None)

    def _rebind_module_copies(self, changes: Sequence[_Change]) -> None:
        """Re-point ``from X import Y`` copies of patched module functions in every imported SGLang module.

        One pass over ``sys.modules`` for all changes (what SGLang's ``HookRegistry._propagate_patch`` does per hook).
        """
        by_original = {id(ch.original): ch for ch in changes if inspect.ismodule(ch.owner) and ch.original is not None}
        if not by_original:
            return
        wanted = by_original.keys()
        for mod in _sglang_modules():
            namespace = vars(mod)
            # ~1,000 SGLang modules in a scheduler, almost none holding a copy: the test runs at C speed (was ~20 ms
            # of a ~50 ms activation as a Python loop over every global)
            if wanted.isdisjoint(map(id, namespace.values())):
                continue
            for name, val in list(namespace.items()):
                ch = by_original.get(id(val))
                if ch is not None and val is ch.original and mod is not ch.owner:
                    setattr(mod, name, ch.new)
                    ch.rebinds.append((mod, name))

    def _verify(self, changes: Sequence[_Change]) -> None:
        for ch in changes:
            live = ch.owner.__dict__.get(ch.attr)
            if live is not ch.new:
                raise RuntimeError(f"{_describe(ch.owner)}.{ch.attr} is not our wrapper after application")
            for mod, name in ch.rebinds:
                if mod.__dict__.get(name) is not ch.new:
                    raise RuntimeError(f"copy {mod.__name__}.{name} was not re-pointed")

    def restore(self) -> list[str]:
        """Put every original back, by identity, in reverse order.

        An attribute that another hook has since wrapped (e.g. SGLang's ``HookRegistry`` applied after us) is left
        in place rather than clobbering that hook; it is returned (and logged) as not restored.
        """
        with self._lock:
            for hook in self._pending.values():
                importhook.cancel(hook)
            self._pending.clear()
            self._generation += 1
            not_restored = self._undo(0)
            self.outcomes = None
            self.fingerprints = {}
        if not_restored:
            import logging

            logging.getLogger("sglang_dp_mtp_fix").warning(
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
            for pid in ids & set(self._pending):
                importhook.cancel(self._pending.pop(pid))
            keep: list[_Change] = []
            undo: list[_Change] = []
            for ch in self._changes:
                (undo if ch.patch_id in ids else keep).append(ch)
            self._changes = undo
            not_restored = self._undo(0)
            self._changes = keep
            names = {t.name for p in self.patches if p.id in ids for t in p.targets}
            self.fingerprints = {k: v for k, v in self.fingerprints.items() if k not in names}
            for o in self.outcomes or []:
                if o.id in ids:
                    o.status, o.reason = Status.UNSUPPORTED, reason
        return not_restored

    def _undo(self, start: int) -> list[str]:
        """Undo ``self._changes[start:]`` in reverse order, by identity; returns what another hook holds now."""
        not_restored = []
        while len(self._changes) > start:
            ch = self._changes.pop()
            for mod, name in ch.rebinds:
                if mod.__dict__.get(name) is ch.new:
                    setattr(mod, name, ch.original)
            live = ch.owner.__dict__.get(ch.attr, _MISSING)
            if live is not ch.new and not (live is _MISSING and not ch.own):
                not_restored.append(f"{_describe(ch.owner)}.{ch.attr}")
                continue
            if ch.own:
                setattr(ch.owner, ch.attr, ch.original)
            elif live is not _MISSING:
                delattr(ch.owner, ch.attr)
        return not_restored


def _not_loaded_reason(p: Patch) -> str:
    return (
        f"{p.deferred_until_import} is not imported in this process (yet); the patch is checked and applied when it "
        "is imported"
    )


def _source_digest(module: str) -> str:
    """sha256 (16 hex) of a module's source file, found without importing the module itself."""
    try:
        spec = importlib.util.find_spec(module)
        origin = getattr(spec, "origin", None) if spec is not None else None
        with open(origin or "", "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()[:16]
    except Exception as exc:  # noqa: BLE001 - compared across ranks: an unreadable source is a value too
        return f"unreadable ({type(exc).__name__})"


def _sglang_modules() -> Iterable[Any]:
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "sglang" or name.startswith("sglang.")):
            continue
        yield mod
