"""Deferred patches (the DSA patches, and draft_local_rows until model_runner): applied by a post-import hook when
SGLang imports their module, never imported by the plugin. Fresh processes (``run_python``): each starts without the
DSA modules and model_runner, the state of a scheduler process at ``load_plugins()``.

- import audit: loading the plugin in a warm EAGLE scheduler process imports no DSA module (nor does the cross-rank
  state or the report line); the DSA patches say ``not-loaded``;
- the hook: SGLang's own model registry (what every scheduler imports when it loads a model) imports the DSA modules;
  the patches are then checked and applied, and the report line held until ``Scheduler.__init__`` says so;
- a problem found when the hook fires: auto leaves that patch stock (by identity) with one WARNING line and SGLang's
  model import intact; strict stops the process from inside SGLang's model import (its ``except Exception`` cannot
  swallow ``StrictModeAbort``);
- fault injection over the hook path: every fault of ``test_faults`` on the wrapped target of each deferred patch,
  made by a post-import hook registered before the plugin's (so it is in place when the plugin's hook checks).
The ``importhook`` finder itself is tested in-process on a throw-away package (no SGLang needed).
"""

from __future__ import annotations

import sys

import pytest
from releases import AFFECTED, LOCAL_ROWS_AFFECTED, SGLANG_VERSION
from support import (
    DEFERRED,
    DSA_MODULES,
    MODEL_RUNNER,
    affected_only,
    expected_status,
    expected_statuses,
    last_json,
    requires_sglang,
    run_python,
)

from sglang_dp_mtp_fix import importhook

DSA_INDEXER, DSA_BACKEND = "sglang.srt.layers.attention.dsa.dsa_indexer", "sglang.srt.layers.attention.dsa_backend"
WARM = "import sglang.srt.managers.scheduler, sglang.srt.speculative.eagle_worker_v2, " \
    "sglang.srt.speculative.eagle_draft_cuda_graph_runner"  # fmt: skip


