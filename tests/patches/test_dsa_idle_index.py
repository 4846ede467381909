"""dsa_idle_index on the real ``Indexer.forward_cuda`` of the installed release (CPU).

The idle rank's batch is a real ``ForwardBatch`` (``ForwardMode.IDLE``, zero rows) padded by SGLang's own
``ForwardBatch._pad_inputs_to_size`` the way MAX_LEN DP padding pads it, so ``seq_lens`` is NOT empty and the stock
"HACK: seq_lens empty" escape is not taken. The stock body then runs up to sparse index selection. The pieces of
that path that only run on a GPU are replaced by STAND-INs that record that they were reached (each says why).
``_is_cuda`` of the ``dsa_indexer`` module is set for the test, as it is on a CUDA build.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch
from releases import SGLANG_VERSION
from support import affected_only

from sglang_dp_mtp_fix.patches import dsa_idle_index as patch

pytestmark = affected_only

DSA_INDEXER = "sglang.srt.layers.attention.dsa.dsa_indexer"
PADDED_ROWS = 4  # the idle rank's physical rows after MAX_LEN padding to the group's max token count
INDEX_TOPK = 8
N_HEADS, HEAD_DIM, HIDDEN = 2, 16, 32
LAYER_ID = 3
STOCK_SELECTION_PATH = [
    "get_indexer_metadata",
    "_get_q_k_bf16",
    "act_quant",
    "_store_index_k_cache",
    "_get_logits_head_gate",
    "_get_topk_paged",
]


@pytest.fixture()
def module(monkeypatch):
    mod = importlib.import_module(DSA_INDEXER)
    monkeypatch.setattr(mod, "_is_cuda", True)  # a CUDA build; the CPU test host has it False
    return mod


def _batch(idle: bool = True, rows: int = PADDED_ROWS):
    """A real ForwardBatch: IDLE with zero rows then DP-padded by SGLang's code, or a DECODE batch of ``rows``."""
    from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    n = 0 if idle else rows
    fb = ForwardBatch(
        forward_mode=ForwardMode.IDLE if idle else ForwardMode.DECODE, batch_size=n,
        input_ids=torch.zeros(n, dtype=torch.long), req_pool_indices=torch.arange(n),
        seq_lens=torch.full((n,), 100, dtype=torch.int32), out_cache_loc=torch.arange(n), seq_lens_sum=100 * n,
        positions=torch.full((n,), 99, dtype=torch.long), lora_ids=[],
    )  # fmt: skip
    if idle:
        backend = object.__new__(DeepseekSparseAttnBackend)  # STAND-IN construction: __init__ allocates GPU buffers
        backend.get_cpu_graph_seq_len_fill_value = backend.get_cuda_graph_seq_len_fill_value  # CPU-build branch
        fb._pad_inputs_to_size(SimpleNamespace(attn_backend=backend), PADDED_ROWS, PADDED_ROWS)  # STAND-IN runner
    return fb


