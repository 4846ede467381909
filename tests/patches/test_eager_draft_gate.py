"""eager_draft_gate: the worker hook (PR #32209 predicate) and the PD-decode marking."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from support import affected_only

pytestmark = affected_only


def _batch(seed: bool, future: bool | None = None, idle: bool = False, spec: bool = True):
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.eagle_info import EagleDraftInput
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    batch = ScheduleBatch(
        reqs=[], forward_mode=ForwardMode.IDLE if idle else ForwardMode.DECODE,
        spec_algorithm=SpeculativeAlgorithm.from_string("EAGLE"),
    )  # fmt: skip
    if spec:
        di = EagleDraftInput(
            topk_p=torch.ones((1, 1)), topk_index=torch.zeros((1, 1), dtype=torch.long),
            dsa_topk_indices=torch.zeros((1, 4), dtype=torch.int32) if seed else None,
        )  # fmt: skip
        if future is not None:
            di.future_indices = torch.arange(1)
            di.future_dsa_topk_indices_available = future
        batch.spec_info = di
    return batch


def _worker(seed_from_draft_extend: bool | None):
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    worker = object.__new__(EAGLEWorkerV2)  # STAND-IN construction: __init__ loads a draft model on a GPU
    worker._draft_worker = (
        None
        if seed_from_draft_extend is None
        else SimpleNamespace(seed_dsa_topk_from_draft_extend=seed_from_draft_extend)
    )  # STAND-IN draft worker: only the seed flag is read
    return worker


@pytest.mark.parametrize(
    ("flag", "seed", "future", "eager"),
    [
        (True, False, None, True),  # seedless PD round -> rank-consistent eager
        (True, True, None, False),
        (True, False, True, False),  # seed arrives through the future map
        (True, True, False, True),  # stale tensor, flag False -> eager
        (True, False, False, True),
        (False, False, None, False),  # worker does not seed from draft-extend
        (None, False, None, False),  # non-last PP rank: no draft worker
    ],
)
def test_requires_dp_attention_eager_forward(restored, flag, seed, future, eager):
    restored.register()
    assert _worker(flag).requires_dp_attention_eager_forward(_batch(seed, future)) is eager


def test_idle_and_specless_batches_never_need_eager(restored):
    restored.register()
    worker = _worker(True)
    assert worker.requires_dp_attention_eager_forward(_batch(False, idle=True)) is False
    assert worker.requires_dp_attention_eager_forward(_batch(False, spec=False)) is False


def test_base_spec_worker_default_is_false_for_other_algorithms(restored):
    from sglang.srt.speculative.base_spec_worker import BaseSpecWorker

    restored.register()

    class OtherWorker(BaseSpecWorker):  # e.g. NGRAM / DFlash: inherit the default
        pass

    OtherWorker.__abstractmethods__ = frozenset()  # STAND-IN instance: the abstract worker API needs a model
    worker = object.__new__(OtherWorker)
    assert worker.requires_dp_attention_eager_forward(_batch(False)) is False


def test_hooks_are_gone_after_restore(restored):
    from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    restored.register()
    restored.restore()
    assert not hasattr(BaseSpecWorker, "requires_dp_attention_eager_forward")
    assert not hasattr(EAGLEWorkerV2, "requires_dp_attention_eager_forward")
