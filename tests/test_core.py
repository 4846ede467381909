"""The patching core against the real installed SGLang: check-all-then-apply, verification, restore by identity,
``from X import Y`` copies, idempotence, groups (faults per target: ``test_faults.py``)."""

from __future__ import annotations

import importlib
import sys

import pytest
from releases import SGLANG_VERSION
from support import VOTE_GROUP, affected_only, expected_statuses, requires_sglang

from sglang_dp_mtp_fix import fingerprints as fp
from sglang_dp_mtp_fix.config import Config, Mode
from sglang_dp_mtp_fix.core import MARKER, Kind, PatchManager, Status, Target, TargetProblem, groups, plan
from sglang_dp_mtp_fix.patches import PATCH_IDS, all_patches

pytestmark = requires_sglang


def _live(target: Target):
    owner = importlib.import_module(target.module)
    parts = target.qualname.split(".") + ([target.attr] if target.kind is Kind.ADD else [])
    for part in parts[:-1]:
        owner = getattr(owner, part)
    return owner, parts[-1]


def _snapshot(applied_only: bool = False):
    """Identity of every target attribute (what 'fully stock' means); optionally of the patches this release gets."""
    snap = {}
    expected = expected_statuses()
    for patch in all_patches():
        if applied_only and expected[patch.id] != "applied":
            continue
        for t in patch.targets:
            if t.kind is Kind.CHECK:
                continue
            try:
                owner, attr = _live(t)
            except Exception:  # noqa: BLE001
                continue
            snap[t.name] = owner.__dict__.get(attr, "<absent>")
    return snap


def test_patch_ids_and_group():
    assert [p.id for p in all_patches()] == list(PATCH_IDS)
    singles = [[pid] for pid in PATCH_IDS if pid not in VOTE_GROUP]
    assert [[p.id for p in g] for g in groups(all_patches())] == [list(VOTE_GROUP), *singles]


def _fingerprint_from_source_file(target: Target) -> str | None:
    """The target's fingerprint read from its module's file (for modules this CPU venv cannot import)."""
    from sglang_dp_mtp_fix.patches._detect import module_tree

    tree = module_tree(target.module)
    node = fp.find_definition(tree, target.qualname) if tree is not None else None
    return fp.fingerprint_node(node) if node is not None else None


def test_committed_fingerprints_cover_this_release():
    """The generated file lists this release's source for every fingerprinted target it has."""
    data = fp.known_fingerprints()
    assert SGLANG_VERSION in data["releases"]
    for patch in all_patches():
        for t in patch.targets:
            if not t.fingerprinted or t.kind is Kind.ADD:
                continue
            try:
                owner, attr = _live(t)
            except Exception:  # noqa: BLE001
                owner, attr = None, None
            if owner is None and (got := _fingerprint_from_source_file(t)) is not None:
                # The module cannot be imported in this CPU venv (e.g. DSA on 0.5.15 needs cutlass): read its file.
                assert SGLANG_VERSION in data["targets"][t.name][got], (t.name, got)
                continue
            if owner is None or not hasattr(owner, attr):
                assert SGLANG_VERSION in data["absent"].get(t.name, []), t.name
                continue
            got = fp.fingerprint_object(owner.__dict__.get(attr, getattr(owner, attr)))
            assert SGLANG_VERSION in data["targets"][t.name][got], (t.name, got)


def test_plan_changes_nothing():
    before = _snapshot()
    outcomes = plan(all_patches(), Config()).check_deferred_imported().outcomes
    assert {o.id: o.status.value for o in outcomes} == expected_statuses()
    assert _snapshot() == before


@affected_only
def test_apply_verify_restore_by_identity(restored):
    before, before_applied = _snapshot(), _snapshot(applied_only=True)
    outcomes = restored.register()
    assert {o.id: o.status.value for o in outcomes} == expected_statuses(), outcomes
    after = _snapshot()
    changed = {k for k in before if before[k] is not after[k]}
    assert changed == set(before_applied), "every WRAP/ADD target of an applied patch is live, no other"
    for name, value in _snapshot(applied_only=True).items():
        live = value.__func__ if isinstance(value, classmethod) else value
        if callable(live):
            assert getattr(live, MARKER, None) in PATCH_IDS, name
    # idempotent per process: a second register() changes nothing
    assert restored.register() == outcomes
    assert _snapshot() == after
    restored.restore()
    assert _snapshot() == before  # identity, not equality


