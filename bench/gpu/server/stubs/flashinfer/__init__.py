"""GPU-server STAND-IN for flashinfer (NOT product code; carried by bench/gpu/server only).

Why: flashinfer's dependency set is hundreds of MB (the carry limit is 64 MiB) and nothing on the served path needs
it: run.sh sets SGLang's own switch ``SGLANG_IS_FLASHINFER_AVAILABLE=false`` (every ``is_flashinfer_available()``
path off), the launch selects triton attention, pytorch sampling and triton MoE. It must still import, because
SGLang imports parts of it unconditionally on CUDA (``from flashinfer import bmm_fp8``, ``flashinfer.sampling``).
Any submodule imports, except ``flashinfer.norm``: sgl_kernel 0.4.5's ``rmsnorm`` uses ``flashinfer.norm`` whenever
that import succeeds, else its own kernel, so it is refused as if flashinfer were absent. ``FLASHINFER_STUB_REFUSE``
(comma-separated) refuses more: the DSA tier refuses ``flashinfer.fused_moe``, else SGLang binds its
``fused_topk_deepseek`` and the GLM-5 router (sigmoid, ``noaux_tc``) would call it instead of SGLang's Triton
``moe_fused_gate``. Capitalised attributes are
classes whose instantiation raises; other attributes chain, and calling one raises ``StubCalled``: nothing pretends
to compute, and a log with no ``StubCalled`` shows it was never called.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import types
from typing import Any

__version__ = "0.6.15.post1"
__path__: list[str] = []
_REFUSED = ("flashinfer.norm", *filter(None, os.environ.get("FLASHINFER_STUB_REFUSE", "").split(",")))


class StubCalled(RuntimeError):
    pass


class _Placeholder:
    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attr: str) -> _Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        raise StubCalled(f"{self._name} is a stand-in (flashinfer is not carried)")


def _attr(module: str, attr: str) -> Any:
    if attr[:1].isupper():

        def refuse(self: Any, *args: Any, **kwargs: Any) -> None:
            raise StubCalled(f"{module}.{attr} is a stand-in (flashinfer is not carried)")

        return type(attr, (), {"__module__": module, "__init__": refuse})
    return _Placeholder(f"{module}.{attr}")


class _Module(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        value = _attr(self.__name__, attr)
        setattr(self, attr, value)
        return value


class _Finder:
    @classmethod
    def find_spec(cls, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not name.startswith("flashinfer.") or any(name == r or name.startswith(r + ".") for r in _REFUSED):
            return None
        return importlib.machinery.ModuleSpec(name, cls, is_package=True)  # type: ignore[arg-type]

    @staticmethod
    def create_module(spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _Module(spec.name)
        module.__path__ = []
        module.__version__ = __version__  # type: ignore[attr-defined]
        return module

    @staticmethod
    def exec_module(module: types.ModuleType) -> None:
        pass


sys.meta_path.insert(0, _Finder)  # type: ignore[arg-type]


def __getattr__(attr: str) -> Any:
    if attr.startswith("__"):
        raise AttributeError(attr)
    value = _attr(__name__, attr)
    globals()[attr] = value
    return value
