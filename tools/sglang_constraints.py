"""Emit pip constraints from the installed SGLang's own ``Requires-Dist`` pins.

The few packages a CPU test venv needs then get the versions that SGLang release pins; torch is replaced by
``$TORCH_PIN`` (the CPU wheel on local disk) and the torchvision/torchaudio/torchcodec pins are dropped (a CPU
stand-in serves torchvision, see ``tests/cpu_stubs``).
"""

from __future__ import annotations

import importlib.metadata as md
import os

from packaging.requirements import Requirement

_DROPPED = {"torch", "torchvision", "torchaudio", "torchcodec"}


def main() -> None:
    out = [line for line in os.environ.get("TORCH_PIN", "torch==2.13.0").split(";") if line]
    for raw in md.requires("sglang") or []:
        req = Requirement(raw)
        if req.marker and "extra" in str(req.marker):
            continue
        if req.name.lower().replace("_", "-") in _DROPPED or not req.specifier:
            continue
        line = f"{req.name}{req.specifier}"
        if req.marker:
            line += f"; {req.marker}"
        out.append(line)
    print("\n".join(out))


if __name__ == "__main__":
    main()
