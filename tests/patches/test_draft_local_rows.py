"""draft_local_rows: the eager EAGLE draft step of one DP rank under MAX_LEN padding, run through SGLang's REAL
``EagleDraftWorker.draft_forward``, ``ModelRunner._forward_raw`` / ``_prepare_eager_forward_batch`` and
``ForwardBatch.init_new`` / ``prepare_mlp_sync_batch`` / ``post_forward_mlp_sync_batch`` (stock arm vs patched arm).

The process plays DP rank 0 of 2 (``global_num_tokens`` is given directly: ``[0, 3]`` idle, ``[1, 3]`` active;
``MAX_LEN`` pads this rank to 3 rows). How the stock step breaks (0.5.16 – 0.5.18, CUDA): an idle rank runs the full
eager loop; ``post_forward_mlp_sync_batch``'s IDLE branch trims logits and hidden states to the batch size (0) but
leaves ``positions`` padded (3 rows), and ``draft_topk1_postprocess`` asserts equal rows. 0.5.15.post1 and 0.5.19+
are not affected (argmax path; ``_draft_forward_idle``): their tests show the stock step completing with the right
rows, and the patched path is exercised there too by installing the wrappers directly.

STAND-INs (each one: what cannot run on a CPU-only box):
  * the draft model forward (``eager_runner.execute``): a row-wise function of (input id, position, hidden state)
    returning a real ``LogitsProcessorOutput`` (the MTP layer and LM head need weights and a GPU);
  * the two Triton kernels of ``sglang/kernels/ops/speculative/topk1.py`` (launched as ``kernel[grid](...)``) in
    pure torch, so SGLang's real ``draft_topk1_postprocess`` wrapper and its asserts run (``_is_cuda`` forced on);
  * ``torch.tensor(..., pin_memory=True)`` without pinning (no pinned-memory allocator without an accelerator);
  * the attention-DP rank/size globals of ``dp_attention`` (``initialize_dp_attention`` needs a model config and a
    real DP group): DP rank 0 of 2;
  * the ``ModelRunner`` instance: the real class without ``__init__`` (loads a model), only the attributes its
    eager-forward methods read; ``forward`` enters the real ``_forward_raw`` (the public wrapper only adds
    profiling and recorders);
  * the draft worker: the real ``EagleDraftWorker`` without ``__init__``, with the attributes ``draft_forward`` reads.
"""

from __future__ import annotations

import inspect
from array import array
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from releases import AFFECTED, SGLANG_VERSION
from support import requires_sglang

from sglang_dp_mtp_fix.core import Resolved
from sglang_dp_mtp_fix.harness.ports import free_port
from sglang_dp_mtp_fix.patches import draft_local_rows as dlr

pytestmark = requires_sglang

H, V, STEPS = 4, 8, 3
PADDED_ROWS = 3  # max(global_num_tokens): the MAX_LEN row count of every rank
APPLIED = ("0.5.16", "0.5.17", "0.5.18")


# ---- the PR's unit cases (#32209 rev A, TestEaglePDDPFallback) -------------------------------------------------


def test_eager_draft_discards_dp_padding_rows():
    logits, hidden, positions = torch.randn(3, 8), torch.randn(3, 4), torch.tensor([7, 100, 100])
    out_logits, out_hidden, out_positions = dlr.slice_draft_output_to_local_tokens(logits, hidden, positions, 1)
    assert out_logits.shape == (1, 8) and out_hidden.shape == (1, 4) and out_positions.tolist() == [7]
    assert torch.equal(out_logits, logits[:1]) and torch.equal(out_hidden, hidden[:1])
    out_positions.add_(1)  # views: the kernel's in-place position advance lands in the caller's tensor
    assert positions.tolist() == [8, 100, 100]


