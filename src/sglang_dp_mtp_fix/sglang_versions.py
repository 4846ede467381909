"""SGLang's versions: the one installed (``sglang_version``, for the patches' feature checks and for the report), and
the product's claim, which SGLang releases the patches are written for. The plugin's own version: ``_version``.

The claim is read by the core (a target's fingerprint must have been seen in an affected release) and by
``tools/gen_fingerprints.py`` (which wheels it reads). The tests keep their own, independent list of what each release
should report: they check this claim rather than import it.
"""

from __future__ import annotations

import sys

# Releases the patches were written against: a target fingerprint must have been seen in one of these.
AFFECTED_RELEASES = ("0.5.15.post1", "0.5.16", "0.5.17", "0.5.18", "0.5.19", "0.5.20")

# The wheels whose target sources are fingerprinted: the affected releases and their neighbours on both sides, so a
# drifted or already-fixed release is recognised by name rather than reported as unknown code.
FINGERPRINTED_RELEASES = ("0.5.14", "0.5.15", *AFFECTED_RELEASES, "0.5.21", "0.5.22", "0.5.23")


def sglang_version() -> str:
    """The installed SGLang's version ("not installed" without one)."""
    try:
        loaded = sys.modules.get("sglang")
        loaded_version = getattr(loaded, "__version__", None)
        if isinstance(loaded_version, str):
            return loaded_version  # importlib.metadata reads the distribution's files on every call
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # noqa: BLE001
        return "not installed"
