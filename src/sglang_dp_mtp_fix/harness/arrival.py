"""A PD arrival on the decode side, through SGLang's own code: the transfer's commit, then the PD draft input.

REAL SGLang (unmodified, from the installed release): ``MetadataBuffers`` (the PD metadata as the transfer leaves it:
a seedless prefill's DSA row all -1), ``DecodeTransferQueue._commit_transfer_to_req`` (wrapped by ``arrival_seed``
when it applies), ``DecodeRequest``, ``Req``, ``ScheduleBatch`` and ``build_eagle_disagg_draft_input``.
STAND-INs, each holding only what the real code reads: the transfer queue is the real class built without
``__init__`` (it needs a KV manager and a gloo group), its scheduler a ``SimpleNamespace`` (the model's DSA config,
0.5.20+'s reasoning-token hook, the transfer backend up to 0.5.19, 0.5.23's KV checksums off), the KV receiver
(``clear`` only), the batch's model config, the speculative settings the builder reads (an EAGLE decode with top-k
1, no rejection sampling: ``server_args`` up to 0.5.19, ``get_spec()`` from 0.5.20, swapped in for the call only),
and the future map (``publish``/``stash``: its device buffers need a model's shapes).
"""

from __future__ import annotations

import inspect
from array import array
from types import SimpleNamespace
from typing import Any

from sglang_dp_mtp_fix.harness.context import CONTEXT, parameters

ROOM = 4242  # the transfer's bootstrap room, as the prefill wrote it with the metadata
FIRST_TOKEN = 7  # the prefill's handoff token


def dsa_hf_config(index_topk: int) -> Any:
    """STAND-IN for a GLM-5 DSA config with MTP IndexShare (the fields SGLang's seed helpers read)."""
    return SimpleNamespace(
        architectures=["GlmMoeDsaForCausalLM"], index_share_for_mtp_iteration=True, index_topk=index_topk
    )


def metadata_buffers(width: int, size: int = 4) -> Any:
    """SGLang's real PD metadata buffers with a DSA seed row of ``width`` (0: none)."""
    import torch
    from sglang.srt.disaggregation.utils import MetadataBuffers

    kw = dict(
        size=size, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=16,
        output_dsa_topk_indices_dim=width,
    )  # fmt: skip
    params = inspect.signature(MetadataBuffers.__init__).parameters
    return MetadataBuffers(**{k: v for k, v in kw.items() if k in params})


def transfer_queue(buffers: Any, index_topk: int, speculative: bool = True) -> Any:
    """The real ``DecodeTransferQueue`` class around ``buffers``, built without ``__init__`` (STAND-IN scheduler)."""
    from sglang.srt.disaggregation.decode import DecodeTransferQueue
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    queue = object.__new__(DecodeTransferQueue)
    queue.metadata_buffers = buffers
    queue.spec_algorithm = SpeculativeAlgorithm.from_string("EAGLE" if speculative else "NONE")
    queue.scheduler = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=dsa_hf_config(index_topk)),
        batch_result_processor=SimpleNamespace(_maybe_update_reasoning_tokens=lambda *args: None),
        server_args=SimpleNamespace(disaggregation_transfer_backend="mooncake"),  # up to 0.5.19's fake-transfer test
        kv_checksum_computer=None,  # 0.5.23: no KV checksums
    )
    return queue


def arrive(queue: Any, prompt_len: int, slot: int = 0, rid: str = "arrival", seed: Any = None, room: int = ROOM) -> Any:
    """One transferred request committed by SGLang's ``_commit_transfer_to_req``: the metadata as a prefill left it
    (``seed``: the DSA row it sent; None: a seedless prefill, the row stays -1; ``room``: the bootstrap room the
    metadata carries, another than the request's is a corrupted transfer). Returns the ``Req``."""
    from sglang.srt.disaggregation.decode import DecodeRequest
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    buffers = queue.metadata_buffers
    buffers.bootstrap_room[slot][0] = room
    buffers.output_ids[slot][0] = FIRST_TOKEN
    if buffers.output_dsa_topk_indices is not None:
        buffers.output_dsa_topk_indices[slot].fill_(-1)
        if seed is not None:
            buffers.output_dsa_topk_indices[slot][: len(seed)] = seed
    req = Req(rid, "", array("i", [1] * prompt_len), SamplingParams(max_new_tokens=8))
    req.bootstrap_host, req.bootstrap_room = "10.0.0.2", ROOM  # a real (not fake) transfer
    decode_req = DecodeRequest(req=req, kv_receiver=SimpleNamespace(clear=lambda: None), metadata_buffer_index=slot)
    queue._commit_transfer_to_req(decode_req)
    return req


def pd_draft_input(reqs: list[Any], index_topk: int, overlap: bool) -> Any:
    """SGLang's own ``build_eagle_disagg_draft_input`` over a prebuilt batch of ``reqs`` (on CPU: no remap to
    local slots). The batch carries what the builder reads; its seq_lens are the requests' KV lengths."""
    import torch
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.speculative import eagle_disaggregation
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    n = len(reqs)
    batch = ScheduleBatch(reqs=list(reqs), spec_algorithm=SpeculativeAlgorithm.from_string("EAGLE"))
    batch.device = CONTEXT.device
    batch.enable_overlap = overlap
    batch.model_config = SimpleNamespace(hf_config=dsa_hf_config(index_topk))
    batch.req_pool_indices = torch.arange(n, dtype=torch.int64)
    batch.seq_lens = torch.tensor(
        [len(r.origin_input_ids) + max(0, len(r.output_ids) - 1) for r in reqs], dtype=torch.int64
    )
    future_map = SimpleNamespace(publish=lambda *args: None, stash=lambda *args: None)
    last_tokens = torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.int64)
    spec = SimpleNamespace(
        speculative_eagle_topk=1, enable_multi_layer_eagle=False, speculative_num_steps=3,
        speculative_use_rejection_sampling=False,
    )  # fmt: skip
    build = eagle_disaggregation.build_eagle_disagg_draft_input
    kwargs: dict[str, Any] = {"last_tokens_tensor": last_tokens, "future_map": future_map}
    if "server_args" in parameters("build_eagle_disagg_draft_input", build):  # up to 0.5.19
        return build(batch, server_args=spec, **kwargs)
    published = eagle_disaggregation.get_spec  # 0.5.20+: the process's published speculative settings
    eagle_disaggregation.get_spec = lambda: spec
    try:
        return build(batch, **kwargs)
    finally:
        eagle_disaggregation.get_spec = published