def test_idle_eager_draft_discards_all_dp_padding_rows():
    out = dlr.slice_draft_output_to_local_tokens(torch.randn(3, 8), torch.randn(3, 4), torch.tensor([7, 0, 0]), 0)
    assert [tuple(t.shape) for t in out] == [(0, 8), (0, 4), (0,)]


def test_eager_draft_rejects_missing_local_rows():
    with pytest.raises(RuntimeError, match="next_token_logits has 0 rows, but 1 local tokens need postprocessing"):
        dlr.slice_draft_output_to_local_tokens(torch.randn(0, 8), torch.randn(3, 4), torch.tensor([7, 0, 0]), 1)
    with pytest.raises(RuntimeError, match="EAGLE draft positions has 1 rows, but 2 local tokens"):
        dlr.slice_draft_output_to_local_tokens(torch.randn(2, 8), None, torch.tensor([7]), 2)


def test_no_padding_returns_the_same_tensors():
    logits, positions = torch.randn(2, 8), torch.tensor([3, 4])
    out_logits, out_hidden, out_positions = dlr.slice_draft_output_to_local_tokens(logits, None, positions, 2)
    assert out_logits is logits and out_hidden is None and out_positions is positions


# ---- one CPU "DP rank" running SGLang's real draft step -------------------------------------------------------


@pytest.fixture(scope="module")
def dp_rank():
    """Rank 0 of a 2-rank attention-DP group, in this process (see module docstring for the stand-ins)."""
    if SGLANG_VERSION not in AFFECTED:  # 0.5.21+ reorganised the DP-attention globals; the patch stands down there
        pytest.skip(f"end-to-end draft steps run on the releases the plugin patches, not {SGLANG_VERSION}")
    import torch.distributed as dist
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.layers import dp_attention
    from sglang.srt.server_args import ServerArgs

    from sglang_dp_mtp_fix.harness import rank as harness_rank
    from sglang_dp_mtp_fix.harness.pool import DUMMY_MODEL

    sa = ServerArgs(model_path=str(DUMMY_MODEL), device="cpu", skip_tokenizer_init=True, load_format="dummy")
    harness_rank.publish_server_args(sa)
    if not dist.is_initialized():
        port = free_port()
        ps.init_distributed_environment(
            backend="gloo", world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}"
        )
        ps.initialize_model_parallel()
    unpinned = torch.tensor

    def tensor_without_pinning(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        return unpinned(*args, **kwargs)  # STAND-IN: no pinned-memory allocator on a CPU-only torch

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dp_attention, "_ATTN_DP_SIZE", 2)  # STAND-IN for initialize_dp_attention: DP rank 0 of 2
        mp.setattr(dp_attention, "_ATTN_DP_RANK", 0)
        mp.setattr(torch, "tensor", tensor_without_pinning)
        yield


@pytest.fixture()
def cuda_topk1(monkeypatch):
    """Take the CUDA ``draft_topk1_postprocess`` branch with pure-torch STAND-INs for its two Triton kernels."""
    from sglang.srt.speculative import eagle_worker_v2

    if not hasattr(eagle_worker_v2, dlr.POSTPROCESS):
        return False
    from sglang.kernels.ops.speculative import topk1

    def partial_argmax(grid, logits, partial_vals, partial_indices, row_stride, vocab_size, num_splits, **_):
        rows, block = grid[0], _["BLOCK"]
        for split in range(num_splits):
            chunk = logits[:rows, split * block : min((split + 1) * block, vocab_size)].float()
            chunk = torch.where(chunk == chunk, chunk, torch.full_like(chunk, -1e30))
            vals, idx = chunk.max(dim=1)
            partial_vals[:rows, split] = vals
            partial_indices[:rows, split] = (idx + split * block).to(partial_indices.dtype)

    def finalize(grid, partial_vals, partial_indices, topk_p, topk_index, positions, draft_tokens, stride, column,
                 num_splits, **kw):  # fmt: skip
        rows = grid[0]
        split = partial_vals[:rows].argmax(dim=1, keepdim=True)
        index = partial_indices[:rows].gather(1, split).squeeze(1).long()
        topk_index.view(-1)[:rows] = index
        topk_p.view(-1)[:rows] = 1.0
        if kw["WRITE_DRAFT_TOKEN"]:
            draft_tokens[:rows, column] = index
        positions[:rows] += 1  # the kernel reads/writes positions + row for every row of the grid

    class Launcher:  # STAND-IN for a Triton JIT function: ``kernel[grid](*args, **meta)``
        def __init__(self, fn: Any) -> None:
            self.fn = fn

        def __getitem__(self, grid: tuple[int, ...]) -> Any:
            return lambda *args, **kwargs: self.fn(grid, *args, **kwargs)

    monkeypatch.setattr(topk1, "_draft_topk1_partial_argmax_kernel", Launcher(partial_argmax))
    monkeypatch.setattr(topk1, "_draft_topk1_finalize_kernel", Launcher(finalize))
    monkeypatch.setattr(eagle_worker_v2, "_is_cuda", True)
    return True


