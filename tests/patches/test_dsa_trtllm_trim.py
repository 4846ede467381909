"""dsa_trtllm_trim on SGLang's REAL ``DeepseekSparseAttnBackend._forward_trtllm`` (each release's own body), on CPU.

What runs for real: the whole ``_forward_trtllm`` body of the installed release (query merge, top-k padding, the fused
and non-fused top-k branches, the page-table transform's Python wrapper with its row assertion, sparse page-table
padding, the multi-CTA counter sizing), and our wrapper around it.

STAND-INs (each for something that cannot run on a CPU), all in this file:
- ``flashinfer``: the package is CUDA-only and not installed here. The TRT-LLM sparse-MLA decode kernel is replaced
  by a pure-torch reference sparse attention that enforces the kernel's batch contract (one ``seq_lens`` and one
  block-table row per query row: the CUDA kernel reads them for every row), plus the two ``flashinfer.utils`` sizing
  helpers the multi-CTA counter buffer asks for.
- The page-table transform's Triton kernel (``transform_index_page_table_decode_kernel``): a pure-torch gather with
  the same launch signature. SGLang's Python wrapper around it, including its assertions, runs unmodified.
- The decode metadata: a namespace with the three fields ``_forward_trtllm`` reads (``page_table_1``,
  ``cache_seqlens_int32``, ``max_seq_len_k``). The real planner (``init_forward_metadata``) runs deep_gemm/Triton
  planning kernels on CUDA; the only fact taken from it is that decode metadata has one row per real request.
- The KV pool: ``get_key_buffer`` returns a CPU tensor and ``set_mla_kv_buffer`` records what it was asked to write
  (the real MLA write is a Triton/CUDA kernel).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from support import affected_only

pytestmark = affected_only

HEADS, KV_LORA, ROPE, TOPK, CONTEXT = 2, 8, 4, 2048, 6
DSA_BACKEND = "sglang.srt.layers.attention.dsa_backend"
BACKEND_PATCHES = ("dsa_trtllm_trim", "dsa_decode_trim")  # deferred until dsa_backend is imported


class KernelLog:
    def __init__(self) -> None:
        self.decode_batches: list[int] = []
        self.transform_rows: list[int] = []
        self.kv_writes: list[tuple[torch.Tensor, int]] = []


def reference_sparse_mla_decode(log: KernelLog):
    """STAND-IN for flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla (page size 1, q_len 1)."""

    def kernel(*, query, kv_cache, block_tables, seq_lens, kv_lora_rank, bmm1_scale, **_unused):
        batch = query.shape[0]
        log.decode_batches.append(batch)
        if seq_lens.shape[0] != batch or block_tables.shape[0] != batch:
            raise RuntimeError(
                f"TRT-LLM MLA batch contract broken: {batch} query rows, {seq_lens.shape[0]} seq_lens rows, "
                f"{block_tables.shape[0]} block-table rows (the CUDA kernel reads past the end)"
            )
        kv = kv_cache.reshape(-1, kv_cache.shape[-1]).float()
        out = torch.zeros((batch, 1, query.shape[2], kv_lora_rank), dtype=query.dtype)
        for row in range(batch):
            slots = block_tables[row, 0]
            keys = kv[slots[slots >= 0].long()]
            scores = (query[row, 0].float() @ keys.T) * bmm1_scale
            out[row, 0] = (torch.softmax(scores, dim=-1) @ keys[:, :kv_lora_rank]).to(query.dtype)
        return out

    return kernel


class TransformKernelStandIn:
    """STAND-IN for the Triton ``transform_index_page_table_decode_kernel``: ``kernel[grid](...)`` in pure torch."""

    def __init__(self, log: KernelLog) -> None:
        self.log = log

    def __getitem__(self, grid):
        def launch(page_table, topk_indices, result, page_size, page_table_row_stride):
            self.log.transform_rows.append(grid[0])
            for row in range(grid[0]):
                idx = topk_indices[row]
                valid = idx >= 0
                result[row] = -1
                result[row][valid] = page_table[row, idx[valid].long()].to(result.dtype)

        return launch


class KVPoolStandIn:
    """STAND-IN for the MLA KV pool (its write is a CUDA/Triton kernel): a CPU buffer, writes recorded."""

    def __init__(self, kv_buffer: torch.Tensor, log: KernelLog) -> None:
        self.kv_buffer, self.log = kv_buffer, log

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer

    def set_mla_kv_buffer(self, layer, loc, cache_k_nope, cache_k_rope) -> None:
        self.log.kv_writes.append((loc.clone(), cache_k_nope.shape[0]))


@pytest.fixture(scope="module", autouse=True)
def server_args():
    """A real ServerArgs published as the scheduler's (the DSA helpers read the prefill-CP switch from it)."""
    from sglang.srt.server_args import ServerArgs

    from sglang_dp_mtp_fix.harness.pool import DUMMY_MODEL
    from sglang_dp_mtp_fix.harness.rank import publish_server_args

    publish_server_args(ServerArgs(model_path=str(DUMMY_MODEL), device="cpu", skip_tokenizer_init=True))


