"""GPU-probe STAND-IN for deep_gemm (NOT product code; never installed with the plugin).

Why: SGLang's model runner and DSA modules import deep_gemm (and ``deep_gemm.utils``) at module level. The lent GPU
host has no internet and the carry limit (64 MiB) has no room for it; nothing these checks run calls it (the DSA
metadata planner, which does, is not run: the checks pass the three metadata fields ``_forward_trtllm`` reads).
Any submodule imports; any attribute is a placeholder whose CALL raises, so nothing silently pretends to compute.
"""

import importlib.abc
import importlib.machinery
import sys
import types

_TOP = __name__


class StubCalled(RuntimeError):
    pass


class _Placeholder:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> "_Placeholder":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise StubCalled(f"{self._name} is a GPU-probe stand-in (deep_gemm not carried)")


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str) -> _Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(_TOP + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


sys.meta_path.insert(0, _Finder())
__path__ = []


def __getattr__(attr: str) -> _Placeholder:
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _Placeholder(f"{_TOP}.{attr}")
