"""The installed SGLang's version, for patches (feature detection) and for the report alike."""

from __future__ import annotations

import sys


def sglang_version() -> str:
    try:
        loaded = sys.modules.get("sglang")
        loaded_version = getattr(loaded, "__version__", None)
        if isinstance(loaded_version, str):
            return loaded_version  # importlib.metadata reads the distribution's files on every call
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # noqa: BLE001
        return "not installed"
