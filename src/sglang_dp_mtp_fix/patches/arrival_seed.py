"""arrival_seed — a seedless PD arrival gets a DSA top-k seed, so its draft step can replay the draft graph.

Why:      A PD arrival carries the prefill draft indexer's top-k at the last prompt token (GLM-5 DSA, MTP IndexShare).
          A prefill without speculative flags, or the fake transfer backend, sends none (all -1, which SGLang turns
          into ``None``): the draft step then runs eagerly, and the draft vote (the plugin's, or SGLang's own from
          0.5.21) makes the whole DP group eager for that round. Safe, but ~20 % of decode time. Where the prompt fits
          ``index_topk`` the true seed is known without the prefill: the top-k keeps every position.
How:      Wraps ``DecodeTransferQueue._commit_transfer_to_req``. After SGLang's own commit, a committed request left
          with ``output_dsa_topk_indices`` None, on a speculative decode whose metadata buffers carry the seed
          (``output_dsa_topk_indices``, width ``index_topk``), gets one row as the buffer gives it (int32, the
          buffer's device): positions ``[0, L)`` then -1, L the request's KV length as ``prepare_for_prebuilt``
          counts it. ``recent`` also seeds L > ``index_topk`` with ``recent_positions`` (a stand-in). SGLang's own
          ``build_eagle_disagg_draft_input`` then sees a seeded arrival (seed, future flag, 0.5.21+'s
          ``cuda_graph_compatible``). The target verifies every drafted token: outputs do not change, acceptance can.
Releases: a setting, ``SGLANG_DP_MTP_FIX_ARRIVAL_SEED`` (default off: ``disabled``). On: applied on 0.5.15.post1 –
          0.5.23 (on 0.5.21 – 0.5.23 beside SGLang's own vote); not-affected on 0.5.14, 0.5.15 (no PD seed).
Removable when: every prefill sends a seed (SGLang fills a seedless one itself), or the draft guard takes no seed.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from sglang_dp_mtp_fix.config import ARRIVAL_SEED_ENV, ArrivalSeed, Config
from sglang_dp_mtp_fix.core import Kind, Patch, Resolved, StandDown, Status, Target, TargetProblem
from sglang_dp_mtp_fix.sglang_versions import AFFECTED_RELEASES

DECODE = "sglang.srt.disaggregation.decode"
DISAGG_UTILS = "sglang.srt.disaggregation.utils"
DECODE_MIXIN = "sglang.srt.disaggregation.decode_schedule_batch_mixin"
EAGLE_DISAGG = "sglang.srt.speculative.eagle_disaggregation"

# The releases whose code this patch was written for: every one with a PD DSA seed, upstream's vote or not.
ARRIVAL_SEED_RELEASES = (*AFFECTED_RELEASES, "0.5.21", "0.5.22", "0.5.23")

COMMIT = Target(DECODE, "DecodeTransferQueue._commit_transfer_to_req")
# Premises (fingerprinted, never changed): a seeded arrival's row is one cloned int32 row of the metadata buffer
# (so the stand-in row is built like it); the batch's KV length of a request is ``len(origin_input_ids) +
# max(0, len(output_ids) - 1)`` (positions at or past it are refused by the remap to local slots); and the PD draft
# input takes its seed from ``req.output_dsa_topk_indices`` of every request (future flag, 0.5.21+'s
# ``cuda_graph_compatible``).
GET_BUF = Target(DISAGG_UTILS, "MetadataBuffers.get_buf", Kind.CHECK)
PREBUILT = Target(DECODE_MIXIN, "ScheduleBatchDisaggregationDecodeMixin.prepare_for_prebuilt", Kind.CHECK)
DRAFT_INPUT = Target(EAGLE_DISAGG, "build_eagle_disagg_draft_input", Kind.CHECK)


def recent_positions(length: int, index_topk: int) -> range:
    """STAND-IN seed of a prompt longer than ``index_topk``: its most recent ``index_topk`` positions. The true seed
    needs the prefill draft indexer's scores; the target verifies every drafted token, so a stand-in can only change
    acceptance, never the output. One function, so another choice can be measured in its place."""
    return range(length - index_topk, length)


def seed_positions(length: int, index_topk: int, mode: ArrivalSeed) -> range | None:
    """The positions of a seedless arrival's seed (None: it stays seedless). A prompt of ``length`` <= ``index_topk``
    has the exact seed ``[0, length)``: the DSA top-k keeps every position when there are no more than k."""
    if length <= 0 or index_topk <= 0 or mode is ArrivalSeed.OFF:
        return None
    if length <= index_topk:
        return range(length)
    return recent_positions(length, index_topk) if mode is ArrivalSeed.RECENT else None


def kv_length(req: Any) -> int:
    """The request's KV length as ``prepare_for_prebuilt`` sets it on the batch (``PREBUILT``)."""
    return len(req.origin_input_ids) + max(0, len(req.output_ids) - 1)