@affected_only
def test_from_import_copies_are_repointed_and_restored(restored):
    dp_attn = importlib.import_module("sglang.srt.managers.scheduler_components.dp_attn")
    original = dp_attn._update_gather_batch
    copy_holder = type(sys)("sglang._dp_mtp_fix_test_copy")  # an SGLang-namespace module holding a from-import copy
    copy_holder._update_gather_batch = original
    sys.modules[copy_holder.__name__] = copy_holder
    try:
        restored.register()
        assert copy_holder._update_gather_batch is dp_attn._update_gather_batch is not original
        restored.restore()
        assert copy_holder._update_gather_batch is original and dp_attn._update_gather_batch is original
    finally:
        del sys.modules[copy_holder.__name__]


@affected_only
@pytest.mark.parametrize("skip", VOTE_GROUP)
def test_skipping_any_member_skips_the_whole_group(skip, restored):
    before = _snapshot()
    manager = PatchManager(all_patches())
    outcomes = {o.id: o for o in manager.apply(Config(skip=frozenset({skip})))}
    assert all(outcomes[pid].status is Status.DISABLED for pid in VOTE_GROUP)
    assert all("applies together or not at all" in outcomes[pid].reason for pid in VOTE_GROUP)
    after = _snapshot()
    vote_targets = {t.name for p in all_patches() if p.id in VOTE_GROUP for t in p.targets}
    assert {k: v for k, v in after.items() if k in vote_targets} == {
        k: v for k, v in before.items() if k in vote_targets
    }
    manager.restore()
    assert _snapshot() == before


@affected_only
@pytest.mark.parametrize("skip", [pid for pid in PATCH_IDS if pid not in VOTE_GROUP])
def test_skipping_a_single_patch_leaves_the_others(skip):
    manager = PatchManager(all_patches())
    outcomes = {o.id: o.status.value for o in manager.apply(Config(skip=frozenset({skip})))}
    try:
        assert outcomes == {**expected_statuses(), skip: "disabled"}
    finally:
        manager.restore()


def test_kill_switch():
    before = _snapshot()
    outcomes = PatchManager(all_patches()).apply(Config(mode=Mode.OFF))
    assert {o.status for o in outcomes} == {Status.DISABLED}
    assert _snapshot() == before


# Faults (missing, renamed, signature, drifted, raising, foreign hook) x every target: tests/test_faults.py.


def test_text_fast_path_does_not_accept_a_longer_body(tmp_path):
    """A body that starts exactly like a known one but goes on is fingerprinted from its AST, not accepted."""
    import importlib.util

    src = "def f(x):\n    return x\n"
    longer = "def f(x):\n    return x\n    print('more')\n"
    known = {fp.text_digest(src.splitlines(keepends=True)): (2, fp.fingerprint_source(src))}
    for name, text in (("same", src), ("longer", longer)):
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        got = fp.fingerprint_object(mod.f, known)
        assert (got == fp.fingerprint_source(src)) is (name == "same")


class _OneOfPatch:
    """A patch (of the core's Patch shape) with one premise that has two optional homes."""

    @staticmethod
    def make(*targets: Target):
        from sglang_dp_mtp_fix.core import Patch

        class OneOf(Patch):
            id = "one_of_probe"

            def replacements(self, resolved, config):
                return {}

        OneOf.targets = targets
        return OneOf()


