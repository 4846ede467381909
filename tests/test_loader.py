"""Loading through SGLang's own ``load_plugins()`` in pristine processes: selection, modes, skip lists, bad values,
strict stops, double load, and the report line.

Each case runs in a child forked from the pristine forkserver (``support.run_python``: SGLang's scheduler modules
imported, the plugin never loaded), as a scheduler process is when SGLang calls ``load_plugins()``. Fresh
interpreters only where import order is the subject: ``test_selected_by_sglang_plugins[fresh-interpreter]`` (the
plugin loaded before any scheduler module, as in the launcher process)."""

from __future__ import annotations

import pytest
from releases import SGLANG_VERSION
from support import VOTE_GROUP, expected_status, expected_statuses, last_json, requires_sglang, run_python

pytestmark = requires_sglang

PROBE = """
import json, logging, sys
{pre}
from sglang.srt.plugins import load_plugins
load_plugins()
{post}
from sglang.srt.managers.scheduler_components import dp_attn
loaded = "sglang_dp_mtp_fix.plugin" in sys.modules
out = {{"loaded": loaded, "patched": hasattr(dp_attn._update_gather_batch, "__sglang_dp_mtp_fix_patch__")}}
if loaded:
    from sglang_dp_mtp_fix import plugin
    m = plugin.get_manager()
    out["statuses"] = {{o.id: o.status.value for o in (m.outcomes or [])}}
    out["reasons"] = {{o.id: o.reason for o in (m.outcomes or [])}}
print(json.dumps(out))
"""


def probe(env: dict[str, str], pre: str = "", post: str = "", fresh: bool = False):
    proc = run_python(PROBE.format(pre=pre, post=post), env, fresh=fresh)
    return proc, (last_json(proc.stdout) if proc.returncode == 0 else None)


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh-interpreter", "after-scheduler-import"])
def test_selected_by_sglang_plugins(fresh):
    # fresh: a new interpreter where the plugin loads before any scheduler module (the launcher's import order);
    # otherwise a pristine child of the forkserver, where the scheduler's modules are imported first (a scheduler's).
    proc, out = probe({"SGLANG_PLUGINS": "dp_mtp_fix"}, fresh=fresh)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out["statuses"] == expected_statuses(dsa_imported=False)
    assert out["patched"] is (expected_status() == "applied")


def test_empty_sglang_plugins_loads_every_installed_plugin():
    proc, out = probe({"SGLANG_PLUGINS": ""})
    assert out["loaded"] and out["statuses"] == expected_statuses(dsa_imported=False)


def test_not_selected_is_never_imported():
    proc, out = probe({"SGLANG_PLUGINS": "some_other_plugin"})
    assert proc.returncode == 0 and out == {"loaded": False, "patched": False}


@pytest.mark.parametrize("value", ["off", "0", "false", "OFF"])
def test_kill_switch(value):
    proc, out = probe({"SGLANG_PLUGINS": "dp_mtp_fix", "SGLANG_DP_MTP_FIX": value})
    assert set(out["statuses"].values()) == {"disabled"} and out["patched"] is False


def test_skip_list_skips_the_group_and_says_so():
    proc, out = probe({"SGLANG_PLUGINS": "dp_mtp_fix", "SGLANG_DP_MTP_FIX_SKIP": "future_seed_authority"})
    if expected_status() != "applied":
        pytest.skip("nothing to skip on this release")
    assert {out["statuses"][pid] for pid in VOTE_GROUP} == {"disabled"} and out["patched"] is False
    assert "applies together or not at all" in out["reasons"]["draft_graph_vote"]


@pytest.mark.parametrize(
    ("var", "value"),
    [("SGLANG_DP_MTP_FIX", "yes-please"), ("SGLANG_DP_MTP_FIX_SKIP", "not_a_patch"), ("SGLANG_DP_MTP_FIX", "aütö")],
)
def test_bad_values_leave_sglang_stock_with_one_clear_line(var, value):
    proc, out = probe({"SGLANG_PLUGINS": "dp_mtp_fix", var: value})
    assert proc.returncode == 0
    assert out["patched"] is False and set(out["statuses"].values()) == {"unsupported"}
    lines = [line for line in proc.stderr.splitlines() if "SGLang left stock" in line]
    assert len(lines) == 1 and var in lines[0], proc.stderr[-2000:]


def test_strict_stops_on_bad_input_and_the_loader_cannot_swallow_it():
    proc, _ = probe({"SGLANG_PLUGINS": "dp_mtp_fix", "SGLANG_DP_MTP_FIX": "strict", "SGLANG_DP_MTP_FIX_SKIP": "x"})
    assert proc.returncode != 0
    assert "SGLANG_DP_MTP_FIX=strict: stopping" in proc.stderr and "SGLANG_DP_MTP_FIX_SKIP" in proc.stderr


