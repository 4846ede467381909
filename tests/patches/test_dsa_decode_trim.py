"""Every non-TRT-LLM DSA decode backend on a DP-padded eager decode, through SGLang's REAL code, on CPU.

What runs for real: ``DeepseekSparseAttnBackend.forward_decode`` of the installed release (KV save, q split/merge,
``_pad_topk_indices``, the fused / non-fused page table with the page-table transform's Python wrapper and its row
assertion, the dispatch), then the real ``_forward_*`` body of each decode backend the release has:
``_forward_flashmla_sparse``, ``_forward_flashmla_kv``, ``_forward_fa3``, ``_forward_flashinfer_sparse_mla``
(0.5.17+, with SGLang's real ``flashinfer_sparse_mla_forward`` wrapper), ``_forward_tilelang``,
``_forward_triton_decode`` (0.5.20), ``_forward_aiter``; and ``dsa_decode_trim``'s wrapper around it.

STAND-INs (each for a GPU kernel that cannot run on a CPU; each computes the same reference sparse MLA attention
in float, row by row, and enforces only the batch contract its real kernel checks):
- FlashMLA ``flash_mla_sparse_fwd`` (``sgl_kernel`` is CUDA-only): per query row; ``topk_length`` must have one row
  per query row when given.
- FlashMLA ``flash_mla_with_kvcache``: FlashMLA's ``CHECK_SHAPE(seqlens_k, batch_size)`` and
  ``CHECK_SHAPE(num_splits, batch_size+1)`` (flash_api.cpp), batch = query rows.
- FA3 ``flash_attn_with_kvcache`` (varlen q): batch = ``len(cu_seqlens_q) - 1``; FA3's ``TORCH_CHECK(batch_size ==
  batch_size_k)`` with ``batch_size_k = page_table.size(0)`` for paged KV, and ``CHECK_SHAPE(seqlens_k, batch_size)``.
  Query rows past the last batch are never written (NaN here: the real output is ``torch::empty``).
- FlashInfer ``flashinfer.mla.trtllm_batch_decode_with_kv_cache_mla`` (the package is not installed): one
  ``seq_lens`` row per query row, as in test_dsa_trtllm_trim.
- TileLang ``tilelang_sparse_fwd`` (``tilelang`` is not installed), Triton ``triton_sparse_mla_decode_splitk``
  (a Triton GPU kernel): per query row, no metadata.
- aiter ``mla_decode_fwd`` and the Triton ``get_valid_kv_indices`` (ROCm): batch = ``len(qo_indptr) - 1``; rows past
  it are never written.
- FlashMLA ``get_mla_metadata`` (the split plan SGLang's ``_compute_flashmla_metadata`` asks for): ``num_splits``
  with one entry per length + 1.
- The page-table transform's Triton kernel, the KV pool and the decode metadata: the metadata holds the fields the
  bodies read as SGLang's planner leaves them under DP padding: one row per real request in ``cache_seqlens_int32``
  and the page table, while the DSA per-token lengths (``dsa_cache_seqlens_int32``, their prefix sums) and FlashMLA's
  split plan cover every physical row, the padded ones with zero length (``pad_dsa_cache_seqlens``). A GPU server
  showed it: with the per-token fields modelled at real rows, a trim that kept FlashMLA-KV's padded split plan passed
  here and crashed there (``num_splits must have shape (b+1)``).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

import pytest
import torch
from releases import AFFECTED, SGLANG_VERSION
from support import affected_only

pytestmark = affected_only

HEADS, KV_LORA, ROPE, TOPK, CONTEXT, VALID = 2, 8, 4, 2048, 6, 3
DIM = KV_LORA + ROPE
SLOTS = 128  # a multiple of FlashMLA-KV's page size 64; slot 0 is the dummy slot padding rows write to
DSA_BACKEND = "sglang.srt.layers.attention.dsa_backend"
TILELANG_HOMES = ("sglang.srt.layers.attention.dsa.tilelang_kernel", "sglang.kernels.ops.attention.dsa.tilelang_kernel")
TRITON_DECODE = "sglang.kernels.ops.attention.dsa.triton_sparse_mla_decode"
# Stock verdict with fused top-k, per backend: the _forward_* body survives padded rows (True) or a kernel contract
# breaks (False). Non-fused top-k fails for every backend in the shared prologue (test below).
FUSED_STOCK_SURVIVES = {
    "flashmla_sparse": True, "flashmla_kv": True, "fa3": True, "flashinfer_sparse_mla": True, "tilelang": True,
    "triton": True, "aiter": True,
}  # fmt: skip


def backends() -> list[Any]:
    """The decode backends of the installed release (read at collection). On a patched release dsa_backend must
    import: a failure there fails collection, naming it, instead of emptying this list (every case of this file
    would have become a skip). Elsewhere the module's cases skip anyway (affected_only)."""
    try:
        cls = importlib.import_module(DSA_BACKEND).DeepseekSparseAttnBackend
    except Exception as exc:
        if SGLANG_VERSION in AFFECTED:
            raise RuntimeError(
                f"{DSA_BACKEND} does not import on SGLang {SGLANG_VERSION}, a patched release: the DSA decode trim's "
                f"cases cannot be collected ({type(exc).__name__}: {exc})"
            ) from exc
        return [pytest.param("none", marks=pytest.mark.skip(reason=f"{DSA_BACKEND} does not import here"))]
    impls = ["flashmla_sparse", "flashmla_kv", "fa3", "tilelang", "aiter"]
    impls += ["flashinfer_sparse_mla"] if hasattr(cls, "_forward_flashinfer_sparse_mla") else []
    impls += ["triton"] if hasattr(cls, "_forward_triton_decode") else []
    return impls