@pytest.fixture()
def kernels(monkeypatch):
    """Install the stand-ins for GPU-only code; everything else is the installed SGLang."""
    import importlib

    dsa_backend = importlib.import_module(DSA_BACKEND)
    log = KernelLog()
    flashinfer = types.ModuleType("flashinfer")
    flashinfer.decode = types.ModuleType("flashinfer.decode")
    flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla = reference_sparse_mla_decode(log)
    flashinfer.utils = types.SimpleNamespace(
        get_device_sm_count=lambda device: 1, get_trtllm_gen_multi_ctas_kv_counter_bytes=lambda *a: 0
    )
    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer)
    monkeypatch.setitem(sys.modules, "flashinfer.decode", flashinfer.decode)
    grow = getattr(dsa_backend, "grow_multi_ctas_kv_counter_buffer_if_needed", None)
    if grow is not None:  # 0.5.17+: sizes a counter buffer through flashinfer.utils
        monkeypatch.setattr(sys.modules[grow.__module__], "flashinfer", flashinfer, raising=False)
    transform_module = sys.modules[dsa_backend.transform_index_page_table_decode.__module__]
    monkeypatch.setattr(transform_module, "transform_index_page_table_decode_kernel", TransformKernelStandIn(log))
    return log


def sgl_kernel_topk_backend():
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import DSATopKBackend

    return next(member for member in DSATopKBackend if member.is_sgl_kernel())


def make_backend(real_rows: int, fused: bool, log: KernelLog):
    """The real backend class, built without its GPU-allocating __init__; only the attributes the body reads."""
    from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend

    gen = torch.Generator().manual_seed(7)
    backend = object.__new__(DeepseekSparseAttnBackend)
    slots = real_rows * CONTEXT + 1  # slot 0 is the dummy slot padding rows write to
    kv_buffer = torch.randn((slots, KV_LORA + ROPE), generator=gen)
    page_table = torch.arange(1, real_rows * CONTEXT + 1, dtype=torch.int32).view(real_rows, CONTEXT)
    backend.forward_metadata = types.SimpleNamespace(  # STAND-IN: see module docstring
        page_table_1=page_table,
        cache_seqlens_int32=torch.full((real_rows,), CONTEXT, dtype=torch.int32),
        max_seq_len_k=CONTEXT,
    )
    backend.__dict__.update(
        qk_rope_head_dim=ROPE, qk_nope_head_dim=KV_LORA, kv_lora_rank=KV_LORA, kv_cache_dim=KV_LORA + ROPE,
        kv_cache_dtype=torch.float32, real_page_size=1, use_fused_topk=fused, num_q_heads=HEADS, device="cpu",
        workspace_buffer=torch.empty(0), token_to_kv_pool=KVPoolStandIn(kv_buffer, log),
        dsa_topk_backend=sgl_kernel_topk_backend() if fused else None, dsa_index_topk=TOPK,
        _multi_ctas_kv_counter_buffer=torch.empty(0, dtype=torch.uint8),
    )  # fmt: skip
    return backend