@affected_only
def test_one_of_premise_needs_one_present_home():
    """Alternatives (``one_of``): a present home is checked as usual, an absent one is fine, none present is an error
    (a vanished premise must not report applied); a module that does not exist is an absent home."""
    real = next(t for p in all_patches() for t in p.targets if t.one_of == "prepare_for_draft")
    present = [t for p in all_patches() for t in p.targets if t.one_of == "prepare_for_draft"]
    label = real.one_of
    gone_module = Target(
        "sglang.srt.speculative.no_such_module", "prepare_for_draft", Kind.CHECK, required=False, one_of=label
    )
    gone_attr = Target(real.module, "no_such_function", Kind.CHECK, required=False, one_of=label)
    outcomes = plan([_OneOfPatch.make(*present)], Config()).outcomes
    assert outcomes[0].status is Status.APPLIED, outcomes
    outcomes = plan([_OneOfPatch.make(gone_module, gone_attr)], Config()).outcomes
    assert outcomes[0].status is Status.UNSUPPORTED, outcomes
    assert "prepare_for_draft is missing: none of its known homes is present" in outcomes[0].reason
    # a required target in a module that does not exist stays an import problem
    outcomes = plan([_OneOfPatch.make(Target(gone_module.module, "f", Kind.CHECK))], Config()).outcomes
    assert outcomes[0].status is Status.UNSUPPORTED and "cannot be imported" in outcomes[0].reason


@affected_only
def test_a_wrapper_stacks_only_on_a_patch_it_requires(restored):
    """draft_token_counts wraps two targets draft_graph_vote already wraps: stacked on top, one change per
    attribute keeps the true original (restore by identity). A patch that does not require the one below is refused
    and the whole transaction rolls back (a patch in another group could stand down alone and drop the other's
    wrapper)."""
    from sglang_dp_mtp_fix.patches.draft_graph_vote import UPDATE_BATCH, DraftGraphVote

    dp_attn = importlib.import_module("sglang.srt.managers.scheduler_components.dp_attn")
    original = dp_attn._update_gather_batch
    restored.register()
    outer = dp_attn._update_gather_batch
    assert getattr(outer, MARKER) == "draft_token_counts"
    assert getattr(outer.__wrapped__, MARKER) == "draft_graph_vote" and outer.__wrapped__.__wrapped__ is original
    restored.restore()
    assert dp_attn._update_gather_batch is original

    class Stranger(DraftGraphVote.__bases__[0]):  # a bare Patch on the vote's target, without ``requires``
        id = "stranger"
        targets = (UPDATE_BATCH,)

        def replacements(self, resolved, config):
            return {UPDATE_BATCH: lambda *a, **k: resolved[UPDATE_BATCH].raw(*a, **k)}

    before = _snapshot()
    outcomes = {o.id: o for o in PatchManager([*all_patches(), Stranger()]).apply(Config())}
    assert outcomes["stranger"].status is Status.UNSUPPORTED
    assert "is wrapped by draft_graph_vote, which stranger does not require" in outcomes["stranger"].reason
    assert all(o.status is not Status.APPLIED for o in outcomes.values())
    assert _snapshot() == before and dp_attn._update_gather_batch is original


@affected_only
def test_stand_down_keeps_tracking_what_an_undo_step_could_not_reach(restored):
    """``stand_down`` is an undo of those patches' changes only: if one step raises (here a module refuses to have
    its ``from X import Y`` copy put back), every change not yet undone, the group's and the other patches', is still
    tracked, and a later ``restore()`` puts all of it back by identity."""
    dp_attn = importlib.import_module("sglang.srt.managers.scheduler_components.dp_attn")

    class Stubborn(type(sys)):
        refuse = False

        def __setattr__(self, name: str, value: object) -> None:
            if self.refuse and name == "_update_gather_batch":
                raise RuntimeError("refused")
            super().__setattr__(name, value)

    holder = Stubborn("sglang._dp_mtp_fix_test_stubborn")
    holder._update_gather_batch = dp_attn._update_gather_batch
    sys.modules[holder.__name__] = holder
    before = _snapshot()
    try:
        restored.register()
        assert holder._update_gather_batch is dp_attn._update_gather_batch
        holder.refuse = True
        with pytest.raises(RuntimeError, match="refused"):
            restored.get_manager().stand_down(VOTE_GROUP, "test")
        holder.refuse = False
        restored.restore()
        assert _snapshot() == before  # every patch back, the ones applied beside the group included
        assert holder._update_gather_batch is dp_attn._update_gather_batch
    finally:
        del sys.modules[holder.__name__]


