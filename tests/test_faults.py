"""Fault injection: every target of every patch x every fault, on the real installed SGLang.

The case list is built from ``all_patches()`` at collection time, so a new patch's targets are covered without
touching this file. Faults: the target is missing, renamed, has a changed signature, has a drifted body, raises
while being applied, or is already hooked by another plugin. Each applicable case must leave SGLang fully stock
(identity of every target, the report seam and every plugin-marked object checked), with exactly one WARNING line
in ``auto``, ``StrictModeAbort`` in ``strict``, and ``doctor --json`` naming the problem. A deferred patch (applied when
its module is imported; the session has imported the DSA modules, so it is checked at ``register()`` through the same
code its post-import hook runs) is its own transaction: a fault leaves *that* patch stock, by identity, with one
WARNING line, and the other patches keep their outcome (the hook itself, in fresh processes: ``test_deferred.py``).
Combinations that cannot apply to a target kind are skipped with the reason in the skip message (``-rs``);
``fault_summary.py`` counts and lists the cases at the end of the run.

How a fault is made (SGLang itself is never edited on disk; ``monkeypatch`` undoes every change):
  * missing / renamed: the attribute (ADD targets: the class that would receive the new attribute) is deleted
    from where it is defined, or moved to ``<name>_renamed``. An optional target that is one home of a ``one_of``
    premise is faulted too where it is the present one (none of its homes left: the premise has vanished).
  * signature / drifted: the target's real source, read from the installed release, gets one extra keyword-only
    parameter / one extra trailing ``pass``, and is compiled under a file name inside SGLang's package (so it looks
    like SGLang's own code, as in a fork or a dev build, not like a foreign hook); nothing is copied into the repo.
  * raising: the owning patch's ``replacements`` raises when the manager installs that target (earlier targets are
    already live, so the rollback is exercised).
  * foreign hook: a ``functools.wraps`` wrapper from this file sits on the target (ADD: the attribute already
    exists, as if another plugin added it).
  * wrapt hook: ``wrapt.wrap_function_wrapper`` on the target, as OpenTelemetry's and ddtrace's integrations do it.
    Its ``FunctionWrapper`` forwards ``__code__``, ``__class__`` and ``__func__`` to the function it wraps.
  * ddtrace hook: ddtrace's in-place wrapping (``ddtrace.internal.wrapping``) keeps the function object and its file,
    swaps its code and marks it with ``__dd_wrapped__``; made here as the mark on the real function.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import json
import linecache
import logging
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from releases import AFFECTED, FAULT_TWIN_RELEASE, SGLANG_VERSION, SUPERSEDED

from sglang_dp_mtp_fix import cli
from sglang_dp_mtp_fix import fingerprints as fp
from sglang_dp_mtp_fix.config import ARRIVAL_SEED_ENV, MODE_ENV, ArrivalSeed, Config
from sglang_dp_mtp_fix.core import MARKER, Kind, Patch, Target, plan
from sglang_dp_mtp_fix.patches import all_patches

# Where a patch applies: every patch on the affected releases, the watch on SGLang's own vote (upstream_vote_watch) on
# the superseded ones, the opt-in arrival_seed on both (every case runs with its setting on); a case whose patch does
# not apply on the release under test skips.
pytestmark = pytest.mark.skipif(
    SGLANG_VERSION not in (*AFFECTED, *SUPERSEDED), reason=f"no patch applies on SGLang {SGLANG_VERSION}"
)

FAULTS = ("missing", "renamed", "signature", "drifted", "raising", "foreign_hook")
# Other plugins' wrappers, judged by the same check as foreign_hook (core/checks.py: _foreign_hook): run as its twins.
# Kept out of FAULTS, which test_deferred.py also runs in fresh processes per deferred target.
WRAPPER_FAULTS = ("wrapt_hook", "ddtrace_hook")
FAULT_PROPERTY = "fault_injection"  # user property read by fault_summary.py
# Faults that run the plugin's code path of another fault ("twin" -> the fault whose path it shares): a renamed target
# fails to resolve exactly as a missing one does, and a drifted body fails the same source-fingerprint comparison as
# a changed signature (core/checks.py has no separate signature check). The twin runs on FAULT_TWIN_RELEASE, where
# every patch applies, and, for a target that release lacks (the generated fingerprints' "absent" list), wherever the
# target exists; the fault whose path it shares runs on every affected release. docs/development.md has the coverage
# table.
TWINS = {"renamed": "missing", "drifted": "signature", "wrapt_hook": "foreign_hook", "ddtrace_hook": "foreign_hook"}


def twin_elsewhere(target: Target) -> bool:
    """Is this target faulted by the twins on FAULT_TWIN_RELEASE (so not here)?"""
    absent_on = fp.known_fingerprints().get("absent", {}).get(target.name, [])
    return SGLANG_VERSION != FAULT_TWIN_RELEASE and FAULT_TWIN_RELEASE not in absent_on


def not_applicable(target: Target, fault: str) -> str | None:
    """Why ``fault`` cannot be made on ``target`` (by its kind), or None."""
    if target.kind is Kind.ADD and fault in ("signature", "drifted"):
        return "an ADD target is a new attribute: it has no existing signature or body to drift"
    if target.kind is Kind.ADD and fault in WRAPPER_FAULTS:
        return "an ADD target is a new attribute: there is nothing to wrap (foreign_hook covers one already there)"
    if fault in ("signature", "drifted") and not target.fingerprinted:
        return "target is not fingerprinted (declared so by its patch)"
    if target.kind is Kind.CHECK and fault == "raising":
        return "a CHECK target is never changed during application, so nothing can raise there"
    if not target.required and not target.one_of and fault in ("missing", "renamed"):
        return "optional target: its absence is a supported layout (it exists only in some releases)"
    return None


def _cases() -> list[Any]:
    cases = []
    for patch in all_patches():
        for target in patch.targets:
            for fault in (*FAULTS, *WRAPPER_FAULTS):
                why = not_applicable(target, fault)
                marks = [pytest.mark.skip(reason=f"n/a ({target.kind.value} target): {why}")] if why else []
                # A wrapper fault runs where its patch applies: on FAULT_TWIN_RELEASE, or where the patch was written
                # for when that is elsewhere (upstream_vote_watch: 0.5.21+).
                elsewhere = fault not in WRAPPER_FAULTS or FAULT_TWIN_RELEASE in patch.written_for
                if not why and fault in TWINS and twin_elsewhere(target) and elsewhere:
                    twin = f"{fault} runs on {FAULT_TWIN_RELEASE} only: it takes the code path of {TWINS[fault]}"
                    marks = [pytest.mark.skip(reason=f"{twin}, which runs here")]
                on = "class-" if target.kind is Kind.ADD and fault in ("missing", "renamed") else ""
                cases.append(pytest.param(patch.id, target, fault, id=f"{fault}-{on}{target.name}", marks=marks))
    return cases


def _resolve_path(module: str, dotted: str) -> tuple[Any, str]:
    obj: Any = importlib.import_module(module)
    parts = dotted.split(".")
    for part in parts[:-1]:
        obj = getattr(obj, part)
    return obj, parts[-1]


def _fault_site(target: Target) -> tuple[Any, str]:
    """Where the fault is made: the class itself for ADD targets, else the object that defines the attribute
    (a module, the class, or the base class it is inherited from)."""
    if target.kind is Kind.ADD:
        return _resolve_path(target.module, target.qualname)
    owner, attr = _resolve_path(target.module, target.qualname)
    if inspect.isclass(owner):
        owner = next((c for c in owner.__mro__ if attr in c.__dict__), owner)
    return owner, attr


def _target_value(target: Target) -> Any:
    """The live attribute behind a target (``<absent>`` when it does not exist)."""
    try:
        if target.kind is Kind.ADD:
            holder, name = _resolve_path(target.module, target.qualname)
            return getattr(holder, name).__dict__.get(target.attr or "", "<absent>")
        owner, attr = _resolve_path(target.module, target.qualname)
        return owner.__dict__.get(attr, "<absent>")
    except Exception:  # noqa: BLE001 - a fault may have removed the owner itself
        return "<absent>"


_WRAPPERS = (classmethod, staticmethod)


def _marks(namespace: dict[str, Any], only: str | None) -> list[str]:
    """The names in ``namespace`` whose function (or classmethod/staticmethod's) carries the plugin's marker."""
    hits = []
    for key, value in list(namespace.items()):
        func = value.__func__ if type(value) in _WRAPPERS else value
        if type(func) is types.FunctionType and MARKER in func.__dict__ and only in (None, func.__dict__[MARKER]):
            hits.append(key)
    return hits


_namespaces: tuple[tuple[int, str], list[tuple[str, Any]]] = ((0, ""), [])


def _sglang_namespaces() -> list[tuple[str, Any]]:
    """(prefix, namespace) of every SGLang module and of every class it defines: live views (a fault's change to a
    name shows), listed again once a module was imported since (sys.modules only grows here, in insertion order).
    Listing the classes was a third of each scan's time."""
    global _namespaces
    key = (len(sys.modules), next(reversed(sys.modules)))
    if _namespaces[0] != key:
        listed: list[tuple[str, Any]] = []
        for name, mod in list(sys.modules.items()):
            if mod is None or not (name == "sglang" or name.startswith("sglang.")):
                continue
            namespace = vars(mod)
            listed.append((name, namespace))
            listed += [(f"{name}.{k}", v.__dict__) for k, v in list(namespace.items())
                       if isinstance(v, type) and v.__module__ == name]  # fmt: skip
        _namespaces = (key, listed)
    return _namespaces[1]


def _marked_objects(only: str | None = None) -> list[str]:
    """Every object carrying the plugin's marker (``only``: that patch's) in an SGLang module or class namespace.
    Exact type checks, as ``fp.function_of`` does: this runs on every name of every SGLang namespace, three times a
    case, and through ``inspect`` it was four fifths of this file's time."""
    return [f"{prefix}.{key}" for prefix, namespace in _sglang_namespaces() for key in _marks(namespace, only)]


def stock_state(only: str | None = None, scan: bool = True) -> dict[str, Any]:
    """What 'fully stock' means, by identity: every target of every patch, the report seam, no marked object.
    ``only``: what 'that patch is stock' means (its targets, no object marked by it). ``scan=False``: the marked
    objects are taken as none, unlooked (a fault just made marks nothing: the state before the plugin runs)."""
    from sglang.srt.managers.scheduler import Scheduler

    patches = [p for p in all_patches() if only in (None, p.id)]
    state: dict[str, Any] = {t.name: _target_value(t) for p in patches for t in p.targets}
    if only is None:
        state["Scheduler.__init__"] = Scheduler.__dict__.get("__init__")
    state["marked objects"] = tuple(_marked_objects(only)) if scan else ()
    return state


def assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before.keys() == after.keys()
    changed = [k for k in before if before[k] is not after[k] and before[k] != after[k]]
    assert not changed, f"not stock after the fault: {changed}"
    assert after["marked objects"] == ()


def _clear_detection_caches() -> None:
    """Feature detection is cached per process (it runs once at load in production); a fault must be seen fresh and
    must not leave a cached verdict behind for the next case."""
    for name, mod in list(sys.modules.items()):
        if name.startswith("sglang_dp_mtp_fix.patches") and mod is not None:
            for value in list(vars(mod).values()):
                if callable(getattr(value, "cache_clear", None)):
                    value.cache_clear()


@functools.lru_cache(maxsize=1)
def baseline() -> dict[str, str]:
    """Each patch's outcome on this release without any fault (computed once, before the first fault is made)."""
    _clear_detection_caches()
    outcomes = plan(all_patches(), Config(arrival_seed=ArrivalSeed.RECENT)).check_deferred_imported().outcomes
    return {o.id: o.status.value for o in outcomes}


def assert_stood_down(statuses: dict[str, str], deferred: str | None = None) -> None:
    """Nothing applied: every patch that applies here without the fault is unsupported (one problem keeps SGLang
    fully stock); the others keep their verdict (not-affected, superseded) or are unsupported too.
    ``deferred``: that deferred patch is unsupported, every other patch keeps its outcome."""
    base = baseline()
    if deferred is not None:
        assert statuses == {**base, deferred: "unsupported"}, statuses
        return
    assert "applied" not in statuses.values(), statuses
    for pid, status in statuses.items():
        assert status == "unsupported" if base[pid] == "applied" else status in (base[pid], "unsupported"), statuses


def _variant(raw: Any, fault: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The target's real source with a changed signature or body, compiled as if it were SGLang's own code."""
    func = inspect.unwrap(fp.function_of(raw))
    source = inspect.getsource(func)
    indented = source[:1].isspace()
    tree = ast.parse("if 1:\n" + source if indented else source)
    node = tree.body[0].body[0] if indented else tree.body[0]  # type: ignore[attr-defined]
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)), type(node)
    if fault == "signature":
        node.args.kwonlyargs.append(ast.arg(arg="injected_fault_param"))
        node.args.kw_defaults.append(ast.Constant(None))
    else:
        node.body.append(ast.Pass())
    module = ast.Module(body=[node], type_ignores=[])
    text = ast.unparse(ast.fix_missing_locations(module)) + "\n"
    sglang_dir = Path(sys.modules["sglang"].__file__ or "").parent
    filename = str(sglang_dir / f"_injected_{fault}_{func.__module__.replace('.', '_')}_{func.__qualname__}.py")
    # Registered in linecache (like any loader-provided source) so inspect.getsource finds the drifted text.
    monkeypatch.setitem(linecache.cache, filename, (len(text), None, text.splitlines(True), filename))
    namespace = dict(vars(sys.modules[func.__module__]))
    exec(compile(text, filename, "exec"), namespace)  # noqa: S102 - compiles SGLang's own (edited) source
    new = namespace[node.name]
    if isinstance(raw, (classmethod, staticmethod)) and not isinstance(new, (classmethod, staticmethod)):
        new = type(raw)(new)
    return new


class _RaisesAt(dict):
    """A patch's replacement values that raise when the manager installs ``target``."""

    def __init__(self, values: dict[Target, Any], target: Target):
        super().__init__(values)
        self.target = target

    def __getitem__(self, key: Target) -> Any:
        if key == self.target:
            raise RuntimeError(f"injected fault while applying {key.name}")
        return super().__getitem__(key)


def inject(patch_id: str, target: Target, fault: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Make ``fault`` on ``target``; returns the text the problem report must contain."""
    try:
        site, name = _fault_site(target)
    except ModuleNotFoundError as exc:
        if target.required or exc.name != target.module:
            raise
        pytest.skip(f"{target.module} is absent in SGLang {SGLANG_VERSION}")
    if fault in ("missing", "renamed"):
        if not hasattr(site, name):
            pytest.skip(f"{target.name} is absent in SGLang {SGLANG_VERSION}")
        value = site.__dict__[name]
        monkeypatch.delattr(site, name)
        if fault == "renamed":
            monkeypatch.setattr(site, f"{name}_renamed", value, raising=False)
        return name
    if fault == "foreign_hook" and target.kind is Kind.ADD:
        monkeypatch.setattr(getattr(site, name), target.attr or "", "another plugin's value", raising=False)
        return target.attr or ""
    if not hasattr(site, name):
        pytest.skip(f"{target.name} is absent in SGLang {SGLANG_VERSION}")
    if fault == "raising":
        patch_cls = type(next(p for p in all_patches() if p.id == patch_id))
        real = patch_cls.replacements

        def replacements(self: Patch, resolved: dict[Target, Any], config: Config) -> dict[Target, Any]:
            return _RaisesAt(real(self, resolved, config), target)

        monkeypatch.setattr(patch_cls, "replacements", replacements)
        return target.name
    raw = site.__dict__.get(name, inspect.getattr_static(site, name))
    if fault in WRAPPER_FAULTS:
        return _other_plugins_wrapper(target, raw, fault, monkeypatch)
    if fault in ("signature", "drifted"):
        monkeypatch.setattr(site, name, _variant(raw, fault, monkeypatch))
        return name
    if fault == "foreign_hook":
        func = fp.function_of(raw)

        @functools.wraps(func)
        def another_plugins_hook(*args: Any, **kwargs: Any) -> Any:
            return func(*args, **kwargs)

        hooked = (
            type(raw)(another_plugins_hook) if isinstance(raw, (classmethod, staticmethod)) else another_plugins_hook
        )
        owner, attr = _resolve_path(target.module, target.qualname)
        monkeypatch.setattr(owner, attr, hooked)
        return name


def _other_plugins_wrapper(target: Target, raw: Any, fault: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Another plugin's real wrapper on the target; monkeypatch puts the stock attribute back."""
    owner, attr = _resolve_path(target.module, target.qualname)
    monkeypatch.setattr(owner, attr, inspect.getattr_static(owner, attr))  # no change: records what the undo restores
    if fault == "wrapt_hook":
        import wrapt

        def traced(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
            return wrapped(*args, **kwargs)

        wrapt.wrap_function_wrapper(target.module, target.qualname, traced)
        assert isinstance(inspect.getattr_static(owner, attr), wrapt.FunctionWrapper)
    else:
        func = fp.function_of(raw)
        monkeypatch.setattr(func, "__dd_wrapped__", functools.partial(func), raising=False)
    return attr


@pytest.mark.parametrize(("patch_id", "target", "fault"), _cases())
def test_fault_leaves_sglang_stock(patch_id, target, fault, monkeypatch, caplog, capsys, request, restored):
    from sglang_dp_mtp_fix.errors import StrictModeAbort

    if baseline()[patch_id] != "applied":
        pytest.skip(f"{patch_id} is {baseline()[patch_id]} on SGLang {SGLANG_VERSION}: its targets are not checked")
    deferred = patch_id if next(p for p in all_patches() if p.id == patch_id).deferred_until_import else None
    pristine = stock_state(scan=False)  # no marked object: the previous case's last check scanned for them
    with monkeypatch.context() as m:
        m.setenv(ARRIVAL_SEED_ENV, ArrivalSeed.RECENT.value)  # the opt-in patch's targets are checked too
        needle = inject(patch_id, target, fault, m)
        before = stock_state(deferred, scan=False)  # pristine's scan above found no marked object

        # auto: fully stock, exactly one WARNING line, naming the problem
        m.setenv(MODE_ENV, "auto")
        _clear_detection_caches()
        restored.restore()
        with caplog.at_level(logging.INFO, logger="sglang_dp_mtp_fix"):
            outcomes = restored.register()
        assert_stood_down({o.id: o.status.value for o in outcomes}, deferred)
        ours = [r for r in caplog.records if r.name.startswith("sglang_dp_mtp_fix")]
        warnings = [r.getMessage() for r in ours if r.levelno >= logging.WARNING]
        said = f"{deferred} left stock" if deferred else "SGLang left stock"
        assert len(warnings) == 1 and said in warnings[0], warnings
        assert needle in " ".join(o.reason for o in outcomes), outcomes
        assert_same(before, stock_state(deferred))

        # strict: a process stop that SGLang's loader cannot swallow, still fully stock
        m.setenv(MODE_ENV, "strict")
        _clear_detection_caches()
        restored.restore()
        with pytest.raises(StrictModeAbort, match="strict: stopping"):
            restored.register()
        assert_same(before, stock_state(deferred))

        # doctor --json (the console script's code path, in this process where the fault lives)
        m.setenv(MODE_ENV, "auto")
        _clear_detection_caches()
        capsys.readouterr()
        code = cli.main(["doctor", "--json"])
        data = json.loads(capsys.readouterr().out)
        statuses = {p["id"]: p["status"] for p in data["patches"]}
        if fault == "raising":
            # doctor checks without applying: an exception while installing is only seen at load (rolled back).
            assert code == 0 and statuses == baseline()
        else:
            # Held back, a patch that does not fix (the watch, the opt-in seed) leaves unfixed only what a fixing
            # patch held back with it would have fixed.
            fixing = [p.id for p in all_patches() if p.fixes and (p.id == patch_id or deferred is None)]
            assert code == (1 if any(baseline()[pid] == "applied" for pid in fixing) else 0), data
            assert_stood_down(statuses, deferred)
            assert needle in " ".join(p["reason"] for p in data["patches"]), data
        restored.restore()
    _clear_detection_caches()
    assert_same(pristine, stock_state())  # and the fault itself is gone
    request.node.user_properties.append((FAULT_PROPERTY, f"{fault:<13} {target.kind.value:<5} {target.name}"))