class Trace:
    """Records which stand-ins the stock path reached, in order, and what they were given."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.seen: dict[str, object] = {}

    def hit(self, name: str, **seen: object) -> None:
        self.calls.append(name)
        self.seen.update({f"{name}.{k}": v for k, v in seen.items()})


@pytest.fixture()
def trace(module, monkeypatch):
    """STAND-INs for the GPU-only pieces of the stock eager indexer path (module level)."""
    t = Trace()

    class PlannedMetadata:  # STAND-IN: the DSA attention backend plans it on the GPU from the real rows
        def __init__(self, real_rows: int) -> None:
            self.real_rows = real_rows

        def get_seqlens_int32(self) -> torch.Tensor:
            return torch.full((self.real_rows,), 100, dtype=torch.int32)

    class Backend:  # STAND-IN attention backend (its metadata planning needs the GPU runner)
        def get_indexer_metadata(self, layer_id, forward_batch):
            real_rows = 0 if forward_batch.forward_mode.is_idle() else forward_batch.batch_size
            t.hit("get_indexer_metadata", real_rows=real_rows)
            return PlannedMetadata(real_rows)

    def act_quant(x, block_size, scale_fmt):  # STAND-IN: Triton FP8 quantization kernel
        t.hit("act_quant", rows=x.shape[0])
        return x.clone(), torch.ones((x.shape[0], x.shape[1], 1))

    monkeypatch.setattr(module, "get_attn_backend", lambda: Backend())
    # forward_cuda imports act_quant at call time: from srt/layers/... (0.5.15.post1) or sglang/kernels/... (0.5.16+)
    patched = 0
    for name in ("sglang.kernels.ops.attention.dsa.triton_kernel", "sglang.srt.layers.attention.dsa.triton_kernel"):
        try:
            kernel_module = importlib.import_module(name)
        except ImportError:
            continue
        monkeypatch.setattr(kernel_module, "act_quant", act_quant)
        patched += 1
    assert patched, "no Triton act_quant module in this release"
    return t


def _indexer(t: Trace | None = None):
    from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer

    idx = object.__new__(Indexer)  # STAND-IN construction: __init__ builds the projections and DeepGEMM state on a GPU
    torch.nn.Module.__init__(idx)
    # Only what forward_cuda reads on the eager decode/idle path.
    idx.index_topk, idx.n_heads, idx.head_dim, idx.block_size, idx.scale_fmt = INDEX_TOPK, N_HEADS, HEAD_DIM, 128, None
    idx.softmax_scale, idx.alt_stream, idx.dsa_enable_prefill_cp, idx.use_dsa_indexer_fusion = 1.0, None, False, False
    idx.weights_proj = SimpleNamespace()  # not LoRA-wrapped
    if t is None:
        return idx

    def get_q_k_bf16(q_lora, x, positions, enable_dual_stream, forward_batch=None):
        # STAND-IN: q/k projections + Hadamard rotation (a CUDA kernel) need the model's weights
        t.hit("_get_q_k_bf16", rows=x.shape[0])
        rows = x.shape[0]
        return torch.zeros((rows, N_HEADS, HEAD_DIM)), torch.zeros((rows, HEAD_DIM)), None

    def store_index_k_cache(forward_batch, layer_id, key, act_quant):  # STAND-IN: writes the GPU index-K pool
        t.hit("_store_index_k_cache", rows=key.shape[0])

    def get_logits_head_gate(x, q_scale):  # STAND-IN: torch.compile'd CUDA matmul (torch.mm out_dtype)
        t.hit("_get_logits_head_gate", rows=x.shape[0])
        return torch.ones((x.shape[0], N_HEADS, 1))

    def get_topk_paged(forward_batch, layer_id, q_fp8, weights, metadata):
        # STAND-IN: DeepGEMM paged-MQA logits + top-k kernels (sparse index selection itself)
        t.hit("_get_topk_paged", q_rows=q_fp8.shape[0], planned_rows=metadata.get_seqlens_int32().shape[0])
        return torch.zeros((q_fp8.shape[0], INDEX_TOPK), dtype=torch.int32)

    idx._get_q_k_bf16, idx._store_index_k_cache = get_q_k_bf16, store_index_k_cache
    idx._get_logits_head_gate, idx._get_topk_paged = get_logits_head_gate, get_topk_paged
    return idx


def _call(idx, fb, return_indices: bool = True, x=None):
    x = torch.zeros((fb.positions.shape[0], HIDDEN)) if x is None else x
    q_lora = torch.zeros((fb.positions.shape[0], HIDDEN))
    return idx.forward_cuda(x, q_lora, fb.positions, fb, LAYER_ID, return_indices=return_indices)


def _outcome(fn):
    try:
        return ("returned", fn())
    except Exception as exc:  # noqa: BLE001 - the stock outcome may be an error; it must be the same one
        return ("raised", type(exc).__name__)


def test_stock_idle_rank_with_padded_seq_lens_enters_index_selection(restored, trace):
    """STOCK: an idle rank whose seq_lens are DP-padded runs sparse index selection for rows nobody planned."""
    fb = _batch(idle=True)
    assert fb.forward_mode.is_idle() and fb.batch_size == 0
    assert fb.seq_lens.numel() == PADDED_ROWS  # the stock "seq_lens empty" escape is not taken
    _call(_indexer(trace), fb)
    assert trace.calls == STOCK_SELECTION_PATH
    assert trace.seen["_store_index_k_cache.rows"] == PADDED_ROWS  # padded rows written into the index-K cache
    assert trace.seen["_get_topk_paged.q_rows"] == PADDED_ROWS
    assert trace.seen["_get_topk_paged.planned_rows"] == 0  # metadata planned for zero real rows: the mismatch


@pytest.mark.parametrize("as_tuple", [False, True])
def test_patched_idle_rank_returns_all_invalid_rows_of_the_physical_shape(restored, trace, module, as_tuple):
    restored.register()
    fb = _batch(idle=True)
    x = torch.zeros((PADDED_ROWS, HIDDEN))
    if as_tuple:  # fused FP8 RMSNorm+quant hands (x_fp8, x_scale): the row count comes from x[0]
        x = (x, torch.ones((PADDED_ROWS, 1)))
    out = _call(_indexer(trace), fb, x=x)
    assert trace.calls == []  # no metadata, no projections, no index-K write, no selection
    assert out.dtype == torch.int32 and out.shape == (PADDED_ROWS, INDEX_TOPK)
    assert torch.equal(out, torch.full((PADDED_ROWS, INDEX_TOPK), -1, dtype=torch.int32))


@pytest.mark.parametrize("return_indices", [True, False])
def test_broadcast_then_capture_as_upstream(restored, trace, module, monkeypatch, mocker, return_indices):
    """The idle result goes through SGLang's own broadcast, then the top-k capturer (the real ones, called through)."""
    restored.register()
    steps = mocker.Mock()  # one parent: its mock_calls keep the two stand-ins' order
    steps.attach_mock(mocker.Mock(wraps=module._broadcast_indexer_topk_from_rank0), "broadcast")
    steps.attach_mock(mocker.Mock(wraps=module.maybe_capture_indexer_topk), "capture")
    monkeypatch.setattr(module, "_broadcast_indexer_topk_from_rank0", steps.broadcast)
    monkeypatch.setattr(module, "maybe_capture_indexer_topk", steps.capture)
    out = _call(_indexer(trace), _batch(idle=True), return_indices=return_indices)
    assert [name for name, _, _ in steps.mock_calls] == ["broadcast", "capture"]
    (topk,), (layer_id, captured) = steps.broadcast.call_args.args, steps.capture.call_args.args
    if return_indices:
        assert topk is out and layer_id == LAYER_ID and captured is out
    else:  # k-cache-only call: nothing to index, nothing returned (upstream's result builder returns None too)
        assert out is None and topk is None and (layer_id, captured) == (LAYER_ID, None)
    assert trace.calls == []


