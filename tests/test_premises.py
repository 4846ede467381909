"""The co-located premise: outside PD decode the real draft-extend paths always set the DSA top-k seed.

This is why ``eager_draft_gate`` marks PD-decode rounds only: co-located decode never produces a seedless non-idle
draft input, so its ranks cannot split on the draft guard. The premise is fingerprinted
(``EagleDraftWorker._draft_extend_for_prefill`` / ``_draft_extend_for_decode`` are CHECK targets of
``eager_draft_gate``); this test pins *what* the fingerprinted code does, on the installed release's real source.

Weaker than driving the methods: they are checked at AST level, not executed. Executing them on CPU needs the
draft model's forward, ``prepare_for_draft_extend``'s KV/graph plumbing and, for the decode path, a verify result;
inside this issue's time box that harness was not built (see CHANGELOG). The assertions are structural and exact:
  * ``_draft_extend_for_prefill`` returns ``EagleDraftInput(..., dsa_topk_indices=<seed>)`` where ``<seed>`` is set
    to a non-None value under ``if seed_from_extend:``, and ``seed_from_extend`` is
    ``self.seed_dsa_topk_from_draft_extend and not <forward batch>.forward_mode.is_idle()``: with seeding on, only
    an idle batch goes seedless (idle batches never take the seedless guard).
  * ``_draft_extend_for_decode`` assigns ``next_draft_input.dsa_topk_indices`` under a top-level
    ``if self.seed_dsa_topk_from_draft_extend:``, from a value set on both the graph and the eager branch.
Each check is also run on a deliberately broken copy of the real source (seed dropped / made conditional), which it
must reject: that is how the test is seen failing.
"""

from __future__ import annotations

import ast
import inspect

import pytest
from support import affected_only

pytestmark = affected_only

SEED_FLAG = "seed_dsa_topk_from_draft_extend"


def _function(source: str) -> ast.FunctionDef:
    tree = ast.parse("if 1:\n" + source if source[:1].isspace() else source)
    node = tree.body[0].body[0] if source[:1].isspace() else tree.body[0]  # type: ignore[attr-defined]
    assert isinstance(node, ast.FunctionDef), type(node)
    return node


def _is_self_flag(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == SEED_FLAG
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def _is_not_idle(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.Not)
        and isinstance(node.operand, ast.Call)
        and isinstance(node.operand.func, ast.Attribute)
        and node.operand.func.attr == "is_idle"
    )


def _assigns(body: list[ast.stmt], target: str) -> list[ast.AST]:
    """Values assigned to ``target`` (a name or dotted attribute) by statements directly in ``body``."""
    return [
        stmt.value
        for stmt in body
        if isinstance(stmt, ast.Assign) and any(ast.unparse(t) == target for t in stmt.targets)
    ]


def prefill_always_seeds(fn: ast.FunctionDef) -> str | None:
    """None when the prefill draft-extend always seeds a non-idle batch; else what is wrong."""
    returns = [n for n in ast.walk(fn) if isinstance(n, ast.Return) and isinstance(n.value, ast.Call)]
    made = [r.value for r in returns if ast.unparse(r.value.func) == "EagleDraftInput"]  # type: ignore[union-attr]
    if len(made) != 1:
        return f"expected one `return EagleDraftInput(...)`, found {len(made)}"
    seed_kw = [k for k in made[0].keywords if k.arg == "dsa_topk_indices"]  # type: ignore[union-attr]
    if len(seed_kw) != 1 or not isinstance(seed_kw[0].value, ast.Name):
        return "the returned EagleDraftInput does not pass dsa_topk_indices=<name>"
    seed_name = seed_kw[0].value.id
    gate = _assigns(fn.body, "seed_from_extend")
    if len(gate) != 1:
        return "seed_from_extend is not assigned exactly once at the top level"
    cond = gate[0]
    if not (
        isinstance(cond, ast.BoolOp)
        and isinstance(cond.op, ast.And)
        and len(cond.values) == 2
        and _is_self_flag(cond.values[0])
        and _is_not_idle(cond.values[1])
    ):
        return f"seed_from_extend is `{ast.unparse(cond)}`, not `self.{SEED_FLAG} and not <batch>.is_idle()`"
    seeded = [
        v
        for stmt in fn.body
        if isinstance(stmt, ast.If) and ast.unparse(stmt.test) == "seed_from_extend" and not stmt.orelse
        for v in _assigns(stmt.body, seed_name)
        if not (isinstance(v, ast.Constant) and v.value is None)
    ]
    if len(seeded) != 1:
        return f"{seed_name} is not set to a value under a top-level `if seed_from_extend:`"
    later = [
        n for n in ast.walk(fn) if isinstance(n, ast.Assign) and any(ast.unparse(t) == seed_name for t in n.targets)
    ]
    if len(later) != 2:  # `<seed> = None` and the seeded assignment, nothing else
        return f"{seed_name} is assigned {len(later)} times (expected: None, then the seed)"
    return None


