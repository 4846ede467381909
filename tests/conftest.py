"""The suite's fixtures and hooks (what test modules import lives in ``support``; the release lists in ``releases``)."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
from releases import SGLANG_VERSION
from support import DSA_MODULES, MODEL_RUNNER, expected_status

pytest_plugins = ["fault_summary"]


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


_SESSION_PID = os.getpid()


def _interrupt_on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM (.ci/run's whole-run limit) ends the session like Ctrl-C: fixtures tear down, so the servers and rank
    processes the tests started are stopped. A process forked from this one keeps the default action."""
    if os.getpid() != _SESSION_PID:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise KeyboardInterrupt(f"signal {signum} (SIGTERM)")


def pytest_configure(config: pytest.Config) -> None:
    signal.signal(signal.SIGTERM, _interrupt_on_sigterm)
    # The session's state, not an import side effect: pristine processes start without these modules.
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