def index_topk_of(queue: Any) -> int | None:
    """The model's ``index_topk`` (DSA), from the scheduler the transfer queue belongs to; None when unknown."""
    model_config = getattr(getattr(queue, "scheduler", None), "model_config", None)
    value = getattr(getattr(model_config, "hf_config", None), "index_topk", None)
    return value if isinstance(value, int) and value > 0 else None


def seed_row(buffer: Any, positions: range) -> Any:
    """One seed row as ``MetadataBuffers.get_buf`` gives it: the buffer's width, dtype and device; -1 after
    ``positions``."""
    import torch

    row = torch.full((buffer.shape[1],), -1, dtype=buffer.dtype, device=buffer.device)
    row[: len(positions)] = torch.arange(positions.start, positions.stop, dtype=buffer.dtype, device=buffer.device)
    return row


def seed_arrival(queue: Any, req: Any, mode: ArrivalSeed) -> bool:
    """Give a committed seedless arrival its seed when this decode's spec worker seeds (True when it did)."""
    if getattr(req, "output_dsa_topk_indices", None) is not None:
        return False
    spec_algorithm = getattr(queue, "spec_algorithm", None)
    if spec_algorithm is None or spec_algorithm.is_none():
        return False
    buffer = getattr(getattr(queue, "metadata_buffers", None), "output_dsa_topk_indices", None)
    if buffer is None or buffer.dim() != 2 or buffer.shape[1] <= 0:
        return False
    index_topk = index_topk_of(queue)
    # A wider row (0.5.20+'s index_kpool > 1) holds pooled entries and tail tokens, not positions: left seedless.
    if index_topk is None or buffer.shape[1] != index_topk:
        return False
    positions = seed_positions(kv_length(req), index_topk, mode)
    if positions is None:
        return False
    req.output_dsa_topk_indices = seed_row(buffer, positions)
    return True


class ArrivalSeedPatch(Patch):
    id = "arrival_seed"
    targets = (COMMIT, GET_BUF, PREBUILT, DRAFT_INPUT)
    written_for = ARRIVAL_SEED_RELEASES
    # It makes the draft graph replay more often; the hang is fixed (or not) by the draft vote alone.
    fixes = False
    setting = ARRIVAL_SEED_ENV

    def switched_off(self, config: Config) -> str | None:
        if config.arrival_seed is ArrivalSeed.OFF:
            return f"off: {ARRIVAL_SEED_ENV} is off (the default); seedless PD arrivals stay seedless"
        return None

    def classify(self) -> None:
        try:
            from sglang.srt.disaggregation.utils import MetadataBuffers
        except Exception as exc:  # noqa: BLE001
            raise TargetProblem(f"{DISAGG_UTILS} cannot be imported ({type(exc).__name__}: {exc})") from exc
        if "output_dsa_topk_indices_dim" not in inspect.signature(MetadataBuffers.__init__).parameters:
            raise StandDown(
                Status.NOT_AFFECTED,
                "this SGLang's PD metadata carries no DSA top-k seed (MetadataBuffers has no output_dsa_topk_indices; "
                "first released in 0.5.15.post1), so no arrival lacks one",
            )

    def replacements(self, resolved: dict[Target, Resolved], config: Config) -> dict[Target, Any]:
        commit = resolved[COMMIT].raw
        mode = config.arrival_seed

        @functools.wraps(commit)
        def _commit_transfer_to_req(self: Any, decode_req: Any, *args: Any, **kwargs: Any) -> Any:
            req = decode_req.req
            before = len(req.output_ids)
            result = commit(self, decode_req, *args, **kwargs)
            if len(req.output_ids) > before:  # committed (an aborted transfer returns before appending its token)
                seed_arrival(self, req, mode)
            return result

        return {COMMIT: _commit_transfer_to_req}
