"""The patching core against the real installed SGLang: check-all-then-apply, verification, restore by identity,
``from X import Y`` copies, idempotence, groups (faults per target: ``test_faults.py``)."""

from __future__ import annotations

import importlib
import sys

import pytest
from conftest import SGLANG_VERSION, affected_only, expected_status, requires_sglang

from sglang_dp_mtp_fix import fingerprint as fp
from sglang_dp_mtp_fix.config import Config, Mode
from sglang_dp_mtp_fix.core import MARKER, Kind, PatchManager, Status, Target, groups
from sglang_dp_mtp_fix.patches import PATCH_IDS, all_patches

pytestmark = requires_sglang


def _live(target: Target):
    owner = importlib.import_module(target.module)
    parts = target.qualname.split(".") + ([target.attr] if target.kind is Kind.ADD else [])
    for part in parts[:-1]:
        owner = getattr(owner, part)
    return owner, parts[-1]


def _snapshot():
    """Identity of every target attribute (what 'fully stock' means)."""
    snap = {}
    for patch in all_patches():
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
    assert [[p.id for p in g] for g in groups(all_patches())] == [list(PATCH_IDS)]


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
            if owner is None or not hasattr(owner, attr):
                assert SGLANG_VERSION in data["absent"].get(t.name, []), t.name
                continue
            got = fp.fingerprint_object(owner.__dict__.get(attr, getattr(owner, attr)))
            assert SGLANG_VERSION in data["targets"][t.name][got], (t.name, got)


def test_plan_changes_nothing():
    before = _snapshot()
    outcomes, _ = PatchManager(all_patches()).plan(Config())
    assert {o.status.value for o in outcomes} == {expected_status()}
    assert _snapshot() == before


@affected_only
def test_apply_verify_restore_by_identity(restored):
    before = _snapshot()
    outcomes = restored.register()
    assert [o.status for o in outcomes] == [Status.APPLIED] * 3, outcomes
    after = _snapshot()
    changed = {k for k in before if before[k] is not after[k]}
    assert changed == set(before), "every WRAP/ADD target must be live"
    for name, value in after.items():
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
    original = dp_attn.prepare_mlp_sync_batch_raw
    copy_holder = type(sys)("sglang._dp_mtp_fix_test_copy")  # an SGLang-namespace module holding a from-import copy
    copy_holder.prepare_mlp_sync_batch_raw = original
    sys.modules[copy_holder.__name__] = copy_holder
    try:
        restored.register()
        assert copy_holder.prepare_mlp_sync_batch_raw is dp_attn.prepare_mlp_sync_batch_raw is not original
        restored.restore()
        assert copy_holder.prepare_mlp_sync_batch_raw is original and dp_attn.prepare_mlp_sync_batch_raw is original
    finally:
        del sys.modules[copy_holder.__name__]


@affected_only
@pytest.mark.parametrize("skip", PATCH_IDS)
def test_skipping_any_member_skips_the_whole_group(skip):
    before = _snapshot()
    manager = PatchManager(all_patches())
    outcomes = manager.apply(Config(skip=frozenset({skip})))
    assert all(o.status is Status.DISABLED for o in outcomes)
    assert all("applies together or not at all" in o.reason for o in outcomes)
    assert _snapshot() == before


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