def test_strict_stops_on_drifted_source():
    if expected_status() != "applied":
        pytest.skip("nothing is patched on this release")
    drift = (
        "from sglang.srt.managers.scheduler_components import dp_attn\n"
        "ns = {}\n"
        "exec(compile('def _update_gather_batch(*a, **k):\\n    return None\\n', dp_attn.__file__, 'exec'), ns)\n"
        "dp_attn._update_gather_batch = ns['_update_gather_batch']"
    )
    env = {"SGLANG_PLUGINS": "dp_mtp_fix", "SGLANG_DP_MTP_FIX": "strict"}
    proc, _ = probe(env, pre=drift)
    assert proc.returncode != 0 and "_update_gather_batch" in proc.stderr and "strict" in proc.stderr
    proc, out = probe({**env, "SGLANG_DP_MTP_FIX": "auto"}, pre=drift)
    assert proc.returncode == 0 and out["patched"] is False
    assert [line for line in proc.stderr.splitlines() if "SGLang left stock" in line]


def test_strict_on_a_healthy_install():
    proc, out = probe({"SGLANG_PLUGINS": "dp_mtp_fix", "SGLANG_DP_MTP_FIX": "strict"})
    assert proc.returncode == 0 and out["statuses"] == expected_statuses(dsa_imported=False)


def test_double_load_does_not_double_wrap():
    post = (
        "import sglang.srt.plugins as sp; sp._plugins_loaded = False; load_plugins()\n"
        "from sglang_dp_mtp_fix import plugin; plugin.register()\n"
        "from sglang.srt.managers.scheduler_components import dp_attn\n"
        "f = dp_attn._update_gather_batch\n"
        "orig = getattr(f, '__sglang_dp_mtp_fix_original__', f)\n"
        "assert not hasattr(orig, '__sglang_dp_mtp_fix_patch__'), 'wrapped twice'\n"
    )
    proc, out = probe({"SGLANG_PLUGINS": "dp_mtp_fix"}, post=post)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out["statuses"] == expected_statuses(dsa_imported=False)


def test_report_line_when_logging_is_configured():
    # force: the host's own configuration wins (in a pristine child SGLang's imports may already have set one up)
    pre = "logging.basicConfig(level=logging.INFO, format='%(message)s', force=True)"
    proc, _ = probe({"SGLANG_PLUGINS": "dp_mtp_fix"}, pre=pre)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("sglang-dp-mtp-fix ")]
    assert len(lines) == 1, proc.stderr[-2000:]
    assert f"on SGLang {SGLANG_VERSION}" in lines[0] and f"draft_graph_vote={expected_status()}" in lines[0]


# SGLang's configure_logger, as every release 0.5.15-0.5.23 does it (a rank prefix in scheduler processes).
CONFIGURE_LOGGER = (
    "logging.basicConfig(level=logging.INFO, format='[RANK-PREFIX] %(message)s', force=True)\n"
    "logging.getLogger('sglang_dp_mtp_fix').info('after configure')\n"
)


@pytest.mark.parametrize("mode", ["auto", "off", "strict"])
def test_report_line_is_held_until_sglang_configures_logging_whatever_the_mode(mode):
    # load_plugins() runs before SGLang configures logging (scheduler and launcher processes): the line must come out
    # once, through the logging SGLang sets up (its prefix), not be dropped as an early INFO line.
    proc, out = probe({"SGLANG_PLUGINS": "dp_mtp_fix", "SGLANG_DP_MTP_FIX": mode}, post=CONFIGURE_LOGGER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "sglang-dp-mtp-fix " in line]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("[RANK-PREFIX] sglang-dp-mtp-fix ") and f"(mode={mode})" in lines[0]
    assert proc.stderr.index(lines[0]) < proc.stderr.index("after configure")  # out right at configure time
    if mode == "off":
        assert "SGLANG_DP_MTP_FIX=off here, SGLang left fully stock" in lines[0]
    else:
        assert "SGLANG_DP_MTP_FIX=off" not in lines[0]


@pytest.mark.parametrize("where", ["before load_plugins", "after load_plugins"])
def test_a_logging_setup_that_would_drop_the_line_does_not_take_it(where):
    # 0.5.21+: configure_hf_hub_logger() runs a bare basicConfig (root at WARNING) before SGLang's configure_logger,
    # in some processes even before load_plugins() (seen on 0.5.23: no line at all from any process).
    bare = "logging.basicConfig(format='%(message)s')\n"
    pre, post = (bare, CONFIGURE_LOGGER) if where == "before load_plugins" else ("", bare + CONFIGURE_LOGGER)
    proc, _ = probe({"SGLANG_PLUGINS": "dp_mtp_fix"}, pre=pre, post=post)
    lines = [line for line in proc.stderr.splitlines() if "sglang-dp-mtp-fix " in line]
    assert len(lines) == 1 and lines[0].startswith("[RANK-PREFIX] "), proc.stderr[-3000:]


