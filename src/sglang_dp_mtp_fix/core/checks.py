"""Checking a patch without changing anything: resolve each target (wrapt's ``resolve_path``), fingerprint its
source against the releases it was written for, and turn the result into an ``Outcome``."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
import types
from collections.abc import Sequence
from typing import Any

from sglang_dp_mtp_fix import fingerprints as fp
from sglang_dp_mtp_fix.core.model import (
    MARKER,
    ORIGINAL,
    HeldBack,
    Kind,
    Outcome,
    Patch,
    Resolved,
    StandDown,
    Status,
    Target,
    TargetProblem,
    unsupported,
)
from sglang_dp_mtp_fix.sglang_versions import AFFECTED_RELEASES

# Decorators SGLang itself puts on functions whose wrapper code lives outside SGLang (torch.inference_mode/no_grad,
# contextlib.contextmanager).
_STOCK_DECORATOR_FILES = ("torch/utils/_contextlib.py", "/contextlib.py")


class _AbsentModule(Exception):
    """An optional target's module does not exist in this release (absence, not breakage)."""


def import_owner(target: Target) -> tuple[Any, str]:
    """(the module or class holding the target's attribute, the attribute's name); raises TargetProblem."""
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


def resolve(target: Target, written_for: tuple[str, ...] = AFFECTED_RELEASES) -> Resolved | None:
    """Resolve and check one target (its fingerprint seen in one of ``written_for``). Returns None for an absent
    optional target; raises TargetProblem."""
    try:
        owner, attr = import_owner(target)
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
    # getattr_static: a plain getattr on a class would bind a classmethod/staticmethod and hide what is stored there.
    raw = owner.__dict__[attr] if own else inspect.getattr_static(owner, attr)
    live = fp.function_of(raw)
    if not callable(live):
        raise TargetProblem(f"{target.name} is not callable")
    # WRAP and CHECK alike: a hook around code we wrap, or around code we rely on unchanged (CHECK), means the
    # behaviour is no longer the fingerprinted code (the fingerprint alone would see through the wrapper).
    if getattr(live, MARKER, None) is None and _foreign_hook(live):  # a marker: ours (re-application is idempotent)
        raise TargetProblem(f"{target.name} is already wrapped by another hook ({describe(live)})")
    fingerprint, matched = _check_fingerprint(target, raw, written_for) if target.fingerprinted else (None, ())
    return Resolved(target, owner, attr, raw, own, matched, fingerprint)


def _foreign_hook(live: Any) -> bool:
    """True when the live callable's code is not SGLang's own (another plugin or SGLang's HookRegistry wrapper).

    Stock decorators (e.g. ``scheduler_nvtx_method``) also set ``__wrapped__``; their code lives inside SGLang.
    """
    if type(live) is not types.FunctionType:
        # A proxy sits where a function should. wrapt's FunctionWrapper (OpenTelemetry, ddtrace's integrations)
        # forwards __code__ and __class__, so only the exact type tells it from the function it wraps.
        return True
    if getattr(live, "__dd_wrapped__", None) is not None:
        return True  # ddtrace's in-place wrapping: same function object and file, its code swapped
    code = live.__code__
    sglang_root = sys.modules["sglang"].__file__ or ""
    root = sglang_root.rsplit("/", 1)[0] + "/"
    filename = code.co_filename
    wrapped = getattr(live, "__wrapped__", None)
    if filename.endswith(_STOCK_DECORATOR_FILES) and wrapped is not None:
        return _foreign_hook(wrapped)  # SGLang's own ``@torch.inference_mode()``: judge what it wraps
    return not filename.startswith(root) or filename.endswith("plugins/hook_registry.py")


def describe(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"


def _check_fingerprint(target: Target, raw: Any, written_for: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    """(fingerprint, releases it was seen in); raises TargetProblem unless one of them is in ``written_for``."""
    live = fp.function_of(raw)
    live = getattr(live, ORIGINAL, live)  # our own wrapper (re-application): judge the code it replaced
    try:
        got = fp.fingerprint_object(live, fp.known_texts(target.name))
    except (OSError, TypeError, SyntaxError) as exc:
        raise TargetProblem(f"{target.name}: source unavailable for fingerprinting ({exc})") from exc
    seen_in = fp.releases_with(target.name, got)
    if not any(r in written_for for r in seen_in):
        known = sorted(fp.known_fingerprints().get("targets", {}).get(target.name, {}))
        where = f"seen in {', '.join(seen_in)}" if seen_in else "unknown"
        raise TargetProblem(
            f"{target.name} source drifted: fingerprint {got} ({where}) is not one of the {len(known)} "
            f"known for {written_for[0]}..{written_for[-1]}"
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


def _checked_reason(res: dict[Target, Resolved], written_for: tuple[str, ...]) -> str:
    fingerprinted = [r.matched for r in res.values() if r.target.fingerprinted]
    common = set(written_for).intersection(*fingerprinted) if fingerprinted else set()
    as_of = ", ".join(r for r in written_for if r in common) or "mixed releases"
    n, f = len(res), len(fingerprinted)
    return (
        f"{n} target{'s' if n != 1 else ''} checked; "
        f"{f} source fingerprint{'s match' if f != 1 else ' matches'} SGLang {as_of}"
    )


def check_patch(p: Patch) -> tuple[Outcome, dict[Target, Resolved] | None]:
    """``check_imported`` and every target of one patch: (outcome, resolved targets or None)."""
    try:
        p.check_imported()
        res = {}
        for t in p.targets:
            r = resolve(t, p.written_for)
            if r is not None:
                res[t] = r
        _check_alternatives(p.targets, res)
    except StandDown as v:
        return stand_down_outcome(p.id, v), None
    except TargetProblem as exc:
        return unsupported(p.id, HeldBack.OWN_CHECK, str(exc)), None
    except Exception as exc:  # noqa: BLE001
        return unsupported(p.id, HeldBack.OWN_CHECK, f"target check failed: {exc!r}"), None
    return Outcome(p.id, Status.APPLIED, _checked_reason(res, p.written_for)), res


def stand_down_outcome(patch_id: str, stand_down: StandDown) -> Outcome:
    held_back = HeldBack.OWN_CHECK if stand_down.status is Status.UNSUPPORTED else None
    return Outcome(patch_id, stand_down.status, stand_down.reason, held_back)


def check_deferred_patch(p: Patch) -> tuple[Outcome, dict[Target, Resolved] | None]:
    """Import a deferred patch's module (already imported when called from its hook), then ``check_patch``."""
    module = p.deferred_until_import or ""
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - e.g. a CUDA-only dependency missing in this process
        reason = (
            f"{module} cannot be imported here ({type(exc).__name__}: {exc}); this process cannot run that code, "
            "so there is nothing to patch"
        )
        return Outcome(p.id, Status.NOT_AFFECTED, reason), None
    return check_patch(p)


def source_digest(module: str) -> str:
    """sha256 (16 hex) of a module's source file, found without importing the module itself."""
    try:
        spec = importlib.util.find_spec(module)
        origin = getattr(spec, "origin", None) if spec is not None else None
        with open(origin or "", "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()[:16]
    except Exception as exc:  # noqa: BLE001 - compared across ranks: an unreadable source is a value too
        return f"unreadable ({type(exc).__name__})"