def decode_inputs(physical_rows: int, real_rows: int, fused: bool) -> dict:
    """Row-aligned decode inputs: the first ``real_rows`` are real requests, the rest DP padding (garbage)."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn((physical_rows, HEADS, KV_LORA), generator=gen)
    q_rope = torch.randn((physical_rows, HEADS, ROPE), generator=gen)
    k = torch.randn((physical_rows, 1, KV_LORA), generator=gen)
    k_rope = torch.randn((physical_rows, 1, ROPE), generator=gen)
    topk = torch.full((physical_rows, TOPK), -1, dtype=torch.int32)
    for row in range(physical_rows):
        chosen = torch.randperm(CONTEXT, generator=gen)[:3].to(torch.int32)
        # fused top-k carries KV slots already; non-fused carries positions into the request's page-table row
        topk[row, :3] = chosen + 1 + min(row, max(real_rows - 1, 0)) * CONTEXT if fused else chosen
    forward_batch = types.SimpleNamespace(
        positions=torch.arange(physical_rows, dtype=torch.int64),
        out_cache_loc=torch.cat([torch.arange(1, real_rows + 1), torch.zeros(physical_rows - real_rows)]).long(),
        forward_mode=None,
        encoder_out_cache_loc=None,
        attn_cp_metadata=None,
    )
    layer = types.SimpleNamespace(
        layer_id=0, tp_q_head_num=HEADS, v_head_dim=KV_LORA, head_dim=KV_LORA + ROPE, scaling=0.5,
        is_cross_attention=False, k_scale_float=None,
    )  # fmt: skip
    return dict(q=q, k=k, v=None, layer=layer, forward_batch=forward_batch, q_rope=q_rope, k_rope=k_rope, topk=topk)


def run_forward_trtllm(backend, inputs: dict, save_kv_cache: bool = False):
    return backend._forward_trtllm(
        inputs["q"], inputs["k"], inputs["v"], inputs["layer"], inputs["forward_batch"],
        backend.forward_metadata.cache_seqlens_int32, save_kv_cache=save_kv_cache, q_rope=inputs["q_rope"],
        k_rope=inputs["k_rope"], topk_indices=inputs["topk"],
    )  # fmt: skip


def sliced(inputs: dict, rows: int) -> dict:
    out = dict(inputs)
    for key in ("q", "k", "q_rope", "k_rope", "topk"):
        out[key] = inputs[key][:rows]
    out["forward_batch"] = types.SimpleNamespace(**vars(inputs["forward_batch"]))
    out["forward_batch"].positions = inputs["forward_batch"].positions[:rows]
    out["forward_batch"].out_cache_loc = inputs["forward_batch"].out_cache_loc[:rows]
    return out


# -- stock: the failure ------------------------------------------------------------------------------------------


def test_stock_padded_decode_fails_the_page_table_row_assertion(kernels):
    """Non-fused top-k (PD decode up to 0.5.17): 4 DP-padded query rows, metadata planned for 2 real requests."""
    backend = make_backend(real_rows=2, fused=False, log=kernels)
    with pytest.raises(AssertionError):
        run_forward_trtllm(backend, decode_inputs(4, 2, fused=False))
    assert kernels.decode_batches == []  # never reached attention


def test_stock_padded_fused_decode_breaks_the_kernel_batch_contract(kernels):
    """Fused top-k (PD decode from 0.5.18): the kernel gets 4 query rows but 2 seq_lens rows."""
    backend = make_backend(real_rows=2, fused=True, log=kernels)
    with pytest.raises(RuntimeError, match="4 query rows, 2 seq_lens rows"):
        run_forward_trtllm(backend, decode_inputs(4, 2, fused=True))


# -- patched: correct rows, zero padding ---------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True], ids=["nonfused-topk", "fused-topk"])
@pytest.mark.parametrize(("physical", "real"), [(4, 2), (3, 1), (8, 7)])
def test_padded_decode_attends_real_rows_and_zero_pads(restored, kernels, fused, physical, real):
    restored.register()
    inputs = decode_inputs(physical, real, fused)
    unpadded = run_forward_trtllm(make_backend(real, fused, kernels), sliced(inputs, real))
    kernels.decode_batches.clear(), kernels.transform_rows.clear()

    out = run_forward_trtllm(make_backend(real, fused, kernels), inputs)

    assert out.shape == (physical, 1, HEADS, KV_LORA)  # the physical DP shape the MLP/EP collectives expect
    assert torch.equal(out[:real], unpadded)  # bit-identical to the unpadded computation
    assert torch.count_nonzero(out[real:]) == 0  # padding rows exactly zero
    assert kernels.decode_batches == [real]  # the kernel saw only real rows
    assert kernels.transform_rows == ([] if fused else [real])


def test_idle_rank_returns_zeros_of_the_physical_shape(restored, kernels):
    """An idle DP rank: padded query rows, metadata planned for zero requests."""
    restored.register()
    out = run_forward_trtllm(make_backend(0, False, kernels), decode_inputs(2, 0, fused=False))
    assert out.shape == (2, 1, HEADS, KV_LORA) and torch.count_nonzero(out) == 0


def test_kv_save_writes_only_real_rows_and_forward_batch_is_restored(restored, kernels):
    restored.register()
    inputs = decode_inputs(4, 2, fused=True)
    forward_batch = inputs["forward_batch"]
    positions, out_cache_loc = forward_batch.positions, forward_batch.out_cache_loc
    run_forward_trtllm(make_backend(2, True, kernels), inputs, save_kv_cache=True)
    (loc, rows), = kernels.kv_writes  # fmt: skip
    assert rows == 2 and loc.tolist() == [1, 2]  # the padding rows' dummy slot 0 is not written
    assert forward_batch.positions is positions and forward_batch.out_cache_loc is out_cache_loc


def test_forward_batch_is_restored_when_the_body_raises(restored, kernels):
    restored.register()
    inputs = decode_inputs(4, 2, fused=True)
    backend = make_backend(2, True, kernels)
    backend.dsa_topk_backend = None  # the real _get_fused_topk_page_table raises on it
    positions = inputs["forward_batch"].positions
    with pytest.raises(AttributeError):
        run_forward_trtllm(backend, inputs)
    assert inputs["forward_batch"].positions is positions


def test_no_padding_is_the_stock_call(restored, kernels):
    """Graph capture/replay and non-DP decode: metadata rows == query rows, the original gets the same objects."""
    stock_out = run_forward_trtllm(make_backend(3, False, kernels), decode_inputs(3, 3, fused=False))
    restored.register()
    seen = {}
    backend = make_backend(3, False, kernels)
    original = type(backend)._forward_trtllm.__sglang_dp_mtp_fix_original__
    inputs = decode_inputs(3, 3, fused=False)

    def spy(self, q, *args, **kwargs):
        seen.update(q=q, topk=kwargs["topk_indices"])
        return original(self, q, *args, **kwargs)

    from sglang_dp_mtp_fix.patches.dsa_trtllm_trim import make_forward_trtllm

    out = make_forward_trtllm(spy)(backend, *run_args(backend, inputs), **run_kwargs(inputs))
    assert seen["q"] is inputs["q"] and seen["topk"] is inputs["topk"]
    assert torch.equal(out, stock_out)


def test_metadata_larger_than_query_is_left_to_stock(restored, kernels):
    """Not a DP-padding shape: the wrapper does not trim or pad, the stock body decides (here: its assertion)."""
    restored.register()
    with pytest.raises(AssertionError):
        run_forward_trtllm(make_backend(3, False, kernels), decode_inputs(2, 2, fused=False))


def run_args(backend, inputs):
    cache_seqlens = backend.forward_metadata.cache_seqlens_int32
    return inputs["q"], inputs["k"], inputs["v"], inputs["layer"], inputs["forward_batch"], cache_seqlens


def run_kwargs(inputs):
    return dict(q_rope=inputs["q_rope"], k_rope=inputs["k_rope"], topk_indices=inputs["topk"], save_kv_cache=False)


def test_unimportable_dsa_backend_stands_this_patch_down_alone():
    """Where the DSA backend cannot load (its CUDA-only imports are missing), this process cannot run DSA attention
    (the lent GPU host without deep_gemm hit this). Loading the plugin never imports it, so the patch stays
    not-loaded (its hook never fires: the import fails) and the DP draft vote is applied; doctor, which imports it to
    say what the hook would decide, reports it not-affected."""
    from support import expected_statuses, last_json, run_python

    proc = run_python(
        """
        import importlib.abc, json, sys

        class NoDeepGemm(importlib.abc.MetaPathFinder):  # fault injection: the module's import fails
            def find_spec(self, name, path=None, target=None):
                if name == "sglang.srt.layers.attention.dsa_backend":
                    raise ModuleNotFoundError("No module named 'deep_gemm'")

        sys.meta_path.insert(0, NoDeepGemm())
        from sglang_dp_mtp_fix import plugin
        from sglang_dp_mtp_fix.config import Config
        from sglang_dp_mtp_fix.core import plan

        doctor = plan(plugin.all_patches(), Config()).check_deferred_all().outcomes  # changes nothing
        loaded = {o.id: [o.status.value, o.reason] for o in plugin.register()}
        try:
            import sglang.srt.layers.attention.dsa_backend  # what a DSA model would do: fails, no hook runs
        except ImportError:
            pass
        after = {o.id: o.status.value for o in plugin.get_manager().outcomes}
        doctor = {o.id: [o.status.value, o.reason] for o in doctor}
        print(json.dumps({"loaded": loaded, "after": after, "doctor": doctor}))
        """
    )
    out = last_json(proc.stdout)
    for pid in BACKEND_PATCHES:  # dsa_decode_trim waits on the same module
        assert out["loaded"][pid][0] == "not-loaded" and out["after"][pid] == "not-loaded"
        assert out["doctor"].pop(pid) == [
            "not-affected",
            "sglang.srt.layers.attention.dsa_backend cannot be imported here (ModuleNotFoundError: No module named "
            "'deep_gemm'); this process cannot run that code, so there is nothing to patch",
        ]
    # The doctor's plan imported dsa_indexer and model_runner (they load here), so dsa_idle_index and
    # draft_local_rows applied at register(); only the backend whose import fails stays not-loaded.
    expected = {
        **expected_statuses(dsa_imported=False, model_runner_imported=True),
        "dsa_idle_index": expected_statuses()["dsa_idle_index"],
    }
    assert {pid: status for pid, (status, _) in out["loaded"].items()} == expected
    assert out["after"] == expected
    assert {pid: status for pid, (status, _) in out["doctor"].items()} == {
        pid: status for pid, status in expected_statuses().items() if pid not in BACKEND_PATCHES
    }
