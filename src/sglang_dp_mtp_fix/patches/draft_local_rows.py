"""draft_local_rows — eager EAGLE draft steps hand post-processing only the rank's own draft-token rows.

Why:      Under DP attention an eager draft step runs through ``ModelRunner``'s MLP-sync padding: the
          ``ForwardBatch`` is padded to the DP group's row count (``prepare_mlp_sync_batch``) and trimmed back after the
          forward (``post_forward_mlp_sync_batch``). The trim of a draft batch follows its forward mode: DECODE trims
          positions, logits and hidden states to the rows of the hidden states that went in, but IDLE trims logits and
          hidden states to the batch size (0) and leaves ``positions`` padded. Up to 0.5.18 an idle DP rank runs the
          full eager draft loop, so on CUDA ``draft_topk1_postprocess`` receives 0 logit rows with N padded position
          rows and fails ``assert positions.shape[0] == next_token_logits.shape[0]``. Once the group agrees on eager
          (``draft_graph_vote``), every idle rank reaches this on a seedless round (#32209, third failure mode).
How:      Two wrappers on ``ForwardBatch``, which is what ``EagleDraftWorker.draft_forward`` gets back from
          ``self.draft_runner.forward(forward_batch)``: the PR's slice, placed at the end of that forward and not in a
          copy of ``draft_forward``:
            * ``prepare_mlp_sync_batch``: for an EAGLE draft-input DECODE/IDLE batch, remember the local draft-token
              rows ``input_ids.shape[0]`` (the PR's ``num_local_tokens``) before SGLang pads them;
            * ``post_forward_mlp_sync_batch``: after SGLang's own trim, slice ``logits_output.next_token_logits``,
              ``logits_output.hidden_states`` and ``self.positions`` to that count (prefix views: no copy, no device
              sync), and forget it. A tensor with fewer rows raises the PR's ``RuntimeError`` naming it.
          The record lives on the ForwardBatch object and is replaced by every ``prepare`` and consumed by the
          matching ``post_forward``, so a ForwardBatch reused across draft steps never reads a previous step's count.
          Target-verify and draft-extend batches (other spec-input types / modes) are not recorded, so not touched.
          CUDA-graph replay and capture never call ``prepare_mlp_sync_batch`` (no ``global_num_tokens_cpu``): no-op.
          Applied from a post-import hook when ``model_runner`` is imported (``Patch.deferred_until_import``): its
          premises live there, and a scheduler imports it only after ``load_plugins()``, when it builds its
          ``ModelRunner`` (before any forward). Checking them at load imported ``model_runner`` inside
          ``load_plugins()`` (~23 ms of a 53 ms warm activation on 0.5.17) and in processes that never run a model
          (the launcher). ``not-loaded`` until then; everything the hook resolves besides ``model_runner`` is already
          imported by then (``forward_batch_info`` by ``model_runner``; ``eagle_worker_v2`` is in ``sys.modules`` after
          load, seen on 0.5.17 with the vote group applied and skipped).
Releases: applied on 0.5.16 – 0.5.18 (``draft_topk1_postprocess`` + idle ranks in the full eager loop).
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
from sglang_dp_mtp_fix.errors import DraftRowsError as DraftRowsError
from sglang_dp_mtp_fix.patches._detect import module_tree
from sglang_dp_mtp_fix.versions import sglang_version

FORWARD_BATCH = "sglang.srt.model_executor.forward_batch_info"
MODEL_RUNNER = "sglang.srt.model_executor.model_runner"
EAGLE_V2 = "sglang.srt.speculative.eagle_worker_v2"
SPEC_INFO = "sglang.srt.speculative.spec_info"

PREPARE = Target(FORWARD_BATCH, "ForwardBatch.prepare_mlp_sync_batch")
POST_FORWARD = Target(FORWARD_BATCH, "ForwardBatch.post_forward_mlp_sync_batch")
# The premise of the seam, fingerprinted: the padding (hidden_states_backup), the eager forward that calls prepare
# then post_forward around the model, and the consumer of the rows.
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
