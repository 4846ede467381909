"""Shared fixtures. Every test here runs against the REAL, unmodified SGLang release installed in this venv
(``tools/mkvenv.sh`` builds one venv per release; ``tools/test-matrix.sh`` runs this suite in each)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import pytest

AFFECTED = ("0.5.15.post1", "0.5.16", "0.5.17", "0.5.18", "0.5.19", "0.5.20")
SUPERSEDED = ("0.5.21", "0.5.22", "0.5.23")
NOT_AFFECTED = ("0.5.14", "0.5.15")

try:
    SGLANG_VERSION = version("sglang")
except PackageNotFoundError:  # pure-Python tests (config) still run
    SGLANG_VERSION = None

requires_sglang = pytest.mark.skipif(SGLANG_VERSION is None, reason="SGLang is not installed in this venv")
affected_only = pytest.mark.skipif(SGLANG_VERSION not in AFFECTED, reason=f"SGLang {SGLANG_VERSION} is not patched")


def expected_status() -> str:
    if SGLANG_VERSION in AFFECTED:
        return "applied"
    if SGLANG_VERSION in SUPERSEDED:
        return "superseded"
    return "not-affected"


VOTE_GROUP = ("future_seed_authority", "eager_draft_gate", "draft_graph_vote", "draft_token_counts")
LOCAL_ROWS_AFFECTED = ("0.5.16", "0.5.17", "0.5.18")  # idle ranks run the full eager draft loop + topk1 assert


# Applied when their module is imported (post-import hook).
DEFERRED = ("dsa_idle_index", "dsa_trtllm_trim", "dsa_decode_trim")
DSA_MODULES = ("sglang.srt.layers.attention.dsa_backend", "sglang.srt.layers.attention.dsa.dsa_indexer")
# draft_local_rows is deferred too, until the scheduler imports model_runner to build its ModelRunner.
MODEL_RUNNER = "sglang.srt.model_executor.model_runner"


def expected_statuses(dsa_imported: bool = True, model_runner_imported: bool | None = None) -> dict[str, str]:
    """Per patch id, the outcome on this release (docs/compatibility.md).

    ``dsa_imported``: the DSA modules were imported in that process (as in every scheduler that loads a model:
    SGLang's model registry imports them; this test session imports them at start, see below). In a fresh process
    that has not imported them, an affected release reports the DSA patches ``not-loaded``. ``model_runner_imported``
    (default: same as ``dsa_imported``): likewise for ``draft_local_rows`` where it applies (0.5.16-0.5.18)."""
    from sglang_dp_mtp_fix.patches import PATCH_IDS

    group = expected_status()
    per_patch = {pid: group for pid in PATCH_IDS}
    per_patch["draft_local_rows"] = "applied" if SGLANG_VERSION in LOCAL_ROWS_AFFECTED else "not-affected"
    if not dsa_imported and group == "applied":
        per_patch.update({pid: "not-loaded" for pid in DEFERRED})
    runner_imported = dsa_imported if model_runner_imported is None else model_runner_imported
    if not runner_imported and per_patch["draft_local_rows"] == "applied":
        per_patch["draft_local_rows"] = "not-loaded"
    return {pid: per_patch[pid] for pid in PATCH_IDS}


def _import_dsa_modules() -> None:
    """The in-process tests run in the state of a scheduler after model import: SGLang's model registry imports the
    DSA modules in every scheduler that loads a model, and the scheduler imports model_runner to build its
    ModelRunner, so the deferred patches apply at register() like the others. Fresh-process tests (run_python)
    start without them and check the not-loaded / post-import path."""
    import importlib

    for name in (*DSA_MODULES, MODEL_RUNNER):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a release whose DSA code cannot load on CPU: the patches stay not-loaded
            pass


def pytest_configure(config: pytest.Config) -> None:
    # Here, not at import: fresh-process tests import test modules (and so this file) and must start without them.
    if SGLANG_VERSION is not None:
        _import_dsa_modules()


def pytest_report_header(config: pytest.Config) -> str:
    return f"sglang under test: {SGLANG_VERSION} (expected plugin outcome: {expected_status()})"


@pytest.fixture()
def restored():
    """Run a test with the plugin applied in-process, and always put SGLang back to stock afterwards."""
    from sglang_dp_mtp_fix import plugin

    plugin.restore()
    yield plugin
    plugin.restore()


def run_python(
    code: str,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    fresh: bool = False,
    drop_prefixes: tuple[str, ...] = ("SGLANG_DP_MTP_FIX", "SGLANG_PLUGINS"),
) -> subprocess.CompletedProcess:
    """Run ``code`` as ``python -c`` in a pristine process of this venv: this test process's environment without the
    plugin's variables (or whatever ``drop_prefixes`` names), plus ``env``.

    Default: a child forked from the pristine forkserver (SGLang's scheduler modules imported, as in a scheduler
    process when SGLang calls ``load_plugins()``; the plugin not loaded), so each case does not pay SGLang's import.
    ``fresh=True``: a new interpreter, for the cases whose subject is import order itself (the plugin loaded before
    any scheduler module, as in the launcher process)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(drop_prefixes)}
    full_env.update(env or {})
    cwd = os.path.dirname(__file__)
    if fresh:
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            env=full_env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
        )
    return _run_forked(textwrap.dedent(code), full_env, cwd, timeout)


