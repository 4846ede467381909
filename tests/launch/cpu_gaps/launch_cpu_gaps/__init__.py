"""STAND-IN helper plugin (``SGLANG_PLUGINS=dp_mtp_fix,launch_cpu_gaps``), launch tier only.

Reason: SGLang's CPU engine (``--device cpu``, ``SGLANG_USE_CPU_ENGINE=1``) is built for the sgl-kernel CPU build
(AMX/AVX-512); on this CPU without it SGLang falls back to torch_native attention, which has gaps that stop a
DP-attention + PD-decode + MTP launch. Each fill below is the smallest change that lets the real code run, and does
what the GPU/AMX path does. The tests' fixture registers this package through a tiny dist-info in a temp dir on
PYTHONPATH (never installed into the venv). It never touches ``sglang_dp_mtp_fix``.

Gap 1: DP-attention padding calls ``attn_backend.get_cpu_graph_seq_len_fill_value()`` on the CPU engine; only
       IntelAMXAttnBackend defines it (AttributeError on TorchNativeAttnBackend). Fill: the same value, 1.
Gap 1b: before 0.5.19 that padding asks ``get_cuda_graph_seq_len_fill_value()`` whatever the device, and neither CPU
       backend defines it (the base class raises ``NotImplementedError``). Fill, on those releases only: the CPU value.
Gap 2: an idle DP rank runs the model on 0 tokens; ``RotaryEmbedding.forward_native`` reshapes to ``(0, -1, d)``,
       which torch refuses. Fill: 0 tokens pass through unchanged (what the CUDA rope kernel does).
Gap 3: torch_native has no EAGLE/NEXTN draft or target-verify path ("EAGLE is not supported in decode attention
       backend torch_native"), and ServerArgs rewrites intel_amx to torch_native on a CPU without AMX. Fill (only
       with LAUNCH_CPU_ATTN_OPS=1): build IntelAMXAttnBackend where torch_native is asked for; its two kernels come
       from the sgl_kernel stand-in.
Gap 4: the MTP draft model (``qwen3_moe_mtp``) calls ``torch.cuda.synchronize()`` when sharing the target's embed and
       head: "Torch not compiled with CUDA enabled". Fill: a no-op when torch has no CUDA.
Gap 5: before 0.5.19, DP-attention padding (``ForwardBatch.prepare_mlp_sync_batch``) builds
       ``torch.tensor(global_num_tokens, pin_memory=True)``; torch without an accelerator has no pinned-memory
       allocator ("pin_memory=True requires a CUDA or other accelerator backend"). Fill, on those releases and only in
       that module: ``torch.tensor`` there makes an unpinned tensor (what 0.5.19+ does on CPU).
Gap 6: before 0.5.19, ``GroupCoordinator.all_gather_into_tensor`` / ``reduce_scatter_tensor`` go through SGLang's
       custom ops ``sglang::reg_*``, registered for CUDA only ("Could not run 'sglang::reg_all_gather_into_tensor' with
       arguments from the 'CPU' backend"). Fill, on those releases: CPU tensors take the coordinator's own
       ``_all_gather_into_tensor`` / ``_reduce_scatter_tensor``, which those ops call (what 0.5.19+ does on CPU).
Gap 7: before 0.5.19, DP attention's gather/scatter copy rows with ``memcpy_triton``, a Triton kernel (no Triton
       driver on CPU: "0 active drivers"). STAND-IN, on those releases: CPU tensors take a plain-torch row copy with
       the kernel's contract (``_copy_rows``); other tensors the kernel.
"""

from __future__ import annotations

import functools
import os
import types
from pathlib import Path

MARK = "_launch_cpu_gaps"