@affected_only
def test_the_plugin_seam_goes_through_the_manager(restored):
    """The plugin's ``Scheduler.__init__`` seam is a change of the manager (public ``changes()``, patch_id None),
    made under its lock and put back by ``restore()``."""
    from sglang.srt.managers.scheduler import Scheduler

    original = Scheduler.__dict__["__init__"]
    restored.register()
    records = restored.get_manager().changes()
    seams = [r for r in records if r.patch_id is None]
    assert [(r.owner, r.attr, r.original) for r in seams] == [(Scheduler, "__init__", original)]
    assert Scheduler.__dict__["__init__"] is not original
    assert {r.patch_id for r in records} - {None} <= set(PATCH_IDS)
    restored.restore()
    assert Scheduler.__dict__["__init__"] is original and restored.get_manager().changes() == []


@affected_only
def test_outcomes_say_what_held_a_patch_back(restored):
    """A group member's own problem: its outcome is held back by its own check, its group's by it (``blocked_by``),
    and the other patches by the group (SGLang kept fully stock); an application that fails is rolled back."""
    from sglang_dp_mtp_fix.core import HeldBack
    from sglang_dp_mtp_fix.patches.draft_graph_vote import DraftGraphVote

    class Broken(DraftGraphVote):
        def check_imported(self) -> None:
            raise TargetProblem("drifted on purpose")

    patches = [Broken() if p.id == "draft_graph_vote" else p for p in all_patches()]
    outcomes = {o.id: o for o in plan(patches, Config()).outcomes}
    vote = outcomes["draft_graph_vote"]
    assert (vote.held_back, vote.blocked_by) == (HeldBack.OWN_CHECK, None)
    for pid in VOTE_GROUP:
        if pid != "draft_graph_vote":
            assert (outcomes[pid].held_back, outcomes[pid].blocked_by) == (HeldBack.GROUP_MEMBER, "draft_graph_vote")
    others = [o for o in outcomes.values() if o.id not in VOTE_GROUP and o.status is Status.UNSUPPORTED]
    # named as the reason names it: the first unsupported patch in order
    assert others and all((o.held_back, o.blocked_by) == (HeldBack.OTHER_PATCH, VOTE_GROUP[0]) for o in others)
    assert all(o.as_dict()["held_back"] == o.held_back.value for o in outcomes.values() if o.held_back)

    class Raising(DraftGraphVote):
        def replacements(self, resolved, config):
            raise RuntimeError("cannot build")

    patches = [Raising() if p.id == "draft_graph_vote" else p for p in all_patches()]
    before = _snapshot()
    manager = PatchManager(patches)
    rolled = [o for o in manager.apply(Config()) if o.status is Status.UNSUPPORTED]
    assert rolled and all(o.held_back is HeldBack.ROLLED_BACK for o in rolled)
    assert _snapshot() == before


@requires_sglang
def test_the_scheduler_seam_is_recorded_under_the_manager_lock(tmp_path, monkeypatch):
    """While a deferred patch is checked and applied from its post-import hook (under the manager's lock), the
    plugin's ``Scheduler.__init__`` seam waits for that transaction instead of changing the manager beside it."""
    import threading

    from sglang.srt.managers.scheduler import Scheduler

    from sglang_dp_mtp_fix import plugin, report
    from sglang_dp_mtp_fix.core import Patch

    inside, go = threading.Event(), threading.Event()
    module = "dp_mtp_fix_slow_probe_module"

    class Slow(Patch):
        id = "slow_probe"
        deferred_until_import = module

        def check_imported(self) -> None:
            inside.set()
            go.wait(30)
            raise TargetProblem("probe done")

    (tmp_path / f"{module}.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    original = Scheduler.__dict__["__init__"]
    manager, config = PatchManager([Slow()]), Config()
    outcomes = manager.apply(config)
    importer = threading.Thread(target=importlib.import_module, args=(module,))
    seam = threading.Thread(
        target=plugin._after_scheduler_init, args=(manager, outcomes, config, report.PendingLine(lambda: None))
    )
    importer.start()
    try:
        assert inside.wait(30)
        seam.start()
        seam.join(0.5)
        waited = seam.is_alive()
    finally:
        go.set()
        importer.join(30)
        if seam.is_alive() or seam.ident is not None:
            seam.join(30)
        manager.restore()
        sys.modules.pop(module, None)
    assert waited, "the seam was recorded while the manager's transaction held its lock"
    assert Scheduler.__dict__["__init__"] is original
