"""Feature detection shared by the dp_draft_vote group: is the installed SGLang affected, fixed, or neither?

Decided from the code, not from the version string (dev builds and forks lie).
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect

from sglang_dp_mtp_fix.core import StandDown, Status, TargetProblem
from sglang_dp_mtp_fix.sglang_versions import sglang_version


def _has_seedless_eager_fallback(draft_fn: object) -> bool:
    """True when ``EagleDraftWorker.draft`` drops to eager for a missing DSA seed (``dsa_topk_indices is None``)."""
    source = inspect.getsource(inspect.unwrap(draft_fn))  # type: ignore[arg-type]
    tree = ast.parse("if 1:\n" + source if source[:1].isspace() else source)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Compare)
            and isinstance(node.left, ast.Attribute)
            and node.left.attr == "dsa_topk_indices"
            and len(node.ops) == 1
            and isinstance(node.ops[0], ast.Is)
            and isinstance(node.comparators[0], ast.Constant)
            and node.comparators[0].value is None
        ):
            return True
    return False


@functools.lru_cache(maxsize=1)
def dp_draft_vote_verdict() -> tuple[Status, str] | None:
    """None when the group should be applied; else (superseded | not-affected, reason)."""
    try:
        dp_attn = importlib.import_module("sglang.srt.managers.scheduler_components.dp_attn")
        eagle_info = importlib.import_module("sglang.srt.speculative.eagle_info")
        eagle_worker_v2 = importlib.import_module("sglang.srt.speculative.eagle_worker_v2")
    except Exception as exc:  # noqa: BLE001
        raise TargetProblem(f"SGLang's DP/EAGLE modules cannot be imported ({type(exc).__name__}: {exc})") from exc
    version = sglang_version()
    sync_fields = getattr(dp_attn.MLPSyncBatchInfo, "__dataclass_fields__", {})
    input_fields = getattr(eagle_info.EagleDraftInput, "__dataclass_fields__", {})
    if "can_run_draft_cuda_graph" in sync_fields or "cuda_graph_compatible" in input_fields:
        return (
            Status.SUPERSEDED,
            f"SGLang {version} already carries an equivalent fix (EagleDraftInput.cuda_graph_compatible voted in "
            "the MLP-sync column can_run_draft_cuda_graph, checked by EAGLEDraftCudaGraphRunner; upstream 0.5.21+)",
        )
    worker = getattr(eagle_worker_v2, "EagleDraftWorker", None)
    # Its own definition: an inherited abstract ``draft`` (the method moved or renamed) is unknown code, not "no
    # seedless fallback" (which would stand the plugin down silently while the bug may be present).
    if worker is None or "draft" not in vars(worker):
        raise TargetProblem("sglang.srt.speculative.eagle_worker_v2:EagleDraftWorker.draft is missing")
    if "future_dsa_topk_indices_available" not in input_fields or not _has_seedless_eager_fallback(worker.draft):
        return (
            Status.NOT_AFFECTED,
            f"SGLang {version} has no seedless eager fallback in EagleDraftWorker.draft (introduced by #30839, "
            "first released in 0.5.15.post1), so ranks cannot split between draft graph and eager",
        )
    return None


def classify_group() -> None:
    verdict = dp_draft_vote_verdict()
    if verdict is not None:
        raise StandDown(*verdict)


def module_source(module: str) -> str | None:
    """A module's source text, read without importing the module. None when it cannot be found or read.

    For feature checks on releases where importing the module would pull in CUDA-only code (0.5.22+ also loads
    plugins in the detokenizer and DP-controller processes).
    """
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):  # a parent package fails to import: the source cannot be read either
        return None
    origin = getattr(spec, "origin", None) if spec is not None else None
    if not origin or not origin.endswith(".py"):
        return None
    try:
        with open(origin, encoding="utf-8") as fh:
            return fh.read()
    except (OSError, ValueError):
        return None


def _parse(source: str | None) -> ast.Module | None:
    try:
        return ast.parse(source) if source is not None else None
    except (SyntaxError, ValueError):
        return None


def module_tree(module: str) -> ast.Module | None:
    """A module's parsed source (no import); None when it cannot be found, read or parsed."""
    return _parse(module_source(module))


def module_defines(module: str, name: str) -> bool | None:
    """Whether ``module``'s source defines ``name`` at top level (None: source unreadable); no import.

    The name is looked for in the text first: parsing a module as large as dsa_backend would dominate activation, and
    on the releases this plugin patches the name is absent.
    """
    source = module_source(module)
    if source is None:
        return None
    if name not in source:
        return False
    tree = _parse(source)  # the text already read, not a second read of the file
    if tree is None:
        return None
    return any(
        isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name
        for node in tree.body
    )