def decode_always_seeds(fn: ast.FunctionDef) -> str | None:
    """None when the decode draft-extend always sets next_draft_input.dsa_topk_indices when seeding is on."""
    setters = [
        stmt
        for stmt in fn.body
        if isinstance(stmt, ast.If)
        and _is_self_flag(stmt.test)
        and not stmt.orelse
        and _assigns(stmt.body, "next_draft_input.dsa_topk_indices")
    ]
    if len(setters) != 1:
        return f"no top-level `if self.{SEED_FLAG}: next_draft_input.dsa_topk_indices = ...`"
    value = _assigns(setters[0].body, "next_draft_input.dsa_topk_indices")[0]
    if not isinstance(value, ast.Name):
        return "next_draft_input.dsa_topk_indices is not set from a local seed"
    name = value.id
    producers = [
        stmt
        for stmt in fn.body
        if isinstance(stmt, ast.If) and _is_self_flag(stmt.test) and not stmt.orelse and _assigns(stmt.body, name)
    ]
    if len(producers) != 1:
        return f"{name} is not produced under a top-level `if self.{SEED_FLAG}:`"
    value = _assigns(producers[0].body, name)[0]
    if not isinstance(value, ast.Subscript):
        return f"{name} is `{ast.unparse(value)}`, not a row selection of the captured top-k"
    capture = ast.unparse(value.value)
    branch = next((s for s in producers[0].body if isinstance(s, ast.If)), None)
    if branch is None or not (_assigns(branch.body, capture) and _assigns(branch.orelse, capture)):
        return f"{capture} is not set on both the graph and the eager branch"
    return None


def _real_methods() -> dict[str, ast.FunctionDef]:
    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker

    return {
        name: _function(inspect.getsource(inspect.unwrap(vars(EagleDraftWorker)[name])))
        for name in ("_draft_extend_for_prefill", "_draft_extend_for_decode")
    }


CHECKS = {"_draft_extend_for_prefill": prefill_always_seeds, "_draft_extend_for_decode": decode_always_seeds}


@pytest.mark.parametrize("method", sorted(CHECKS))
def test_real_draft_extend_always_seeds_outside_pd_decode(method):
    problem = CHECKS[method](_real_methods()[method])
    assert problem is None, f"EagleDraftWorker.{method}: {problem}"


class _DropSeed(ast.NodeTransformer):
    """Break the real source: the seed is made conditional on an extra (always-false) flag."""

    def visit_If(self, node: ast.If) -> ast.AST:
        self.generic_visit(node)
        if ast.unparse(node.test) in ("seed_from_extend", f"self.{SEED_FLAG}"):
            node.test = ast.BoolOp(op=ast.And(), values=[node.test, ast.Name("co_located_seed_disabled")])
        return node


class _SeedOnlyOnGraph(ast.NodeTransformer):
    """Break the real decode source: the eager branch no longer captures the top-k."""

    def visit_If(self, node: ast.If) -> ast.AST:
        self.generic_visit(node)
        if ast.unparse(node.test).endswith("can_run_decode_cuda_graph") or ast.unparse(node.test) == "can_cuda_graph":
            if any(isinstance(s, ast.Assign) and "dsa_extend_topk_capture" in ast.unparse(s) for s in node.orelse):
                node.orelse = [ast.Pass()]
        return node


@pytest.mark.parametrize("method", sorted(CHECKS))
@pytest.mark.parametrize("breaker", [_DropSeed, _SeedOnlyOnGraph], ids=["seed-conditional", "eager-unseeded"])
def test_check_rejects_a_broken_draft_extend(method, breaker):
    fn = _real_methods()[method]
    broken = breaker().visit(fn)
    if ast.dump(broken) == ast.dump(_real_methods()[method]):
        pytest.skip(f"{breaker.__name__} does not apply to {method}")
    assert CHECKS[method](ast.fix_missing_locations(broken)) is not None