def _stock_and_patched(restored, make_call):
    stock = _outcome(make_call)
    restored.register()
    patched = _outcome(make_call)
    return stock, patched


def test_capture_mode_runs_the_original(restored, trace, monkeypatch):
    """CUDA-graph capture (and breakable graphs) never take the short-circuit: the captured graph stays stock."""
    capture_mode = importlib.import_module("sglang.srt.model_executor.runner_utils.capture_mode")
    monkeypatch.setattr(capture_mode, "is_capture_mode", True)  # the runner's own process-global capture flag
    restored.register()
    out = _call(_indexer(trace), _batch(idle=True))
    assert trace.calls == STOCK_SELECTION_PATH
    assert torch.equal(out, torch.zeros((PADDED_ROWS, INDEX_TOPK), dtype=torch.int32))  # the original's result


def test_non_idle_batch_runs_the_original(restored, trace):
    restored.register()
    out = _call(_indexer(trace), _batch(idle=False, rows=3))
    assert trace.calls == STOCK_SELECTION_PATH
    assert trace.seen["_get_topk_paged.q_rows"] == trace.seen["_get_topk_paged.planned_rows"] == 3
    assert torch.equal(out, torch.zeros((3, INDEX_TOPK), dtype=torch.int32))


def test_non_cuda_build_stays_stock(restored, trace, module, monkeypatch):
    """HIP/XPU/NPU (``_is_cuda`` False, read at call time): the wrapped method behaves exactly as stock."""
    monkeypatch.setattr(module, "_is_cuda", False)
    idx = _indexer(trace)
    stock = _outcome(lambda: _call(idx, _batch(idle=True)))
    stock_calls = list(trace.calls)
    trace.calls.clear()
    restored.register()
    patched = _outcome(lambda: _call(idx, _batch(idle=True)))
    assert stock_calls[:2] == ["get_indexer_metadata", "_get_q_k_bf16"]  # the original ran, not the short-circuit
    assert trace.calls == stock_calls
    if stock[0] == "returned":
        assert patched[0] == "returned" and torch.equal(patched[1], stock[1])
    else:
        assert patched == stock


