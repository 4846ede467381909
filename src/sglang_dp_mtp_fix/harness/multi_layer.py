"""``--enable-multi-layer-eagle``'s eager draft-extend on one DP rank, through SGLang's real code: the per-rank counts
it indexes (``tests/test_draft_token_counts.py``, stock and with the plugin). The deployments and answers are
``draft_counts``'."""

from __future__ import annotations

import inspect
from array import array
from types import SimpleNamespace
from typing import Any

from sglang_dp_mtp_fix.harness.draft_counts import GatheredSyncInfoStandIn, TorchNativeView, gather_answers, server_args
from sglang_dp_mtp_fix.harness.standins import ModelRunnerStandIn, decode_tensors


def multi_layer_draft_extend(target: str, draft: str, counts: tuple[int, ...], rank: int) -> dict[str, Any]:
    """``--enable-multi-layer-eagle``'s eager draft-extend on DP rank ``rank`` (0.5.16-0.5.20: 0.5.15.post1 prepares
    it inside the worker; stock, or with the plugin applied), up to the value that indexes the per-rank counts.

    REAL: ``_update_gather_batch`` with the scheduler's answer; ``prepare_for_draft_extend`` (what
    ``MultiLayerEagleDraftWorker._draft_extend_for_decode`` calls) with an ``EagleDraftExtendInput`` of its width
    (``speculative_num_steps + 1`` = 4 rows per request, 1 for logprobs) and ``ForwardBatch.init_new`` with the draft
    model runner; ``ForwardBatch.set_local_num_token_non_padded`` (0.5.18+; before it
    ``adjust_num_token_non_padded_for_attn_tp``: what the model runner calls on the eager path), outside
    ``speculative_moe_a2a_backend_context`` as the multi-layer worker runs.
    STAND-INS: the harness's ``ModelRunnerStandIn`` (the torch_native attention backend: positions on CPU) and decode
    tensors; ``GatheredSyncInfoStandIn``; this rank's attention DP rank and size through SGLang's own
    ``get_parallel().override`` (the groups need the peer ranks); ``batch.model_config`` (its vocab size only);
    ``enable_num_token_non_padded`` as the tests set it (EP world > 1)."""
    import torch
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.scheduler_components.dp_attn import _update_gather_batch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative import eagle_worker_common
    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    sa = server_args(target, draft, world=len(counts), rank=rank, multi_layer=True)
    target_gather, _ = gather_answers(sa)

    algo = SpeculativeAlgorithm.from_string("EAGLE")
    local = counts[rank]
    reqs = [Req(f"r{rank}-{i}", "", array("i", [1, 2, 3, 4]), SamplingParams(max_new_tokens=8)) for i in range(local)]
    batch = ScheduleBatch(reqs=reqs, forward_mode=ForwardMode.DECODE, spec_algorithm=algo)
    _update_gather_batch(batch, GatheredSyncInfoStandIn(local, list(counts)), target_gather)
    decode_tensors(batch)
    batch.model_config = SimpleNamespace(vocab_size=1000)
    width = 4
    extend_input = EagleDraftExtendInput(
        hidden_states=None, num_tokens_per_req=width, num_tokens_for_logprob_per_req=1, num_front_tokens=0
    )
    runner = ModelRunnerStandIn(
        device="cpu", spec_algorithm=algo, is_draft_worker=True, prefill_attention_backend_str="torch_native",
        server_args=TorchNativeView(sa),  # <= 0.5.17 reads the attention backend there
    )  # fmt: skip
    from sglang.srt.runtime_context import get_parallel

    # This rank's place, through SGLang's own override of the parallel context (the groups need the peer ranks).
    with get_parallel().override(attn_dp_rank=rank, attn_dp_size=len(counts), attn_tp_size=1, attn_tp_rank=0):
        view = eagle_worker_common.prepare_for_draft_extend(
            extend_input, batch, torch.zeros(local * width, dtype=torch.int64), width, runner, None,
            return_hidden_states_before_norm=True,
        )  # fmt: skip
        row: dict[str, Any] = {"global_num_tokens_cpu": list(view.global_num_tokens_cpu)}
        try:
            if hasattr(view, "set_local_num_token_non_padded"):  # 0.5.20
                view.set_local_num_token_non_padded(sharded=False)
            elif inspect.signature(view.adjust_num_token_non_padded_for_attn_tp).parameters:  # <= 0.5.18
                view.adjust_num_token_non_padded_for_attn_tp(sa)
            else:  # 0.5.19 reads the parallel context instead of server_args
                view.adjust_num_token_non_padded_for_attn_tp()
            row["num_token_non_padded"] = int(view.num_token_non_padded)
        except IndexError as exc:
            row["error"] = f"IndexError: {exc}"
    return row
