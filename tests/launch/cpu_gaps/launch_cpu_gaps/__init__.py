"""STAND-IN helper plugin (``SGLANG_PLUGINS=dp_mtp_fix,launch_cpu_gaps``), launch tier only.

Reason: SGLang's CPU engine (``--device cpu``, ``SGLANG_USE_CPU_ENGINE=1``) is built for the sgl-kernel CPU build
(AMX/AVX-512); on this CPU without it SGLang falls back to torch_native attention, which has four gaps that stop a
DP-attention + PD-decode + MTP launch. Each fill below is the smallest change that lets the real code run, and does
what the GPU/AMX path does. The tests' fixture registers this package through a tiny dist-info in a temp dir on
PYTHONPATH (never installed into the venv). It never touches ``sglang_dp_mtp_fix``.

Gap 1: DP-attention padding calls ``attn_backend.get_cpu_graph_seq_len_fill_value()`` on the CPU engine; only
       IntelAMXAttnBackend defines it (AttributeError on TorchNativeAttnBackend). Fill: the same value, 1.
Gap 2: an idle DP rank runs the model on 0 tokens; ``RotaryEmbedding.forward_native`` reshapes to ``(0, -1, d)``,
       which torch refuses. Fill: 0 tokens pass through unchanged (what the CUDA rope kernel does).
Gap 3: torch_native has no EAGLE/NEXTN draft or target-verify path ("EAGLE is not supported in decode attention
       backend torch_native"), and ServerArgs rewrites intel_amx to torch_native on a CPU without AMX. Fill (only
       with LAUNCH_CPU_ATTN_OPS=1): build IntelAMXAttnBackend where torch_native is asked for; its two kernels come
       from the sgl_kernel stand-in.
Gap 4: the MTP draft model (``qwen3_moe_mtp``) calls ``torch.cuda.synchronize()`` when sharing the target's embed and
       head: "Torch not compiled with CUDA enabled". Fill: a no-op when torch has no CUDA.
"""

from __future__ import annotations

import functools
import os

MARK = "_launch_cpu_gaps"


def register() -> None:
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    if not hasattr(TorchNativeAttnBackend, "get_cpu_graph_seq_len_fill_value"):  # gap 1
        TorchNativeAttnBackend.get_cpu_graph_seq_len_fill_value = lambda self: 1
    _zero_token_rope()  # gap 2
    if os.environ.get("LAUNCH_CPU_ATTN_OPS"):  # gap 3
        _amx_backend_for_torch_native()
    import torch

    if not torch.cuda.is_available() and not getattr(torch.cuda.synchronize, MARK, False):  # gap 4

        def synchronize(device=None) -> None:
            return None

        setattr(synchronize, MARK, True)
        torch.cuda.synchronize = synchronize


def _zero_token_rope() -> None:
    from sglang.srt.layers.rotary_embedding import base

    original = base.RotaryEmbedding.__dict__["forward_native"]
    if getattr(original, MARK, False):
        return

    @functools.wraps(original)
    def forward_native(self, positions, query, key, *args, **kwargs):
        if positions.numel() == 0:
            return query, key
        return original(self, positions, query, key, *args, **kwargs)

    setattr(forward_native, MARK, True)
    base.RotaryEmbedding.forward_native = forward_native


def _amx_backend_for_torch_native() -> None:
    from sglang.srt.layers.attention import attention_registry as registry
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    registry.ATTENTION_BACKENDS["torch_native"] = registry.ATTENTION_BACKENDS["intel_amx"]
    original = DraftBackendFactory._create_backend
    if getattr(original, MARK, False):
        return

    @functools.wraps(original)
    def _create_backend(self, *args, **kwargs):
        asked = self.draft_attn_backend
        if (asked or "torch_native") == "torch_native" and _target_uses_torch_native(self):
            self.draft_attn_backend = "intel_amx"
        try:
            return original(self, *args, **kwargs)
        finally:
            self.draft_attn_backend = asked

    setattr(_create_backend, MARK, True)
    DraftBackendFactory._create_backend = _create_backend


def _target_uses_torch_native(factory) -> bool:
    if factory.draft_attn_backend == "torch_native":
        return True
    try:  # 0.5.20: the resolved backends live in the runtime context
        from sglang.srt.runtime_context import attention_backends

        return "torch_native" in attention_backends()
    except ImportError:  # older releases: on the server args the factory holds
        args = getattr(factory, "server_args", None)
        return "torch_native" in {getattr(args, a, None) for a in ("attention_backend", "decode_attention_backend")}
