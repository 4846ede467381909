"""Stand-in for NVIDIA's CuTe DSL (`cutlass`) and `cuda.bindings`, DSA tier only, for SGLang 0.5.15.post1.

Why: 0.5.15.post1 imports its Blackwell-only (SM100) CuTe DSL indexer kernel when `sglang.jit_kernel.dsa` loads
(0.5.16+ import it lazily), and nvidia-cutlass-dsl does not fit the device carry. On the H200 (SM90) that kernel is
never called: deep_gemm computes the indexer's logits. This finder sits last on `sys.meta_path`, so it serves only
names no real package provides, and every object it hands out is inert: a decorator returns what it decorates, any
other use returns another inert object. run.sh puts this folder on PYTHONPATH only when `import cutlass` fails.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

STAND_IN_ROOTS = ("cutlass", "cuda")


class _Inert:
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # used as a decorator
        return _Inert()

    def __getitem__(self, key: Any) -> Any:
        return _Inert()

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


class _InertModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert()


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name.split(".")[0] not in STAND_IN_ROOTS:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _InertModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


sys.meta_path.append(_StandInFinder())
