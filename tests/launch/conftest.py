"""Fixtures of the launch tier (helpers and the why: ``launchlib``); launches are shared by a module's scenarios."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from launchlib import HERE, SGLANG_VERSION


@pytest.fixture(scope="session")
def gaps_path(tmp_path_factory) -> str:
    """PYTHONPATH entries for the two stand-ins; the helper plugin's entry point lives in a temp dist-info."""
    ep = tmp_path_factory.mktemp("launch-entry-points")
    info = ep / "launch_cpu_gaps-0.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: launch-cpu-gaps\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text("[sglang.srt.plugins]\nlaunch_cpu_gaps = launch_cpu_gaps:register\n")
    return os.pathsep.join([str(HERE / "stubs"), str(HERE / "cpu_gaps"), str(ep)])


@pytest.fixture(scope="session")
def launch_timings():
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    yield timings
    if timings:
        timings["tier_total"] = round(time.monotonic() - t0, 1)
        _TIMINGS.update(timings)


_TIMINGS: dict[str, float] = {}


def pytest_terminal_summary(terminalreporter) -> None:
    if _TIMINGS:  # the lead reports the launch tier's wall time per release from this line
        terminalreporter.write_line(f"launch tier timings on SGLang {SGLANG_VERSION} (s): {json.dumps(_TIMINGS)}")


@pytest.fixture(scope="session")
def launch_tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("launch")
