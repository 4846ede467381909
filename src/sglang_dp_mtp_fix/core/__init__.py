"""The patching core: it knows no patch.

Lifecycle (modelled on OpenTelemetry's ``BaseInstrumentor``), one small module per step:

- ``model``: what a patch declares (``Patch``, ``Target``) and what the core answers (``Outcome``: a status, and for
  a patch held back, why and by which patch).
- ``checks``: resolve one target, fingerprint its source, check one patch; nothing is changed.
- ``planning``: ``plan(patches, config)`` classifies each patch (disabled / superseded / not-affected), checks *every*
  target of every patch it would apply (import, feature detection, source fingerprint), and holds back a whole group
  for one member's problem. Patches that depend on each other (``requires``) form a group that applies together or
  not at all; a problem in any patch leaves SGLang fully stock (non-negotiable: a DP group must never end up
  half-patched).
- ``changes``: ``ChangeSet`` replaces attributes, re-points ``from X import Y`` copies in other SGLang modules,
  verifies the live attributes, and undoes by identity (all, or some patches' changes).
- ``deferred``: the post-import hooks of deferred patches.
- ``manager``: ``PatchManager``, one process's state over the above: apply in one transaction, roll everything back
  if anything goes wrong, ``restore()``, ``stand_down(ids)``.

Deferred patches (``Patch.deferred_until_import = "module.name"``): a standalone patch (no ``requires``, required by
none) whose targets live in a module that many processes never need. Loading the plugin then does not import that
module: ``classify()`` (which must not import it) runs at load; the checks that need the module
(``check_imported()``, target resolution and fingerprints) and the application run when the module is imported,
from a post-import hook (``importhook``), or at once when it already is. Until then the patch's status is
``not-loaded``. The deferred patch is its own transaction: a problem at that moment leaves that patch stock (its
targets by identity) and is reported through ``PatchManager.on_deferred``; the patches applied at load stay. It is
armed only when the load-time transaction applied or stood down cleanly (a load-time problem keeps everything stock,
deferred patches included). Every rank runs the same code, so the decision at the hook is the same on every rank;
``peer_fingerprints()`` adds the source digests of the modules a deferred patch awaiting import will check, so the
start-up cross-rank check also covers a module imported only after it ran.
"""

from __future__ import annotations

from sglang_dp_mtp_fix.core.changes import ChangeRecord, ChangeSet, apply_patch
from sglang_dp_mtp_fix.core.checks import check_patch, resolve
from sglang_dp_mtp_fix.core.manager import PatchManager
from sglang_dp_mtp_fix.core.model import (
    MARKER,
    ORIGINAL,
    UNCHANGED,
    HeldBack,
    Kind,
    Outcome,
    Patch,
    Resolved,
    StandDown,
    Status,
    Target,
    TargetProblem,
)
from sglang_dp_mtp_fix.core.planning import Plan, groups, plan
from sglang_dp_mtp_fix.sglang_versions import AFFECTED_RELEASES

__all__ = [
    "AFFECTED_RELEASES",
    "MARKER",
    "ORIGINAL",
    "ChangeRecord",
    "ChangeSet",
    "HeldBack",
    "Kind",
    "Outcome",
    "Patch",
    "PatchManager",
    "Plan",
    "Resolved",
    "StandDown",
    "Status",
    "Target",
    "TargetProblem",
    "UNCHANGED",
    "apply_patch",
    "check_patch",
    "groups",
    "plan",
    "resolve",
]