def run_cli(args: list[str], env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """The console script's ``main(args)`` in a pristine forked process, with every ``SGLANG_*`` variable of this
    process dropped (as an operator's clean shell would have them): the same code path as the installed script."""
    code = f"import sys\nfrom sglang_dp_mtp_fix.cli import main\nsys.exit(main({list(args)!r}))\n"
    return run_python(code, env, timeout=timeout, drop_prefixes=("SGLANG_", "DP_MTP_FIX_TEST"))


def _run_forked(code: str, env: dict[str, str], cwd: str, timeout: float) -> subprocess.CompletedProcess:
    import tempfile

    import pristine

    from sglang_dp_mtp_fix.harness.pool import pristine_context

    with tempfile.TemporaryDirectory(prefix="pristine-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        child = pristine_context().Process(target=pristine.run_code, args=(code, env, cwd, out, err))
        child.start()
        child.join(timeout)
        if child.is_alive():
            child.kill()
            child.join(30)
            raise subprocess.TimeoutExpired(["<pristine child>", "-c", code], timeout)
        with open(out) as f_out, open(err) as f_err:
            stdout, stderr = f_out.read(), f_err.read()
    return subprocess.CompletedProcess(["<pristine child>", "-c", code], child.exitcode, stdout, stderr)


def last_json(stdout: str) -> dict:
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"no JSON line in output:\n{stdout}")


@pytest.fixture(scope="session")
def rank_pool():
    """Four gloo ranks running the real SGLang, started once; the plugin is loaded through SGLang's own
    ``load_plugins()`` with ``SGLANG_PLUGINS=dp_mtp_fix``. Tests switch arms with ``pool.plugin('apply'|'restore')``."""
    if SGLANG_VERSION is None:
        pytest.skip("SGLang is not installed")
    from sglang_dp_mtp_fix.harness.pool import RankPool

    pool = RankPool(4, load_plugins=True, env={"SGLANG_PLUGINS": "dp_mtp_fix"})
    yield pool
    pool.close()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Count and list the fault-injection cases (tests/test_faults.py), so every run shows what was covered."""
    launch_fixtures = sys.modules.get("launch_fixtures")  # the launch tier's wall times (tests/launch)
    line = launch_fixtures.timings_line() if launch_fixtures is not None else None
    if line:
        terminalreporter.write_line(line)
    stats = terminalreporter.stats
    in_faults = [r for k in ("passed", "failed", "skipped") for r in stats.get(k, []) if "test_faults.py" in r.nodeid]
    if not in_faults:
        return
    covered = sorted(v for r in stats.get("passed", []) for k, v in r.user_properties if k == "fault_injection")
    failed = sorted({r.nodeid.split("[", 1)[-1].rstrip("]") for r in stats.get("failed", []) if r in in_faults})
    not_applicable = sum(1 for r in stats.get("skipped", []) if r in in_faults)
    write = terminalreporter.write_line
    terminalreporter.section("fault injection", sep="-")
    if failed:
        write(f"fault injection (SGLang {SGLANG_VERSION}): {len(failed)} fault x target cases did NOT pass: {failed}")
    elif not covered:
        write(f"fault injection (SGLang {SGLANG_VERSION}): no case ran (nothing is patched on this release)")
    else:
        write(
            f"fault injection (SGLang {SGLANG_VERSION}): {len(covered)} faults x targets, all left SGLang stock "
            "(auto: one warning; strict: StrictModeAbort; doctor --json names it)"
        )
    write(f"  {not_applicable} combinations not applicable or absent in this release (reasons: pytest -rs)")
    for line in covered:
        write(f"  {line}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """``tools/test-matrix.sh`` asks each release's session for that release's ``doctor --json``
    (``DP_MTP_FIX_TEST_DOCTOR_OUT``): ``tools/compat_table.py`` builds the compatibility table
    (docs/compatibility.md) from them."""
    out = os.environ.get("DP_MTP_FIX_TEST_DOCTOR_OUT")
    if not out or SGLANG_VERSION is None:
        return
    proc = run_cli(["doctor", "--json"])
    if proc.returncode in (0, 1) and proc.stdout.lstrip().startswith("{"):
        with open(out, "w") as f:
            f.write(proc.stdout)
    else:
        print(f"\ndoctor --json failed (rc={proc.returncode}); {out} not written:\n{proc.stderr[-2000:]}")