BACKENDS = backends()


def reference(q_all: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, scale: float, d_v: int) -> torch.Tensor:
    """Sparse MLA attention of each query row over the KV slots its index row names (-1: none), row by row."""
    out = torch.zeros((q_all.shape[0], q_all.shape[1], d_v), dtype=q_all.dtype)
    for row in range(q_all.shape[0]):
        keys = kv[slots[row][slots[row] >= 0].long()].float()
        if keys.shape[0]:
            p = torch.softmax((q_all[row].float() @ keys.T) * scale, dim=-1)
            out[row] = (p @ keys[:, :d_v]).to(q_all.dtype)
    return out


class Kernels:
    """Every GPU kernel STAND-IN (see the module docstring); ``batches`` records the rows each kernel computed."""

    def __init__(self) -> None:
        self.batches: list[int] = []
        self.kv_writes: list[torch.Tensor] = []

    def flash_mla_sparse_fwd(self, q, kv, indices, sm_scale, d_v, attn_sink=None, topk_length=None):
        if topk_length is not None and topk_length.shape[0] != q.shape[0]:
            raise RuntimeError("FlashMLA sparse: topk_length rows != query rows")
        self.batches.append(q.shape[0])
        return reference(q, kv.reshape(-1, kv.shape[-1]), indices[:, 0], sm_scale, d_v), None, None

    @staticmethod
    def get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q=None, is_fp8_kvcache=False,
                         topk=None):  # fmt: skip
        return torch.empty(0), torch.zeros(cache_seqlens.shape[0] + 1, dtype=torch.int32)

    def flash_mla_with_kvcache(self, q, k_cache, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                               softmax_scale, indices, block_table, is_fp8_kvcache):  # fmt: skip
        batch = q.shape[0]
        if cache_seqlens.shape[0] != batch or num_splits.shape[0] != batch + 1:
            raise RuntimeError(f"FlashMLA CHECK_SHAPE(seqlens_k, batch_size): {batch} query rows, "
                               f"{cache_seqlens.shape[0]} seqlens rows")  # fmt: skip
        self.batches.append(batch)
        out = reference(q[:, 0], k_cache.reshape(-1, k_cache.shape[-1]), indices[:, 0], softmax_scale, head_dim_v)
        return out.unsqueeze(1), None

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, qv, page_table, cache_seqlens, cu_seqlens_q,
                                max_seqlen_q, softmax_scale, **_unused):  # fmt: skip
        batch = cu_seqlens_q.shape[0] - 1
        if batch != page_table.shape[0] or cache_seqlens.shape[0] != batch:
            raise RuntimeError(f"FA3: batch_size must be equal to batch_size_k ({batch} != {page_table.shape[0]})")
        self.batches.append(batch)
        kv = torch.cat([v_cache, k_cache], dim=-1).reshape(-1, v_cache.shape[-1] + k_cache.shape[-1])
        q_all = torch.cat([qv, q], dim=-1)
        out = torch.full((q_all.shape[0], q_all.shape[1], v_cache.shape[-1]), float("nan"), dtype=q_all.dtype)
        for b in range(batch):
            rows = slice(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]))
            slots = page_table[b, : int(cache_seqlens[b])].expand(rows.stop - rows.start, -1)
            out[rows] = reference(q_all[rows], kv, slots, softmax_scale, v_cache.shape[-1])
        return out

    def trtllm_batch_decode_with_kv_cache_mla(self, *, query, kv_cache, block_tables, seq_lens, bmm1_scale,
                                              kv_lora_rank, **_unused):  # fmt: skip
        if seq_lens.shape[0] != query.shape[0]:
            raise RuntimeError(f"FlashInfer sparse MLA: {query.shape[0]} query rows, {seq_lens.shape[0]} seq_lens")
        self.batches.append(query.shape[0])
        kv = kv_cache.reshape(-1, kv_cache.shape[-1]).view(torch.float32)
        return reference(query[:, 0], kv, block_tables[:, 0], bmm1_scale, kv_lora_rank).unsqueeze(1)

    def tilelang_sparse_fwd(self, q, kv, indices, sm_scale, d_v):
        self.batches.append(q.shape[0])
        return reference(q, kv.reshape(-1, kv.shape[-1]), indices[:, 0], sm_scale, d_v)

    def triton_sparse_mla_decode_splitk(self, q_nope, q_rope, kv, indices, sm_scale, d_v):
        return self.tilelang_sparse_fwd(torch.cat([q_nope, q_rope], dim=-1), kv, indices, sm_scale, d_v)

    @staticmethod
    def get_valid_kv_indices(page_table, kv_indptr, kv_indices, bs):
        for b in range(bs):
            valid = page_table[b][page_table[b] != -1]
            kv_indices[int(kv_indptr[b]) : int(kv_indptr[b]) + valid.shape[0]] = valid

    def mla_decode_fwd(self, q, kv, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q, sm_scale,
                       **_unused):  # fmt: skip
        batch = qo_indptr.shape[0] - 1
        self.batches.append(batch)
        for b in range(batch):
            rows = slice(int(qo_indptr[b]), int(qo_indptr[b + 1]))
            slots = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])].expand(rows.stop - rows.start, -1)
            o[rows] = reference(q[rows], kv.reshape(-1, kv.shape[-1]), slots, sm_scale, o.shape[-1])

    def transform(self, grid):
        def launch(page_table, topk_indices, result, page_size, page_table_row_stride):
            for row in range(grid[0]):
                idx = topk_indices[row]
                result[row] = -1
                result[row][idx >= 0] = page_table[row, idx[idx >= 0].long()].to(result.dtype)

        return launch