class DraftModelStandIn:
    """STAND-IN for the draft model forward: row-wise, so padding rows never change real rows."""

    def __init__(self) -> None:
        self.rows_seen: list[int] = []

    def execute(self, forward_batch: Any, pp_proxy_tensors: Any = None) -> Any:
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput

        ids = forward_batch.input_ids.long()
        pos = forward_batch.positions.long()
        hidden_in = forward_batch.spec_info.hidden_states
        assert ids.shape[0] == pos.shape[0] == hidden_in.shape[0]
        self.rows_seen.append(ids.shape[0])
        target = (ids * 3 + pos) % V
        logits = -((torch.arange(V).view(1, V) - target.view(-1, 1)) ** 2).float()
        hidden_out = hidden_in + (ids + pos).view(-1, 1).float()
        return LogitsProcessorOutput(next_token_logits=logits, hidden_states=hidden_out)


def draft_runner() -> Any:
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from transformers import PretrainedConfig

    from sglang_dp_mtp_fix.harness.rank import ModelRunnerStandIn

    class DraftRunnerStandIn(ModelRunner):
        def __init__(self) -> None:  # the real __init__ loads a model
            pass

        def __getattr__(self, name: str) -> Any:  # optional features off (LoRA, hisparse, dwdp, canaries, ...)
            return getattr(ModelRunnerStandIn(), name)

        def forward(self, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
            return ModelRunner._forward_raw(self, forward_batch, None)

    runner = DraftRunnerStandIn()
    model = DraftModelStandIn()
    fill = SimpleNamespace(get_cpu_graph_seq_len_fill_value=lambda: 1, get_cuda_graph_seq_len_fill_value=lambda: 1)
    for name, value in dict(
        device="cpu", is_draft_worker=True, decode_cuda_graph_runner=None, prefill_cuda_graph_runner=None,
        hisparse_coordinator=None, req_to_token_pool=None, canary_manager=None, eager_runner=model,
        attn_backend=fill, pp_group=SimpleNamespace(is_last_rank=True),
        spec_algorithm=SpeculativeAlgorithm.from_string("EAGLE"),
        model_config=ModelRunnerStandIn(  # a model config without optional features (no mrope, no linear attn)
            hf_config=PretrainedConfig(architectures=["DeepseekV3ForCausalLMNextN"]), linear_attn_registry_result=None
        ),
    ).items():  # fmt: skip
        object.__setattr__(runner, name, value)
    return runner


def draft_worker(runner: Any) -> Any:
    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker

    worker = object.__new__(EagleDraftWorker)  # the real __init__ loads the draft model on a GPU
    for name, value in dict(
        topk=1, speculative_num_steps=STEPS, hot_token_id=None, index_share_for_mtp_iteration=False,
        seed_dsa_topk_from_draft_extend=False, draft_runner=runner,
        draft_attn_backend=SimpleNamespace(attn_backends=[None] * STEPS),
        _topk1_parents_prealloc=torch.arange(64), _topk1_score_indices_prealloc=torch.arange(64),
        server_args=SimpleNamespace(speculative_use_rejection_sampling=False),  # <= 0.5.16 reads it here
    ).items():  # fmt: skip
        setattr(worker, name, value)
    return worker


def draft_forward_batch(runner: Any, num_reqs: int, global_num_tokens: list[int] | None) -> Any:
    """What ``prepare_for_draft`` hands ``draft_forward``: the real ``ForwardBatch.init_new`` on a decode/idle batch."""
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    from sglang_dp_mtp_fix.harness.rank import decode_tensors

    reqs = [Req(f"r{i}", "", array("i", [1, 2, 3, 4]), SamplingParams(max_new_tokens=8)) for i in range(num_reqs)]
    mode = ForwardMode.DECODE if num_reqs else ForwardMode.IDLE
    batch = ScheduleBatch(reqs=reqs, forward_mode=mode, spec_algorithm=runner.spec_algorithm)
    decode_tensors(batch)
    batch.seq_lens = torch.tensor([7 + 10 * i for i in range(num_reqs)], dtype=torch.int64)
    batch.seq_lens_cpu = batch.seq_lens.clone()
    batch.out_cache_loc = torch.arange(num_reqs * STEPS, dtype=torch.int64) + 100
    if num_reqs:
        spec = EagleDraftInput(
            topk_p=torch.ones((num_reqs, 1)), topk_index=torch.arange(num_reqs).view(num_reqs, 1) + 1,
            hidden_states=torch.arange(num_reqs * H, dtype=torch.float32).view(num_reqs, H),
            bonus_tokens=torch.zeros((num_reqs,), dtype=torch.long),
        )  # fmt: skip
    else:
        wanted = inspect.signature(EagleDraftInput.create_idle_input).parameters
        offered = dict(
            device="cpu", hidden_size=H, dtype=torch.float32, topk=1, capture_hidden_mode=CaptureHiddenMode.LAST
        )
        spec = EagleDraftInput.create_idle_input(**{k: v for k, v in offered.items() if k in wanted})
    spec.num_tokens_per_req = 1
    spec.num_tokens_for_logprob_per_req = 1
    spec.positions = batch.seq_lens.repeat_interleave(1, dim=0)  # as prepare_for_draft does
    spec.capture_hidden_mode = CaptureHiddenMode.LAST
    batch.spec_info = spec
    if global_num_tokens is not None:
        batch.global_num_tokens = list(global_num_tokens)
        batch.global_num_tokens_for_logprob = list(global_num_tokens)
    offered = {"capture_hidden_mode": CaptureHiddenMode.LAST, "return_hidden_states_before_norm": False}
    accepted = inspect.signature(inspect.unwrap(ForwardBatch.init_new)).parameters
    kwargs = {k: v for k, v in offered.items() if k in accepted}
    if "capture_hidden_mode" not in accepted:  # 0.5.15.post1: read from the batch
        batch.capture_hidden_mode = CaptureHiddenMode.LAST
    return ForwardBatch.init_new(batch, runner, **kwargs)


def run_draft(num_reqs: int, global_num_tokens: list[int] | None) -> dict[str, Any]:
    runner = draft_runner()
    worker = draft_worker(runner)
    forward_batch = draft_forward_batch(runner, num_reqs, global_num_tokens)
    _, _, draft_tokens, _ = worker.draft_forward(forward_batch)
    return {
        "draft_tokens": draft_tokens,
        "positions": forward_batch.positions,
        "rows_seen": runner.eager_runner.rows_seen,
        "record_left": dlr.LOCAL_ROWS_ATTR in forward_batch.__dict__,
    }


def apply_patch(plugin: Any, monkeypatch: pytest.MonkeyPatch) -> bool:
    """The patch applied through the plugin where it applies (True); elsewhere its wrappers installed directly
    (False), so the patched path is tested on every release even where the plugin stands it down."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    outcomes = {o.id: o.status.value for o in plugin.register()}
    if outcomes[dlr.DraftLocalRows.id] == "applied":
        return True
    resolved = {}
    for target in (dlr.PREPARE, dlr.POST_FORWARD):
        attr = target.qualname.split(".")[-1]
        resolved[target] = Resolved(target, ForwardBatch, attr, ForwardBatch.__dict__[attr], True)
    from sglang_dp_mtp_fix.config import Config

    for target, new in dlr.DraftLocalRows().replacements(resolved, Config()).items():
        monkeypatch.setattr(ForwardBatch, resolved[target].attr, new)
    return False


@pytest.fixture()
def patched(restored, monkeypatch):
    return apply_patch(restored, monkeypatch)


def test_classification_matches_the_code():
    from sglang.srt.speculative import eagle_worker_v2

    uses_postprocess = hasattr(eagle_worker_v2, dlr.POSTPROCESS)
    has_idle_path = hasattr(eagle_worker_v2.EagleDraftWorker, dlr.IDLE_DRAFT)
    assert dlr.draft_code_shape() == (uses_postprocess, has_idle_path)
    expected_applied = uses_postprocess and not has_idle_path
    assert (dlr.local_rows_verdict() is None) is expected_applied
    if SGLANG_VERSION in ("0.5.14", "0.5.15", "0.5.15.post1", *APPLIED, "0.5.19", "0.5.20", "0.5.21", "0.5.23"):
        assert expected_applied is (SGLANG_VERSION in APPLIED)


def test_only_eager_draft_decode_batches_are_recorded_and_the_record_is_consumed(mocker):
    """Target-verify / draft-extend / plain batches are never touched; each prepare replaces the record; the matching
    post_forward consumes it (the originals are recording fakes here: the gating is the wrapper's own logic)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.spec_info import SpecInputType

    originals = mocker.Mock()  # one parent: its mock_calls keep the order of both originals' calls
    resolved = {
        dlr.PREPARE: Resolved(dlr.PREPARE, None, "prepare", originals.prepare, True),
        dlr.POST_FORWARD: Resolved(dlr.POST_FORWARD, None, "post", originals.post, True),
    }
    from sglang_dp_mtp_fix.config import Config

    new = dlr.DraftLocalRows().replacements(resolved, Config())
    prepare, post_forward = new[dlr.PREPARE], new[dlr.POST_FORWARD]

    def forward(spec_type: Any, mode: Any) -> Any:
        spec = None if spec_type is None else SimpleNamespace(spec_input_type=spec_type)
        fb = SimpleNamespace(spec_info=spec, forward_mode=mode, input_ids=torch.ones(1), positions=torch.arange(3))
        out = SimpleNamespace(next_token_logits=torch.randn(3, V), hidden_states=torch.randn(3, H))
        prepare(fb, None)
        recorded = fb.__dict__.get(dlr.LOCAL_ROWS_ATTR)
        post_forward(fb, out)
        assert dlr.LOCAL_ROWS_ATTR not in fb.__dict__
        return recorded, out.next_token_logits.shape[0], fb.positions.shape[0]

    assert forward(SpecInputType.EAGLE_DRAFT, ForwardMode.DECODE) == (1, 1, 1)
    assert forward(SpecInputType.EAGLE_DRAFT, ForwardMode.IDLE) == (1, 1, 1)
    assert forward(SpecInputType.EAGLE_VERIFY, ForwardMode.TARGET_VERIFY) == (None, 3, 3)
    assert forward(SpecInputType.EAGLE_VERIFY, ForwardMode.IDLE) == (None, 3, 3)
    assert forward(SpecInputType.EAGLE_DRAFT_EXTEND, ForwardMode.DRAFT_EXTEND_V2) == (None, 3, 3)
    assert forward(SpecInputType.EAGLE_DRAFT_EXTEND, ForwardMode.IDLE) == (None, 3, 3)
    assert forward(None, ForwardMode.DECODE) == (None, 3, 3)
    assert [name for name, _, _ in originals.mock_calls] == ["prepare", "post"] * 7
    # a draft batch whose logits came back short: the PR's clear error, naming the tensor and both counts
    draft = SimpleNamespace(spec_input_type=SpecInputType.EAGLE_DRAFT)
    fb = SimpleNamespace(
        spec_info=draft, forward_mode=ForwardMode.DECODE, input_ids=torch.ones(2), positions=torch.arange(3)
    )
    prepare(fb, None)
    short = SimpleNamespace(next_token_logits=torch.randn(1, V), hidden_states=torch.randn(3, H))
    with pytest.raises(RuntimeError, match="EAGLE draft next_token_logits has 1 rows, but 2 local tokens"):
        post_forward(fb, short)


def test_idle_rank_stock(dp_rank, cuda_topk1, restored):
    """Stock, DP rank idle while the peer has 3 tokens. 0.5.16-0.5.18: the assert of the PR. 0.5.15.post1 (argmax)
    and 0.5.19+ (``_draft_forward_idle``): the step completes, which is why the plugin stands down there."""
    from sglang.srt.speculative import eagle_worker_v2

    if SGLANG_VERSION in APPLIED:
        with pytest.raises(AssertionError) as exc:
            run_draft(0, [0, 3])
        assert exc.traceback[-1].name == dlr.POSTPROCESS
        assert "positions.shape[0] == next_token_logits.shape[0]" in str(exc.traceback[-1].statement)
        return
    out = run_draft(0, [0, 3])
    assert out["rows_seen"] == [PADDED_ROWS] * (STEPS - 1)  # the padded forwards really ran (collectives)
    if hasattr(eagle_worker_v2.EagleDraftWorker, dlr.IDLE_DRAFT):
        assert out["draft_tokens"] is None  # idle outputs are never built
    else:
        assert out["draft_tokens"].shape == (0, STEPS)
        assert out["positions"].shape[0] == PADDED_ROWS  # stale rows, but nothing matches them against logits


def test_idle_rank_patched(dp_rank, cuda_topk1, patched):
    """Patched: every consumed tensor has 0 rows (the PR's idle case), the padded forwards still ran."""
    from sglang.srt.speculative import eagle_worker_v2

    out = run_draft(0, [0, 3])
    assert out["rows_seen"] == [PADDED_ROWS] * (STEPS - 1)
    assert not out["record_left"]
    if hasattr(eagle_worker_v2.EagleDraftWorker, dlr.IDLE_DRAFT):
        assert out["draft_tokens"] is None
    else:
        assert out["draft_tokens"].shape == (0, STEPS)
        assert out["positions"].shape == (0,)


@pytest.mark.parametrize("arm", ["stock", "patched"])
def test_active_rank_rows_bit_identical_to_unpadded(dp_rank, cuda_topk1, restored, monkeypatch, arm):
    """An active rank (1 token, peer 3): draft tokens and advanced positions equal the unpadded computation exactly,
    stock and patched (the patch changes nothing where SGLang's DECODE trim is already right)."""
    baseline = run_draft(1, None)  # no DP sync: no padding (graph-mode-like: prepare/post_forward never run)
    assert baseline["rows_seen"] == [1] * (STEPS - 1)
    if arm == "patched":
        apply_patch(restored, monkeypatch)
    out = run_draft(1, [1, 3])
    assert out["rows_seen"] == [PADDED_ROWS] * (STEPS - 1)
    assert torch.equal(out["draft_tokens"], baseline["draft_tokens"])
    assert torch.equal(out["positions"], baseline["positions"])
    assert out["positions"].tolist() == [7 + STEPS - 1]
    assert not out["record_left"]
