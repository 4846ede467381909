"""Fixtures of the launch tier (helpers and the why: ``launchlib``); launches are shared by a module's scenarios.

Not a ``conftest.py``: the suite imports its root ``conftest`` by module name (``from conftest import ...``), and a
second ``conftest.py`` under ``tests/launch`` would take that name for every module collected after it. The test
modules import these fixtures; the root conftest prints the timings."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from launchlib import SGLANG_VERSION, gaps_pythonpath


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


_TIMINGS: dict[str, float] = {}  # read by the root conftest's terminal summary


def timings_line() -> str | None:
    return f"launch tier timings on SGLang {SGLANG_VERSION} (s): {json.dumps(_TIMINGS)}" if _TIMINGS else None


@pytest.fixture(scope="session")
def launch_tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("launch")