class KVPoolStandIn:
    """STAND-IN for the MLA KV pool (its write is a CUDA/Triton kernel): a CPU buffer, writes recorded."""

    def __init__(self, kv_buffer: torch.Tensor, kernels: Kernels) -> None:
        self.kv_buffer, self.kernels = kv_buffer, kernels

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer

    def set_mla_kv_buffer(self, layer, loc, cache_k_nope, cache_k_rope) -> None:
        assert loc.shape[0] == cache_k_nope.shape[0]  # the real write scatters one row per location
        self.kernels.kv_writes.append(loc.clone())


@pytest.fixture(scope="module", autouse=True)
def server_args():
    """A real ServerArgs published as the scheduler's (the DSA helpers read global server args)."""
    from sglang.srt.server_args import ServerArgs

    from sglang_dp_mtp_fix.harness.pool import DUMMY_MODEL
    from sglang_dp_mtp_fix.harness.rank import publish_server_args

    publish_server_args(ServerArgs(model_path=str(DUMMY_MODEL), device="cpu", skip_tokenizer_init=True))


@pytest.fixture()
def kernels(monkeypatch):
    dsa_backend = importlib.import_module(DSA_BACKEND)
    k = Kernels()
    sgl_kernel = types.ModuleType("sgl_kernel")
    sgl_kernel.flash_mla = types.ModuleType("sgl_kernel.flash_mla")
    sgl_kernel.flash_mla.flash_mla_sparse_fwd = k.flash_mla_sparse_fwd
    sgl_kernel.flash_mla.flash_mla_with_kvcache = k.flash_mla_with_kvcache
    sgl_kernel.flash_mla.get_mla_metadata = k.get_mla_metadata
    tilelang = types.ModuleType("tilelang_kernel")
    tilelang.tilelang_sparse_fwd = k.tilelang_sparse_fwd
    flashinfer = types.ModuleType("flashinfer")
    flashinfer.mla = types.ModuleType("flashinfer.mla")
    flashinfer.mla.trtllm_batch_decode_with_kv_cache_mla = k.trtllm_batch_decode_with_kv_cache_mla
    modules = {"sgl_kernel": sgl_kernel, "sgl_kernel.flash_mla": sgl_kernel.flash_mla, "flashinfer": flashinfer,
               "flashinfer.mla": flashinfer.mla, **dict.fromkeys(TILELANG_HOMES, tilelang)}  # fmt: skip
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    if "triton" in BACKENDS:
        monkeypatch.setattr(importlib.import_module(TRITON_DECODE), "triton_sparse_mla_decode_splitk",
                            k.triton_sparse_mla_decode_splitk)  # fmt: skip
    for name in ("flash_attn_with_kvcache", "mla_decode_fwd", "get_valid_kv_indices"):
        monkeypatch.setattr(dsa_backend, name, getattr(k, name), raising=False)
    monkeypatch.setattr(dsa_backend, "fp8_dtype", torch.float8_e4m3fn, raising=False)
    transform_module = sys.modules[dsa_backend.transform_index_page_table_decode.__module__]
    monkeypatch.setattr(transform_module, "transform_index_page_table_decode_kernel", _Grid(k.transform))
    return k


