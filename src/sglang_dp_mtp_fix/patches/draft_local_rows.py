"""draft_local_rows — eager EAGLE draft steps hand post-processing only the rank's own draft-token rows.

Why:      Under DP attention an eager draft step is padded to the DP group's row count and trimmed back after the
          forward, and the trim follows the forward mode: DECODE trims positions, logits and hidden states to the
          rows that went in, but IDLE trims logits and hidden states to 0 rows and leaves ``positions`` padded. Once
          the group agrees on eager (``draft_graph_vote``), an idle rank in the full eager draft loop hands
          ``draft_topk1_postprocess`` 0 logit rows with N position rows and fails ``assert positions.shape[0] ==
          next_token_logits.shape[0]`` (#32209, third failure mode).
How:      The PR's slice, placed at the end of the draft runner's forward instead of in a copy of ``draft_forward``:
          ``ForwardBatch.prepare_mlp_sync_batch`` records an EAGLE draft DECODE/IDLE batch's own rows
          (``input_ids.shape[0]``, the PR's ``num_local_tokens``) before SGLang pads them, and
          ``post_forward_mlp_sync_batch``, after SGLang's trim, slices ``next_token_logits``, ``hidden_states`` and
          ``positions`` to that count (prefix views: no copy, no device sync) and forgets it. Other batches are not
          recorded, so not touched; CUDA-graph capture and replay never call ``prepare_mlp_sync_batch``. Applied
          when ``model_runner`` is imported (``deferred_until_import``), where its premises live: checking them at
          load would import it in every process, the launcher's included.
Releases: applied on 0.5.16 – 0.5.18 (``draft_topk1_postprocess``, and idle ranks run the full eager draft loop).
          Not affected: 0.5.14 – 0.5.15.post1 (``torch.argmax`` + ``positions.add_(1)``: nothing needs the row counts
          to agree) and 0.5.19+ (idle ranks go through ``EagleDraftWorker._draft_forward_idle``, which never
          post-processes; on active ranks SGLang's DECODE trim already leaves exactly the local rows).
Removable when: the oldest supported release has ``_draft_forward_idle`` (0.5.19), or #32209's
          ``_slice_draft_output_to_local_tokens`` lands.
"""

from __future__ import annotations

import ast
import functools
from typing import Any

from sglang_dp_mtp_fix.config import Config
from sglang_dp_mtp_fix.core import Kind, Patch, Resolved, StandDown, Status, Target
from sglang_dp_mtp_fix.errors import DraftRowsError
from sglang_dp_mtp_fix.patches._detect import module_tree
from sglang_dp_mtp_fix.sglang_versions import sglang_version

FORWARD_BATCH = "sglang.srt.model_executor.forward_batch_info"
MODEL_RUNNER = "sglang.srt.model_executor.model_runner"
EAGLE_V2 = "sglang.srt.speculative.eagle_worker_v2"
SPEC_INFO = "sglang.srt.speculative.spec_info"

PREPARE = Target(FORWARD_BATCH, "ForwardBatch.prepare_mlp_sync_batch")
POST_FORWARD = Target(FORWARD_BATCH, "ForwardBatch.post_forward_mlp_sync_batch")
# Premises (fingerprinted, never changed): the padding (hidden_states_backup), the eager forward that calls prepare
# then post_forward around the model, and the consumer of the rows (draft_forward post-processes what
# draft_runner.forward returns, so the slice at the end of that forward reaches it).
PAD_INPUTS = Target(FORWARD_BATCH, "ForwardBatch._pad_inputs_to_size", Kind.CHECK)
EAGER_PREPARE = Target(MODEL_RUNNER, "ModelRunner._prepare_eager_forward_batch", Kind.CHECK)
EAGER_FORWARD = Target(MODEL_RUNNER, "ModelRunner._forward_raw", Kind.CHECK)
DRAFT_FORWARD = Target(EAGLE_V2, "EagleDraftWorker.draft_forward", Kind.CHECK)

LOCAL_ROWS_ATTR = "_dp_mtp_fix_local_draft_rows"
POSTPROCESS = "draft_topk1_postprocess"
IDLE_DRAFT = "_draft_forward_idle"


def slice_to_local_rows(tensor: Any, name: str, num_local_tokens: int) -> Any:
    """``tensor[:num_local_tokens]`` (a view); None stays None; too few rows raise the PR's RuntimeError."""
    if tensor is None:
        return None
    rows = tensor.shape[0]
    if rows < num_local_tokens:
        raise DraftRowsError(
            f"EAGLE draft {name} has {rows} rows, but {num_local_tokens} local tokens need postprocessing"
        )
    return tensor if rows == num_local_tokens else tensor[:num_local_tokens]