def test_a_second_logging_setup_does_not_repeat_the_line():
    post = CONFIGURE_LOGGER + CONFIGURE_LOGGER + "import logging.config\nlogging.config.dictConfig({'version': 1})\n"
    proc, _ = probe({"SGLANG_PLUGINS": "dp_mtp_fix"}, post=post)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len([line for line in proc.stderr.splitlines() if "sglang-dp-mtp-fix " in line]) == 1, proc.stderr[-3000:]


def test_seams_are_removed_by_restore():
    post = (
        "import logging.config\n"
        "held = logging.basicConfig, logging.config.dictConfig\n"
        "assert all(hasattr(f, '__sglang_dp_mtp_fix_seam__') for f in held), 'report seam missing'\n"
        "from sglang.srt.managers.scheduler import Scheduler\n"
        "init = Scheduler.__dict__['__init__']\n"
        f"assert hasattr(init, '__wrapped__') is {'applied' in expected_statuses().values()}, 'peer-check seam'\n"
        "from sglang_dp_mtp_fix import plugin; plugin.restore()\n"
        "assert logging.basicConfig is held[0].__wrapped__ and logging.config.dictConfig is held[1].__wrapped__\n"
        "assert Scheduler.__dict__['__init__'] is getattr(init, '__wrapped__', init)\n"
    )
    proc, _ = probe({"SGLANG_PLUGINS": "dp_mtp_fix"}, post=post)
    assert proc.returncode == 0, proc.stderr[-3000:]


HOOK_ON_SYNC = """
from sglang.srt.plugins.hook_registry import HookRegistry, HookType
CALLS = []
def around(original_fn, *args, **kwargs):
    CALLS.append(1)
    return original_fn(*args, **kwargs)
HookRegistry.register("sglang.srt.managers.scheduler_components.dp_attn._update_gather_batch", around, HookType.AROUND)
"""

CHAIN = """
from sglang.srt.managers.scheduler_components import dp_attn
from sglang.srt.managers.schedule_batch import ScheduleBatch
live = dp_attn._update_gather_batch
inner = getattr(live, "__wrapped__", None)
assert getattr(inner, "__sglang_dp_mtp_fix_patch__", None) == "draft_token_counts", "ours must sit under the hook"
class Info: pass
info = Info(); info.num_tokens = 1; info.num_tokens_for_logprob = 1
for name in ("can_cuda_graph", "can_run_decode_cuda_graph", "can_run_breakable_cuda_graph",
             "can_run_prefill_cuda_graph", "prefill_cuda_graph_max_prefix_len", "is_extend_in_batch",
             "tbo_split_seq_index", "global_forward_mode"):
    setattr(info, name, 0)
batch = ScheduleBatch(reqs=[])
live(batch, info, False)
assert CALLS == [1] and batch.can_run_dp_draft_cuda_graph is True  # both layers ran
from sglang_dp_mtp_fix import plugin
plugin.restore()
assert dp_attn._update_gather_batch is live, "restore must not clobber another plugin's hook"
"""


def test_hook_registry_hooks_from_another_plugin_wrap_ours_and_survive_restore():
    if expected_status() != "applied":
        pytest.skip("nothing is patched on this release")
    proc, out = probe({"SGLANG_PLUGINS": "dp_mtp_fix"}, pre=HOOK_ON_SYNC, post=CHAIN)
    assert proc.returncode == 0, proc.stderr[-3000:]  # CHAIN asserts the layering, both calls and the restore
    assert "not restored because another hook wraps them now" in proc.stderr


@pytest.mark.parametrize("mode", ["auto", "strict"])
def test_a_misspelt_variable_is_one_line_at_load_and_strict_stops(mode):
    """Before: ``SGLANG_DP_MTP_FIX_MODE=off`` (the kill switch is ``SGLANG_DP_MTP_FIX=off``) was ignored in silence."""
    env = {"SGLANG_PLUGINS": "dp_mtp_fix", "SGLANG_DP_MTP_FIX": mode, "SGLANG_DP_MTP_FIX_MODE": "off"}
    proc, out = probe(env)
    lines = [line for line in proc.stderr.splitlines() if "SGLANG_DP_MTP_FIX_MODE" in line]
    assert len(lines) == 1 and "did you mean SGLANG_DP_MTP_FIX?" in lines[0], proc.stderr[-2000:]
    if mode == "strict":
        assert proc.returncode != 0 and "SGLANG_DP_MTP_FIX=strict: stopping" in lines[0], proc.stderr[-2000:]
    else:
        # auto: the rest applies as read (the patches as without the unknown name)
        assert proc.returncode == 0 and out["patched"] is (expected_status() == "applied"), proc.stderr[-2000:]
