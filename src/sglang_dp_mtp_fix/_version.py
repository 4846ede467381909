"""The plugin's version: the release number here, the build's full version from ``_build_version.py``.

``RELEASE`` changes only with a release (the build counts commits since that line changed). The build backend
(``buildsys/version_backend.py``) writes ``_build_version.py`` at every build and editable install, so the version
names the build: ``0.3.0`` at the release, ``0.3.1.dev4+g1a2b3c4`` four commits later.
"""

from __future__ import annotations

RELEASE = "0.3.0"

try:
    from sglang_dp_mtp_fix._build_version import VERSION
except ImportError:  # a source tree no build has stamped (e.g. src/ put on sys.path): the number, marked so
    VERSION = f"{RELEASE}+unbuilt"

__version__: str = VERSION
__all__ = ["RELEASE", "__version__"]