class _Grid:
    """``kernel[grid](...)`` launch syntax for the transform STAND-IN."""

    def __init__(self, launch) -> None:
        self.launch = launch

    def __getitem__(self, grid):
        return self.launch(grid)


def sgl_kernel_topk_backend():
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import DSATopKBackend

    return next(member for member in DSATopKBackend if member.is_sgl_kernel())


def make_backend(impl: str, real: int, fused: bool, kernels: Kernels, physical: int | None = None):
    """The real backend class, built without its GPU-allocating __init__; only the attributes the bodies read, with
    the decode metadata of ``real`` requests DP-padded to ``physical`` rows (default: unpadded)."""
    from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend

    physical = physical or real
    gen = torch.Generator().manual_seed(7)
    backend = object.__new__(DeepseekSparseAttnBackend)
    page_table = torch.arange(1, real * CONTEXT + 1, dtype=torch.int32).view(real, CONTEXT)
    # pad_dsa_cache_seqlens: the real rows' DSA lengths, then zero-length rows up to the DP-padded row count
    dsa_lengths = torch.cat(
        [torch.full((real,), VALID, dtype=torch.int32), torch.zeros(physical - real, dtype=torch.int32)]
    )
    dsa_prefix_sums = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(dsa_lengths, 0, dtype=torch.int32)])
    backend.forward_metadata = types.SimpleNamespace(  # STAND-IN: see module docstring
        page_table_1=page_table, cache_seqlens_int32=torch.full((real,), CONTEXT, dtype=torch.int32),
        dsa_cache_seqlens_int32=dsa_lengths, max_seq_len_k=CONTEXT,
        dsa_cu_seqlens_q=torch.arange(physical + 1, dtype=torch.int32),
        cu_seqlens_q=torch.arange(real + 1, dtype=torch.int32), dsa_cu_seqlens_k=dsa_prefix_sums, dsa_max_seqlen_q=1,
        max_seq_len_q=1, flashmla_metadata=types.SimpleNamespace(
            flashmla_metadata=torch.empty(0), num_splits=torch.zeros(physical + 1, dtype=torch.int32)),
    )  # fmt: skip
    backend.__dict__.update(
        dsa_decode_impl=impl, use_fused_topk=fused, hisparse_coordinator=None, dsa_index_kpool=1, device_sm_major=9,
        dsa_topk_backend=sgl_kernel_topk_backend() if fused else None, dsa_index_topk=TOPK, num_splits=0,
        token_to_kv_pool=KVPoolStandIn(torch.randn((SLOTS, 1, DIM), generator=gen), kernels), kv_lora_rank=KV_LORA,
        qk_nope_head_dim=KV_LORA, qk_rope_head_dim=ROPE, flashmla_kv_num_q_heads=HEADS, dsa_kv_cache_store_fp8=True,
        real_page_size=64 if impl == "flashmla_kv" else 1, kv_cache_dim=4 * DIM if impl == "flashinfer_sparse_mla"
        else DIM, workspace_buffer=torch.empty(0), _sink_pad_cache={}, need_pad_heads=False,
        kv_indptr=torch.zeros(16, dtype=torch.int32), kv_indices=torch.zeros(16 * TOPK, dtype=torch.int32),
    )  # fmt: skip
    return backend


