"""GPU-probe STAND-IN for deep_gemm (NOT product code; never installed with the plugin).

Why: ``sglang.srt.layers.attention.dsa_backend`` imports deep_gemm at module level. The lent GPU host has no internet
and the carry limit (64 MiB) has no room for it; nothing these checks run calls it (the DSA metadata planner, which
does, is not run: the checks pass the three metadata fields ``_forward_trtllm`` reads). Any attribute is a
placeholder whose CALL raises, so nothing silently pretends to compute.
"""


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


def __getattr__(attr: str) -> _Placeholder:
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _Placeholder(f"deep_gemm.{attr}")