def test_indexer_built_after_application_dispatches_to_the_wrapper(restored, module, monkeypatch):
    """``Indexer`` caches its bound forward (``__init__`` for MultiPlatformOp <=0.5.17, first call for BaseFusedOp
    0.5.18+). One built after application, through its real base class and ``forward()``, reaches the wrapper."""
    from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer

    restored.register()
    base = next(c for c in Indexer.__mro__ if c.__name__ in ("MultiPlatformOp", "BaseFusedOp"))
    if base.__name__ == "MultiPlatformOp":
        multi_platform = importlib.import_module(base.__module__)
        monkeypatch.setattr(multi_platform, "_is_cuda", True)  # dispatch as on a CUDA build
    else:
        fused_op = importlib.import_module(base.__module__)
        monkeypatch.setattr(fused_op, "_platform_key", lambda: "cuda")  # dispatch as on a CUDA build
        monkeypatch.setattr(fused_op, "_oot_dispatch_key", lambda: None)
    idx = object.__new__(Indexer)  # STAND-IN construction: Indexer.__init__ needs a GPU; the base __init__ is real
    base.__init__(idx)
    idx.index_topk = INDEX_TOPK
    fb = _batch(idle=True)
    out = idx.forward(torch.zeros((PADDED_ROWS, HIDDEN)), torch.zeros((PADDED_ROWS, HIDDEN)), fb.positions, fb, 0)
    assert getattr(idx._forward_method, "__func__", None) is Indexer.forward_cuda
    assert getattr(Indexer.forward_cuda, "__sglang_dp_mtp_fix_patch__", None) == "dsa_idle_index"
    assert torch.equal(out, torch.full((PADDED_ROWS, INDEX_TOPK), -1, dtype=torch.int32))


@pytest.mark.parametrize("idle", [True, False])
def test_idle_decision_traces_under_dynamo_without_graph_breaks(module, idle):
    """Piecewise prefill graphs trace the model with Dynamo: the decision and the result builder compile in one
    graph (fullgraph=True) and give the eager answer."""
    import torch._dynamo

    fb = _batch(idle=idle, rows=PADDED_ROWS)

    def decide_and_build(x: torch.Tensor) -> torch.Tensor:
        if patch.is_eager_idle_rank(module, fb):
            return patch.all_invalid_topk_rows(x, INDEX_TOPK, True)
        return x.new_zeros((x.shape[0], INDEX_TOPK), dtype=torch.int32)

    torch._dynamo.reset()
    try:
        compiled = torch.compile(decide_and_build, backend="eager", fullgraph=True)
        x = torch.zeros((PADDED_ROWS, HIDDEN))
        assert torch.equal(compiled(x), decide_and_build(x))
        assert bool((compiled(x) == -1).all()) is idle
    finally:
        torch._dynamo.reset()


def test_wrapped_idle_path_compiles_in_one_graph(restored, module):
    """The whole wrapped call on an idle rank (decision, result builder, SGLang's broadcast and capture helpers)
    traces under Dynamo with fullgraph=True: no graph break, no host sync, same rows as eager."""
    import torch._dynamo

    restored.register()
    idx, fb = _indexer(), _batch(idle=True)
    x = torch.zeros((PADDED_ROWS, HIDDEN))
    torch._dynamo.reset()
    try:
        compiled = torch.compile(lambda x: _call(idx, fb, x=x), backend="eager", fullgraph=True)
        assert torch.equal(compiled(x), torch.full((PADDED_ROWS, INDEX_TOPK), -1, dtype=torch.int32))
    finally:
        torch._dynamo.reset()


def test_wrapper_is_gone_after_restore(restored):
    from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer

    stock = Indexer.__dict__["forward_cuda"]
    restored.register()
    assert Indexer.__dict__["forward_cuda"] is not stock
    restored.restore()
    assert Indexer.__dict__["forward_cuda"] is stock, SGLANG_VERSION
