"""Fixtures of the launch tier (helpers and the why: ``tools/launchlib.py``); launches are shared by a module's
scenarios. The tier's wall times are printed at the end of the run."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import soaklib
from launchlib import gaps_pythonpath
from releases import PROBE, SGLANG_VERSION, runs_on

_TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="session")
def gaps_path(tmp_path_factory) -> str:
    """PYTHONPATH entries for the two stand-ins (``launchlib.gaps_pythonpath``)."""
    return gaps_pythonpath(tmp_path_factory.mktemp("launch-entry-points"))


@pytest.fixture(scope="session")
def launch_timings():
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    yield timings
    if timings:
        timings["tier_total"] = round(time.monotonic() - t0, 1)
        _TIMINGS.update(timings)


@pytest.fixture(scope="session")
def launch_tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("launch")


@pytest.fixture(scope="session")
def probe_path(gaps_path, tmp_path_factory) -> str:
    """The tier's stand-ins plus the vote probe (``soaklib.probe_pythonpath``)."""
    return soaklib.probe_pythonpath(gaps_path, tmp_path_factory.mktemp("vote-probe") / "entry-point")


@pytest.fixture(scope="session")
def probe_off(probe_path, launch_tmp, launch_timings):
    """One plugin-off launch (``SGLANG_DP_MTP_FIX=off``) with the vote probe, --enable-metrics, report files and the
    stats lines asked for: c's control (``test_vote_probe.py``), e and the metrics' plugin-off half
    (``test_launch.py``) read it; it is stopped before any of them asserts."""
    from probe_launch import probe_launch

    if SGLANG_VERSION not in PROBE:
        pytest.skip(f"the plugin-off probe launch (c's control, e) {runs_on(PROBE)}")
    return probe_launch("c-off", launch_tmp, probe_path, launch_timings, shared=True, SGLANG_DP_MTP_FIX="off")


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if _TIMINGS:
        terminalreporter.write_line(f"launch tier timings on SGLang {SGLANG_VERSION} (s): {json.dumps(_TIMINGS)}")
