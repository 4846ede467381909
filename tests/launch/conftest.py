"""Fixtures of the launch tier (helpers and the why: ``tools/launchlib.py``); launches are shared by a module's
scenarios. The tier's wall times are printed at the end of the run."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from launchlib import gaps_pythonpath
from releases import SGLANG_VERSION

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


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if _TIMINGS:
        terminalreporter.write_line(f"launch tier timings on SGLang {SGLANG_VERSION} (s): {json.dumps(_TIMINGS)}")