# -- the finder ------------------------------------------------------------------------------------------------------
@pytest.fixture()
def package(tmp_path, monkeypatch):
    """A throw-away package ``hookpkg`` with modules ``good`` and ``broken`` (raises on import). Yields
    ``when_imported``, which registers a hook and cancels it at teardown if it has not run."""
    root = tmp_path / "hookpkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "good.py").write_text("VALUE = 41\nVALUE += 1\n")
    (root / "broken.py").write_text("raise ImportError('broken on purpose')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registered: list[importhook.Hook] = []

    def when_imported(name: str, hook: importhook.Hook) -> importhook.Hook:
        registered.append(hook)
        importhook.when_imported(name, hook)
        return hook

    yield when_imported
    for name in [m for m in sys.modules if m.startswith("hookpkg")]:
        del sys.modules[name]
    for hook in registered:
        importhook.cancel(hook)


def test_hook_runs_once_after_the_module_body_and_the_finder_leaves(package):
    seen = []
    package("hookpkg.good", lambda module: seen.append(module.VALUE))
    assert importhook.finder_installed() and importhook.waiting() == {"hookpkg.good": 1}
    assert not importhook.is_imported("hookpkg.good")
    import hookpkg.good

    assert seen == [42]  # after the whole body ran
    assert importhook.is_imported("hookpkg.good") and not importhook.finder_installed() and importhook.waiting() == {}
    import inspect

    assert "VALUE += 1" in inspect.getsource(hookpkg.good)


def test_the_imported_module_keeps_its_real_loader(package):
    """As if imported without the hook: ``__loader__`` and ``__spec__.loader`` are the real loader, not ours."""
    import importlib.machinery

    loaders = []
    package("hookpkg.good", lambda module: loaders.extend([module.__loader__, module.__spec__.loader]))
    import hookpkg.good

    for loader in (hookpkg.good.__loader__, hookpkg.good.__spec__.loader, *loaders):
        assert type(loader) is importlib.machinery.SourceFileLoader


def test_a_failed_import_runs_no_hook_and_a_cancelled_hook_never_runs(package):
    seen = []
    broken_hook = package("hookpkg.broken", lambda module: seen.append("broken"))
    with pytest.raises(ImportError, match="broken on purpose"):
        import hookpkg.broken  # noqa: F401
    assert seen == [] and importhook.waiting() == {"hookpkg.broken": 1}  # still waiting (no module was made)

    def hook(module):
        seen.append("good")

    package("hookpkg.good", hook)
    importhook.cancel(hook)
    importhook.cancel(hook)  # a second cancel is a no-op
    assert importhook.finder_installed()  # the broken module's hook still waits
    importhook.cancel(broken_hook)  # the last one gone: the finder leaves sys.meta_path
    import hookpkg.good  # noqa: F401

    assert seen == [] and not importhook.finder_installed()


def test_an_exception_in_a_hook_fails_the_import_statement(package):
    class Stop(SystemExit):
        pass

    def hook(module):
        raise Stop("stop from the hook")

    package("hookpkg.good", hook)
    with pytest.raises(Stop, match="stop from the hook"):
        import hookpkg.good  # noqa: F401
    assert "hookpkg.good" not in sys.modules  # the import failed as a whole


# -- the plugin, fresh processes ---------------------------------------------------------------------------------------
AUDIT = """
import json, logging, sys
{warm}
def dsa():
    return sorted(m for m in sys.modules if m.startswith("sglang.") and ("dsa" in m.rsplit(".", 1)[-1] or ".dsa." in m))
before = dsa()
runner_before = {model_runner!r} in sys.modules
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang_dp_mtp_fix import importhook, plugin, report
manager = plugin.get_manager()
state = manager.peer_fingerprints()  # what the cross-rank check publishes
logging.basicConfig(level=logging.INFO)
report.emit(manager.outcomes, plugin.last_config)
print(json.dumps({{"before": before, "after": dsa(), "statuses": {{o.id: o.status.value for o in manager.outcomes}},
                  "pending": importhook.waiting(), "state": sorted(state),
                  "runner": [runner_before, {model_runner!r} in sys.modules]}}))
"""


@requires_sglang
def test_loading_the_plugin_imports_no_dsa_module_nor_model_runner():
    """The import audit: a warm EAGLE scheduler process that loads the plugin (and publishes its cross-rank state and
    report line) has imported no DSA module beyond what SGLang's own imports brought, and not model_runner."""
    proc = run_python(AUDIT.format(warm=WARM, model_runner=MODEL_RUNNER), {"SGLANG_PLUGINS": "dp_mtp_fix"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = last_json(proc.stdout)
    assert out["after"] == out["before"], sorted(set(out["after"]) - set(out["before"]))
    assert not set(DSA_MODULES) & set(out["after"])
    # ... nor model_runner (draft_local_rows' premises live there; the scheduler imports it after load_plugins()).
    assert out["runner"] == [False, False]
    assert out["statuses"] == expected_statuses(dsa_imported=False)
    pending = {}
    if expected_statuses(dsa_imported=False)["dsa_idle_index"] == "not-loaded":
        pending.update({DSA_INDEXER: 1, DSA_BACKEND: 2})  # dsa_trtllm_trim, dsa_decode_trim
        assert f"source of {DSA_INDEXER}" in out["state"] and f"source of {DSA_BACKEND}" in out["state"]
    if expected_statuses(dsa_imported=False)["draft_local_rows"] == "not-loaded":
        pending[MODEL_RUNNER] = 1
        assert f"source of {MODEL_RUNNER}" in out["state"]
    assert out["pending"] == pending


HOOK = """
import json, logging, sys
from sglang.srt.managers.scheduler import Scheduler
def scheduler_init_standin(self, *args, **kwargs):  # STAND-IN: the real body loads a model on a GPU
    pass
Scheduler.__init__ = scheduler_init_standin
from sglang.srt.plugins import load_plugins
load_plugins()  # logging not configured yet (as in a scheduler process): the report line is held
from sglang_dp_mtp_fix import plugin
loaded = {o.id: o.status.value for o in plugin.get_manager().outcomes}
import sglang.srt.models.registry  # SGLang's model registry: imports every model module, hence the DSA modules
from sglang.srt.models import deepseek_v2
from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer
from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend as B
marks = [getattr(f, "__sglang_dp_mtp_fix_patch__", None)
         for f in (Indexer.forward_cuda, deepseek_v2.Indexer.forward_cuda, B._forward_trtllm, B.forward_decode)]
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
Scheduler.__init__(Scheduler.__new__(Scheduler))  # the seam emits the held line (and would run the peer check)
manager = plugin.get_manager()
after = {o.id: o.status.value for o in manager.outcomes}
fps = sorted(manager.fingerprints)
plugin.restore()
stock = [getattr(f, "__sglang_dp_mtp_fix_patch__", None) for f in (Indexer.forward_cuda, B._forward_trtllm,
                                                                   B.forward_decode)]
print(json.dumps({"loaded": loaded, "after": after, "marks": marks, "stock": stock, "fps": fps}))
"""


@affected_only
def test_sglangs_model_import_fires_the_hooks_and_the_held_report_line_says_applied():
    proc = run_python(HOOK, {"SGLANG_PLUGINS": "dp_mtp_fix"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = last_json(proc.stdout)
    assert out["loaded"] == expected_statuses(dsa_imported=False)
    assert out["after"] == expected_statuses()
    # also through a from-import copy
    assert out["marks"] == ["dsa_idle_index", "dsa_idle_index", "dsa_trtllm_trim", "dsa_decode_trim"]
    assert out["stock"] == [None, None, None]
    assert f"{DSA_INDEXER}:Indexer.forward_cuda" in out["fps"] and f"{DSA_BACKEND}:" \
        "DeepseekSparseAttnBackend._forward_trtllm" in out["fps"]  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.startswith("INFO sglang_dp_mtp_fix sglang-dp-mtp-fix ")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert all(f"{pid}=applied" in lines[0] for pid in ("dsa_idle_index", "dsa_trtllm_trim", "dsa_decode_trim")), lines


FOREIGN_HOOK_ON_INDEXER = """
import functools
from sglang_dp_mtp_fix import importhook
def another_plugin(module):  # fault injection: another plugin wraps Indexer.forward_cuda when the module loads
    original = module.Indexer.forward_cuda
    @functools.wraps(original)
    def forward_cuda(*args, **kwargs):
        return original(*args, **kwargs)
    module.Indexer.forward_cuda = forward_cuda
importhook.when_imported("sglang.srt.layers.attention.dsa.dsa_indexer", another_plugin)  # runs before ours
"""
AFTER_MODEL_IMPORT = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
from sglang.srt.plugins import load_plugins
load_plugins()
import sglang.srt.models.registry
print("REACHED after the model import", flush=True)
from sglang_dp_mtp_fix import plugin
from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer
print(json.dumps({"statuses": {o.id: o.status.value for o in plugin.get_manager().outcomes},
                  "foreign": Indexer.forward_cuda.__code__.co_filename == "<string>",
                  "backend_imported": "sglang.srt.layers.attention.dsa_backend" in sys.modules,
                  "deepseek_v2": "sglang.srt.models.deepseek_v2" in sys.modules}))
"""


@affected_only
def test_a_problem_at_the_hook_leaves_that_patch_stock_with_one_warning_and_the_model_import_intact():
    proc = run_python(FOREIGN_HOOK_ON_INDEXER + AFTER_MODEL_IMPORT, {"SGLANG_PLUGINS": "dp_mtp_fix"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = last_json(proc.stdout)
    # dsa_backend: imported by the registry on 0.5.16+ (forward_mla); on 0.5.15.post1 only when a DSA backend is built
    backend = expected_statuses(dsa_imported=out["backend_imported"])["dsa_trtllm_trim"]
    assert out["statuses"] == {
        **expected_statuses(), "dsa_idle_index": "unsupported", "dsa_trtllm_trim": backend, "dsa_decode_trim": backend,
    }  # fmt: skip
    assert out["foreign"] and out["deepseek_v2"]  # the other plugin's wrapper stays; SGLang's model import completed
    ours = [line for line in proc.stderr.splitlines() if line.startswith("WARNING sglang_dp_mtp_fix")]
    assert len(ours) == 1 and "dsa_idle_index left stock when" in ours[0] and "another hook" in ours[0], ours
    assert "Ignore import error when loading sglang.srt.models.deepseek_v2" not in proc.stderr


@affected_only
def test_strict_stops_the_process_from_inside_sglangs_model_import():
    """StrictModeAbort raised by the hook is a SystemExit: SGLang's registry (``except Exception`` around each model
    import) cannot swallow it, so the process stops there (a scheduler process exits, and its launch with it)."""
    env = {"SGLANG_PLUGINS": "dp_mtp_fix", "SGLANG_DP_MTP_FIX": "strict"}
    proc = run_python(FOREIGN_HOOK_ON_INDEXER + AFTER_MODEL_IMPORT, env)
    assert proc.returncode != 0 and "REACHED" not in proc.stdout, proc.stdout[-2000:]
    assert "dsa_idle_index left stock when" in proc.stderr and "strict: stopping" in proc.stderr, proc.stderr[-3000:]
    assert "Ignore import error when loading sglang.srt.models.deepseek_v2" not in proc.stderr


def _deferred_here() -> set[str]:
    """The deferred patches that apply on this release (read from the patches, checked below against the list)."""
    from sglang_dp_mtp_fix.patches import all_patches

    return {p.id for p in all_patches() if p.deferred_until_import and expected_statuses()[p.id] == "applied"}


DEFERRED_HERE = _deferred_here() if SGLANG_VERSION else set()


def _hook_fault_cases() -> list:
    from test_faults import FAULTS, TWINS, not_applicable, twin_elsewhere

    from sglang_dp_mtp_fix.core import Kind
    from sglang_dp_mtp_fix.patches import all_patches

    cases = []
    for patch in all_patches():
        if patch.id not in DEFERRED_HERE:
            continue
        for target in patch.targets:
            if target.kind is not Kind.WRAP:  # CHECK targets: in-process test_faults, through the same checks
                continue
            for fault in FAULTS:  # a twin where test_faults runs it (its code path is its partner's, run here)
                if not_applicable(target, fault) is None and not (fault in TWINS and twin_elsewhere(target)):
                    cases.append(pytest.param(patch.id, target.name, fault, id=f"{fault}-{target.name}"))
    if not cases and SGLANG_VERSION not in AFFECTED:  # nothing is deferred where the plugin stands down; an affected
        # release with no case still fails at collection (pyproject's empty_parameter_set_mark)
        return [pytest.param(None, None, None, id="none", marks=pytest.mark.skip(reason="no deferred patch here"))]
    return cases


HOOK_FAULT = """
import json, logging, sys
import pytest
import test_faults
from sglang_dp_mtp_fix import importhook, plugin
from sglang_dp_mtp_fix.patches import all_patches
patch = next(p for p in all_patches() if p.id == {pid!r})
target = next(t for t in patch.targets if t.name == {name!r})
mp, made = pytest.MonkeyPatch(), {{}}
def fault(module):  # registered before the plugin's hook: the fault is there when the plugin checks
    made["needle"] = test_faults.inject(patch.id, target, {fault!r}, mp)
    made["value"] = test_faults._target_value(target)
importhook.when_imported(patch.deferred_until_import, fault)
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
plugin.register()
import importlib
importlib.import_module(patch.deferred_until_import)
outcomes = plugin.get_manager().outcomes
value = test_faults._target_value(target)
print(json.dumps({{"statuses": {{o.id: o.status.value for o in outcomes}},
                  "reason": next(o.reason for o in outcomes if o.id == patch.id), "needle": made["needle"],
                  "stock": value is made["value"] or value == made["value"],
                  "marked": test_faults._marked_objects(patch.id)}}))
"""


@affected_only
@pytest.mark.parametrize(("patch_id", "name", "fault"), _hook_fault_cases())
def test_fault_at_the_hook_leaves_that_patch_stock(patch_id, name, fault):
    proc = run_python(HOOK_FAULT.format(pid=patch_id, name=name, fault=fault), {"SGLANG_DP_MTP_FIX": "auto"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = last_json(proc.stdout)
    expected = expected_statuses(dsa_imported=False)
    for other in DEFERRED_HERE - {patch_id}:  # importing one deferred module may import another (indexer, backend)
        assert out["statuses"].pop(other) in ("not-loaded", "applied")
        expected.pop(other)
    assert out["statuses"] == {**expected, patch_id: "unsupported"}
    assert out["needle"] in out["reason"], out
    assert out["stock"] and out["marked"] == [], out
    ours = [line for line in proc.stderr.splitlines() if line.startswith("WARNING sglang_dp_mtp_fix")]
    assert len(ours) == 1 and f"{patch_id} left stock when" in ours[0], ours


def test_hook_fault_cases_cover_every_deferred_patch_applied_here():
    assert {case.values[0] for case in _hook_fault_cases() if case.values[0] is not None} == DEFERRED_HERE
    # Affected releases: both DSA patches; 0.5.16-0.5.18 also draft_local_rows. Elsewhere nothing is deferred.
    want = set(DEFERRED) | ({"draft_local_rows"} if SGLANG_VERSION in LOCAL_ROWS_AFFECTED else set())
    assert DEFERRED_HERE == (want if expected_status() == "applied" else set())