def slice_draft_output_to_local_tokens(
    next_token_logits: Any, hidden_states: Any, positions: Any, num_local_tokens: int
) -> tuple[Any, Any, Any]:
    """#32209's ``_slice_draft_output_to_local_tokens``: prefix views of the three draft outputs."""
    return (
        slice_to_local_rows(next_token_logits, "next_token_logits", num_local_tokens),
        slice_to_local_rows(hidden_states, "hidden_states", num_local_tokens),
        slice_to_local_rows(positions, "positions", num_local_tokens),
    )


# ---- classification (read from source, no import) --------------------------------------------------------------


def draft_code_shape() -> tuple[bool, bool] | None:
    """(eagle_worker_v2 uses draft_topk1_postprocess, EagleDraftWorker has _draft_forward_idle); None if unreadable.

    Read from the module's source without importing it (0.5.22+ also loads plugins in processes that must not import
    the CUDA-side speculative modules).
    """
    tree = module_tree(EAGLE_V2)
    if tree is None:
        return None
    uses_postprocess = any(
        isinstance(node, ast.ImportFrom) and any(alias.name == POSTPROCESS for alias in node.names)
        for node in ast.walk(tree)
    )
    worker = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EagleDraftWorker"), None)
    has_idle_path = worker is not None and any(
        isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == IDLE_DRAFT for n in worker.body
    )
    return uses_postprocess, has_idle_path


def local_rows_verdict() -> tuple[Status, str] | None:
    """None when the patch should be applied; else (not-affected, reason)."""
    shape = draft_code_shape()
    if shape is None:
        return None  # unknown code: let the target checks decide (a drifted target keeps SGLang stock)
    uses_postprocess, has_idle_path = shape
    version = sglang_version()
    if not uses_postprocess:
        return (
            Status.NOT_AFFECTED,
            f"SGLang {version}'s eager EAGLE draft step samples with torch.argmax and advances positions with add_(1) "
            f"(no {POSTPROCESS}), so padded position rows are never matched against logit rows",
        )
    if has_idle_path:
        return (
            Status.NOT_AFFECTED,
            f"SGLang {version} sends idle DP ranks through EagleDraftWorker.{IDLE_DRAFT} (never post-processed), "
            "and on active ranks post_forward_mlp_sync_batch already trims positions, logits and hidden states to "
            "the rank's draft-token rows",
        )
    return None


class DraftLocalRows(Patch):
    id = "draft_local_rows"
    requires = ()
    targets = (PREPARE, POST_FORWARD, PAD_INPUTS, EAGER_PREPARE, EAGER_FORWARD, DRAFT_FORWARD)
    # In time: a scheduler imports model_runner after load_plugins() and before any forward. Enough: the other
    # modules the hook resolves are imported by then (forward_batch_info by model_runner, eagle_worker_v2 at load).
    deferred_until_import = MODEL_RUNNER  # "not-loaded" until the scheduler imports it to build its ModelRunner

    def classify(self) -> None:
        verdict = local_rows_verdict()
        if verdict is not None:
            raise StandDown(*verdict)

    def replacements(self, resolved: dict[Target, Resolved], config: Config) -> dict[Target, Any]:
        import importlib

        eagle_draft = importlib.import_module(SPEC_INFO).SpecInputType.EAGLE_DRAFT
        prepare = resolved[PREPARE].raw
        post_forward = resolved[POST_FORWARD].raw

        def local_draft_rows(forward_batch: Any) -> int | None:
            """Rows of this rank's own draft tokens, for an EAGLE draft DECODE/IDLE batch; else None."""
            spec_info = forward_batch.spec_info
            if spec_info is None or getattr(spec_info, "spec_input_type", None) != eagle_draft:
                return None
            mode = forward_batch.forward_mode
            if not (mode.is_decode() or mode.is_idle()):
                return None
            input_ids = forward_batch.input_ids
            return None if input_ids is None else input_ids.shape[0]  # host int from the shape: no device sync

        @functools.wraps(prepare)
        def prepare_mlp_sync_batch(self: Any, *args: Any, **kwargs: Any) -> Any:
            # Replaced on every call, so a ForwardBatch reused across draft steps never carries a stale count.
            self.__dict__[LOCAL_ROWS_ATTR] = local_draft_rows(self)
            return prepare(self, *args, **kwargs)

        @functools.wraps(post_forward)
        def post_forward_mlp_sync_batch(self: Any, logits_output: Any, *args: Any, **kwargs: Any) -> Any:
            result = post_forward(self, logits_output, *args, **kwargs)
            num_local_tokens = self.__dict__.pop(LOCAL_ROWS_ATTR, None)
            if num_local_tokens is None:
                return result
            logits, hidden, positions = slice_draft_output_to_local_tokens(
                logits_output.next_token_logits, logits_output.hidden_states, self.positions, num_local_tokens
            )
            logits_output.next_token_logits = logits
            logits_output.hidden_states = hidden
            self.positions = positions
            return result

        return {PREPARE: prepare_mlp_sync_batch, POST_FORWARD: post_forward_mlp_sync_batch}
