"""future_seed_authority on the real EagleDraftInput (and its real merge_batch), incl. #32209's overlap case."""

from __future__ import annotations

import pytest
import torch
from support import affected_only

pytestmark = affected_only


def _input(seed: bool, future: bool | None = None, n: int = 2):
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    di = EagleDraftInput(
        topk_p=torch.ones((n, 1)), topk_index=torch.zeros((n, 1), dtype=torch.long),
        hidden_states=torch.zeros((n, 4)), bonus_tokens=torch.zeros((n,), dtype=torch.long),
        dsa_topk_indices=torch.zeros((n, 8), dtype=torch.int32) if seed else None,
    )  # fmt: skip
    if future is not None:
        di.future_indices = torch.arange(n)
        di.future_dsa_topk_indices_available = future
    return di


@pytest.mark.parametrize(
    ("seed", "future", "present"),
    [
        (True, None, True),  # materialized seed
        (False, None, False),  # no seed, no overlap
        (True, False, False),  # overlap: flag says no -> stale tensor ignored
        (False, True, True),  # overlap: flag says yes (tensor arrives at resolve time)
        (True, True, True),
        (False, False, False),
    ],
)
def test_future_flag_is_authoritative_whenever_future_indices_is_set(restored, seed, future, present):
    restored.register()
    assert _input(seed, future).has_dsa_topk_seed() is present


def test_seeded_running_batch_merged_with_seedless_prebuilt(restored):
    """#32209 test_seeded_running_batch_merged_with_seedless_prebuilt_forces_eager, on the real merge_batch."""
    restored.register()
    running = _input(seed=True, future=True)
    running.merge_batch(_input(seed=False, future=False, n=1))
    assert running.future_dsa_topk_indices_available is False
    assert running.dsa_topk_indices is not None  # the stale materialized tensor is still there
    assert running.has_dsa_topk_seed() is False


def test_method_is_gone_after_restore(restored):
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    restored.register()
    assert hasattr(EagleDraftInput, "has_dsa_topk_seed")
    restored.restore()
    assert not hasattr(EagleDraftInput, "has_dsa_topk_seed")