def decode_inputs(physical: int, real: int, fused: bool) -> dict:
    """Row-aligned decode inputs: the first ``real`` rows are real requests, the rest DP padding (garbage)."""
    gen = torch.Generator().manual_seed(11)
    topk = torch.full((physical, TOPK), -1, dtype=torch.int32)
    for row in range(physical):
        chosen = torch.randperm(CONTEXT, generator=gen)[:VALID].to(torch.int32)
        # fused top-k carries KV slots already; non-fused carries positions into the request's page-table row
        topk[row, :VALID] = chosen + 1 + min(row, real - 1) * CONTEXT if fused else chosen
    forward_batch = types.SimpleNamespace(
        out_cache_loc=torch.cat([torch.arange(1, real + 1), torch.zeros(physical - real)]).long(),
        encoder_out_cache_loc=None, batch_size=physical, req_pool_indices=None, seq_lens=None,
    )  # fmt: skip
    layer = types.SimpleNamespace(layer_id=0, tp_q_head_num=HEADS, v_head_dim=KV_LORA, head_dim=DIM, scaling=0.5,
                                  is_cross_attention=False, logit_cap=0.0)  # fmt: skip
    k = torch.randn((physical, 1, KV_LORA), generator=gen)
    return dict(q=torch.randn((physical, HEADS, KV_LORA), generator=gen), k=k, v=k, layer=layer,
                forward_batch=forward_batch, q_rope=torch.randn((physical, HEADS, ROPE), generator=gen),
                k_rope=torch.randn((physical, 1, ROPE), generator=gen), topk=topk)  # fmt: skip


def run(backend, inputs: dict, save_kv_cache: bool = False):
    return backend.forward_decode(
        inputs["q"], inputs["k"], inputs["v"], inputs["layer"], inputs["forward_batch"], save_kv_cache=save_kv_cache,
        q_rope=inputs["q_rope"], k_rope=inputs["k_rope"], topk_indices=inputs["topk"],
    )  # fmt: skip


def sliced(inputs: dict, rows: int) -> dict:
    out = {key: (value[:rows] if isinstance(value, torch.Tensor) else value) for key, value in inputs.items()}
    out["forward_batch"] = types.SimpleNamespace(**vars(inputs["forward_batch"]))
    out["forward_batch"].out_cache_loc = inputs["forward_batch"].out_cache_loc[:rows]
    out["forward_batch"].batch_size = rows
    return out


def rows_of(out: torch.Tensor) -> torch.Tensor:
    return out.reshape(out.shape[0], -1)


# -- stock: the failure ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", BACKENDS)
def test_stock_padded_nonfused_decode_fails_in_the_shared_prologue(kernels, impl):
    """Non-fused top-k (PD decode with IndexShare seeds up to 0.5.17; SGLANG_DSA_FUSE_TOPK=0 anywhere): every
    backend fails the page-table transform's row assertion before its _forward_* is reached."""
    with pytest.raises(AssertionError):
        run(make_backend(impl, 2, False, kernels, physical=4), decode_inputs(4, 2, fused=False))
    assert kernels.batches == []  # no attention kernel was reached


@pytest.mark.parametrize("impl", BACKENDS)
def test_stock_padded_fused_decode_per_backend(kernels, impl):
    """Fused top-k (PD decode from 0.5.18): the backend's own _forward_* body meets the padded rows. Row-wise
    kernels survive them (real rows as unpadded); those planned per request break their kernel's batch contract."""
    inputs = decode_inputs(4, 2, fused=True)
    if not FUSED_STOCK_SURVIVES[impl]:
        with pytest.raises(RuntimeError):
            run(make_backend(impl, 2, True, kernels, physical=4), inputs)
        return
    unpadded = run(make_backend(impl, 2, True, kernels), sliced(inputs, 2))
    out = run(make_backend(impl, 2, True, kernels, physical=4), inputs)
    assert out.shape[0] == 4 and torch.equal(rows_of(out)[:2], rows_of(unpadded))