def register() -> None:
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    if not hasattr(TorchNativeAttnBackend, "get_cpu_graph_seq_len_fill_value"):  # gap 1
        TorchNativeAttnBackend.get_cpu_graph_seq_len_fill_value = lambda self: 1
    _cuda_fill_value_on_cpu()  # gap 1b
    _unpinned_tensor_in_forward_batch()  # gap 5
    _cpu_collectives_without_custom_ops()  # gap 6
    _row_copy_without_triton()  # gap 7
    _zero_token_rope()  # gap 2
    if os.environ.get("LAUNCH_CPU_ATTN_OPS"):  # gap 3
        _amx_backend_for_torch_native()
    import torch

    if not torch.cuda.is_available() and not getattr(torch.cuda.synchronize, MARK, False):  # gap 4

        def synchronize(device=None) -> None:
            return None

        setattr(synchronize, MARK, True)
        torch.cuda.synchronize = synchronize


def _cuda_fill_value_on_cpu() -> None:
    import inspect

    from sglang.srt.layers.attention.intel_amx_backend import IntelAMXAttnBackend
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    if "get_cpu_graph_seq_len_fill_value" in inspect.getsource(ForwardBatch._pad_inputs_to_size):
        return  # 0.5.19+: the padding asks the CPU value on CPU
    for backend in (TorchNativeAttnBackend, IntelAMXAttnBackend):
        if "get_cuda_graph_seq_len_fill_value" not in backend.__dict__:
            backend.get_cuda_graph_seq_len_fill_value = lambda self: self.get_cpu_graph_seq_len_fill_value()


class _TorchUnpinnedTensor(types.ModuleType):
    """torch as one SGLang module sees it: the same, except that ``tensor(..., pin_memory=True)`` is not pinned."""

    def __init__(self, torch: types.ModuleType):
        super().__init__(torch.__name__)
        self._torch = torch

    def __getattr__(self, name: str):
        return getattr(self._torch, name)

    def tensor(self, *args, pin_memory: bool = False, **kwargs):
        return self._torch.tensor(*args, **kwargs)


def _unpinned_tensor_in_forward_batch() -> None:
    import torch
    from sglang.srt.model_executor import forward_batch_info

    if torch.cuda.is_available() or isinstance(forward_batch_info.torch, _TorchUnpinnedTensor):
        return
    if "torch.tensor(global_num_tokens, pin_memory=True)" in Path(forward_batch_info.__file__).read_text():
        forward_batch_info.torch = _TorchUnpinnedTensor(torch)


def _cpu_collectives_without_custom_ops() -> None:
    import inspect

    from sglang.srt.distributed.parallel_state import GroupCoordinator

    for public in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        original = GroupCoordinator.__dict__[public]
        if getattr(original, MARK, False) or "_is_cpu" in inspect.getsource(original):
            continue  # 0.5.19+: CPU takes the direct path already

        @functools.wraps(original)
        def route(self, output, input, _original=original, _direct=f"_{public}"):
            if output.device.type == "cpu":
                getattr(self, _direct)(output, input)
                return None
            return _original(self, output, input)

        setattr(route, MARK, True)
        setattr(GroupCoordinator, public, route)


def _copy_rows(dst, src, dim, offset, sz, offset_src) -> None:
    """STAND-IN for ``memcpy_triton``: ``sz`` rows (dim 0; ``offset``/``sz`` are 1-element tensors) from
    ``src[offset:]`` to ``dst[0:]`` when ``offset_src``, else from ``src[0:]`` to ``dst[offset:]``."""
    if dim != 0:
        raise NotImplementedError(f"launch_cpu_gaps STAND-IN memcpy: dim {dim}")
    start, rows = int(offset), int(sz)
    if offset_src:
        dst[:rows].copy_(src[start : start + rows])
    else:
        dst[start : start + rows].copy_(src[:rows])


def _row_copy_without_triton() -> None:
    from sglang.srt.layers import dp_attention

    kernel = getattr(dp_attention, "memcpy_triton", None)
    if kernel is None or hasattr(dp_attention, "memcpy_cpu") or getattr(kernel, MARK, False):
        return  # 0.5.19+: dp_attention copies CPU rows itself

    @functools.wraps(kernel)
    def memcpy_triton(dst, src, dim, offset, sz, offset_src):
        if dst.device.type == "cpu":
            return _copy_rows(dst, src, dim, offset, sz, offset_src)
        return kernel(dst, src, dim, offset, sz, offset_src)

    setattr(memcpy_triton, MARK, True)
    dp_attention.memcpy_triton = memcpy_triton


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
