"""Post-import hooks: run a callback right after a named module has been imported (``sys.meta_path`` finder).

Why our own and not ``wrapt.register_post_import_hook``: the package declares no dependencies (installing it must
never make pip touch SGLang's stack, and SGLang 0.5.15.post1-0.5.20 do not declare ``wrapt`` either), and the
plugin needs two things wrapt's hooks do not give: hooks that ``restore()`` can remove, and a defined exception
path (a callback's exception propagates out of the ``import`` statement, which is how ``strict`` mode stops a
process from inside SGLang's model import). One code path: this module.

How: a finder at the front of ``sys.meta_path`` answers only for the module names with a pending hook. It asks the
finders after it for the real spec and wraps that spec's loader; after the real loader's ``exec_module`` returns (the
module is fully executed and in ``sys.modules``) the real loader goes back on the module's ``__loader__`` and
``__spec__.loader`` (as wrapt's ``_self_set_loader`` does: the module then looks as if imported without us), and the
hooks of that name run once, in registration order, and are dropped. A module that fails to import runs no hook. While
it executes, every other attribute of the loader is the real loader's (``get_source``, resources).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

Hook = Callable[[ModuleType], None]

_lock = threading.RLock()
_hooks: dict[str, list[Hook]] = {}


def is_imported(name: str) -> bool:
    """True when ``name`` is in ``sys.modules`` and finished executing (not an import in progress)."""
    module = sys.modules.get(name)
    if module is None:
        return False
    return not getattr(getattr(module, "__spec__", None), "_initializing", False)


def when_imported(name: str, hook: Hook) -> None:
    """Run ``hook(module)`` once, right after ``name`` has been imported. The caller checks ``is_imported`` first."""
    with _lock:
        _hooks.setdefault(name, []).append(hook)
        if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
            sys.meta_path.insert(0, _FINDER)


def cancel(hook: Hook) -> None:
    """Remove a pending hook (no-op when it already ran); the finder leaves ``sys.meta_path`` when none is left."""
    with _lock:
        for name in list(_hooks):
            _hooks[name] = [h for h in _hooks[name] if h is not hook]
            if not _hooks[name]:
                del _hooks[name]
        if not _hooks:
            sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _PostImportFinder)]


def waiting() -> dict[str, int]:
    """Module name -> number of hooks still waiting for its import (tests, diagnostics)."""
    with _lock:
        return {name: len(hooks) for name, hooks in _hooks.items()}


class _HookedLoader(importlib.abc.Loader):
    """The real loader, plus the hooks after ``exec_module``."""

    def __init__(self, loader: Any, name: str) -> None:
        self._loader, self._name = loader, name

    def __getattr__(self, attr: str) -> Any:  # get_source, get_filename, is_package, resources, ...
        return getattr(self._loader, attr)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self._loader.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        try:
            self._loader.exec_module(module)
        finally:
            _restore_loader(module, self)
        with _lock:
            hooks = _hooks.pop(self._name, [])
            if not _hooks:
                sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _PostImportFinder)]
        for hook in hooks:
            hook(module)  # an exception here fails the import (strict mode's stop); callers catch what they mean to


def _restore_loader(module: ModuleType, hooked: _HookedLoader) -> None:
    """Put the real loader back where the import system recorded ours."""
    if getattr(module, "__loader__", None) is hooked:
        module.__loader__ = hooked._loader
    spec = getattr(module, "__spec__", None)
    if spec is not None and spec.loader is hooked:
        spec.loader = hooked._loader


def finder_installed() -> bool:
    """True while the post-import finder is on ``sys.meta_path`` (it leaves when no hook is waiting)."""
    return any(isinstance(f, _PostImportFinder) for f in sys.meta_path)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, _PostImportFinder):
                continue
            find = getattr(finder, "find_spec", None)
            spec: importlib.machinery.ModuleSpec | None = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _HookedLoader(spec.loader, fullname)
                return spec
        return None


_FINDER = _PostImportFinder()