# -- patched: correct rows, zero padding ---------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True], ids=["nonfused-topk", "fused-topk"])
@pytest.mark.parametrize("impl", BACKENDS)
def test_padded_decode_attends_real_rows_and_zero_pads(restored, kernels, impl, fused):
    restored.register()
    physical, real = 4, 3
    inputs = decode_inputs(physical, real, fused)
    unpadded = run(make_backend(impl, real, fused, kernels), sliced(inputs, real))
    kernels.batches.clear()

    out = run(make_backend(impl, real, fused, kernels, physical=physical), inputs)

    assert out.shape == (physical, *unpadded.shape[1:])  # the physical DP shape the MLP/EP collectives expect
    assert torch.equal(out[:real], unpadded)  # bit-identical to the unpadded computation
    assert torch.count_nonzero(out[real:]) == 0  # padding rows exactly zero
    assert kernels.batches == [real]  # the kernel saw only real rows


def test_kv_save_writes_only_real_rows_and_forward_batch_is_restored(restored, kernels):
    restored.register()
    inputs = decode_inputs(4, 2, fused=True)
    forward_batch = inputs["forward_batch"]
    out_cache_loc = forward_batch.out_cache_loc
    run(make_backend("tilelang", 2, True, kernels, physical=4), inputs, save_kv_cache=True)
    (loc,) = kernels.kv_writes
    assert loc.tolist() == [1, 2]  # the padding rows' dummy slot 0 is not written
    assert forward_batch.out_cache_loc is out_cache_loc and forward_batch.batch_size == 4


def test_forward_batch_is_restored_when_the_body_raises(restored, kernels):
    restored.register()
    inputs = decode_inputs(4, 2, fused=True)
    backend = make_backend("flashmla_kv", 2, True, kernels, physical=4)
    metadata = backend.forward_metadata
    metadata.flashmla_metadata = None  # the real _forward_flashmla_kv asserts on it
    out_cache_loc = inputs["forward_batch"].out_cache_loc
    with pytest.raises(AssertionError):
        run(backend, inputs)
    assert inputs["forward_batch"].out_cache_loc is out_cache_loc and inputs["forward_batch"].batch_size == 4
    assert backend.forward_metadata is metadata


def test_unpadded_trtllm_and_hisparse_calls_are_the_stock_call(restored, kernels, mocker):
    """Graph capture/replay and non-DP decode (rows equal), the TRT-LLM route (dsa_trtllm_trim's seam), HiSparse:
    the original gets the very same objects."""
    restored.register()
    from sglang_dp_mtp_fix.patches.dsa_decode_trim import make_forward_decode

    original = mocker.Mock(return_value="stock")
    wrapper = make_forward_decode(original)
    cases = [("tilelang", 4, {}), ("trtllm", 2, {}), ("tilelang", 2, {"hisparse_coordinator": object()})]
    for impl, real, extra in cases:
        backend = make_backend(impl, real, True, kernels, physical=4)
        backend.__dict__.update(extra)
        inputs = decode_inputs(4, real, fused=True)
        args = (backend, inputs["q"], inputs["k"], inputs["v"], inputs["layer"], inputs["forward_batch"])
        assert wrapper(*args) == "stock"
        original.assert_called_once()
        got = original.call_args.args  # the defaults the wrapper spells out follow the arguments given
        assert len(got) > len(args) and all(g is sent for g, sent in zip(got[: len(args)], args, strict=True))
        original.reset_mock()


# -- the idle-rank side ----------------------------------------------------------------------------------------------


def test_idle_rank_never_reaches_a_decode_backend(restored, kernels, mocker):
    """An idle DP rank's eager round: SGLang's real AttentionBackend.forward returns early for IDLE (before any
    forward_decode/_forward_*), so only index selection (dsa_idle_index) meets its zero-row metadata."""
    restored.register()
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    backend = make_backend("flashmla_kv", 1, False, kernels)
    inputs = decode_inputs(2, 1, fused=False)
    forward_batch = types.SimpleNamespace(forward_mode=ForwardMode.IDLE)
    backend.forward_decode = mocker.Mock()
    out = backend.forward(inputs["q"], inputs["k"], inputs["v"], inputs["layer"], forward_batch,
                          q_rope=inputs["q_rope"], k_rope=inputs["k_rope"], topk_indices=inputs["topk"])  # fmt: skip
    assert out.shape == (2, HEADS * KV_LORA) and kernels.batches == []
    backend.forward_decode.assert_not_called()
