"""The fault-injection summary (``test_faults.py``): a pytest plugin, registered by the root conftest, that counts and
lists the fault x target cases at the end of every run that collected them, so each run shows what was covered. A
case names itself through the ``fault_injection`` user property."""

from __future__ import annotations

from typing import Any

import pytest
from releases import SGLANG_VERSION

FAULT_PROPERTY = "fault_injection"
FAULTS_MODULE = "test_faults.py"


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    stats = terminalreporter.stats
    in_faults = [r for k in ("passed", "failed", "skipped") for r in stats.get(k, []) if FAULTS_MODULE in r.nodeid]
    if not in_faults:
        return
    covered = sorted(v for r in stats.get("passed", []) for k, v in r.user_properties if k == FAULT_PROPERTY)
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
