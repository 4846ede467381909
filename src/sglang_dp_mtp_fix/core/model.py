"""What a patch declares and what the core answers: targets, the Patch base class, outcomes."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, NamedTuple

from sglang_dp_mtp_fix.config import Config
from sglang_dp_mtp_fix.sglang_versions import AFFECTED_RELEASES

MARKER = "__sglang_dp_mtp_fix_patch__"  # on each replacement: the id of the patch that installed it
ORIGINAL = "__sglang_dp_mtp_fix_original__"  # on each replacement: the function it replaced (fingerprinted instead)


# A replacement value meaning "this WRAP target stays SGLang's own" (a wrapper the configuration does not need, decided
# at load); any other target left out of ``replacements`` is an error.
UNCHANGED: Any = type("Unchanged", (), {"__repr__": lambda self: "UNCHANGED"})()


class Status(str, enum.Enum):
    APPLIED = "applied"
    SUPERSEDED = "superseded"
    NOT_AFFECTED = "not-affected"
    DISABLED = "disabled"
    UNSUPPORTED = "unsupported"
    NOT_LOADED = "not-loaded"  # deferred patch whose module this process has not imported (yet)


class HeldBack(str, enum.Enum):
    """Why an ``unsupported`` patch stays stock: a problem of its own, or one outside it (``Outcome.blocked_by``)."""

    OWN_CHECK = "own-check"  # its own feature detection or target check (drift, missing, foreign hook)
    ROLLED_BACK = "rolled-back"  # the application failed and everything it belonged to was rolled back
    STOOD_DOWN = "stood-down"  # applied, then put back at scheduler start (the deployment is one it must not run in)
    GROUP_MEMBER = "group-member"  # a member of its group (blocked_by) is not applied
    OTHER_PATCH = "other-patch"  # another patch (blocked_by) is unsupported: SGLang is kept fully stock
    CONFIGURATION = "configuration"  # the configuration could not be parsed

    @property
    def by_another(self) -> bool:
        """True when the cause lies outside this patch (the report names the patch that holds the cause)."""
        return self in (HeldBack.GROUP_MEMBER, HeldBack.OTHER_PATCH, HeldBack.CONFIGURATION)


class Kind(str, enum.Enum):
    WRAP = "wrap"  # replace a function/method/classmethod by a wrapper built from the original
    CHECK = "check"  # code the patch relies on but does not change: fingerprint only
    ADD = "add"  # a new attribute on a class; it must not exist yet


class Target(NamedTuple):  # not a frozen dataclass: ~7x cheaper to define, at every activation
    module: str
    qualname: str  # "func", "Class.method" or, for ADD, the class ("Class")
    kind: Kind = Kind.WRAP
    attr: str | None = None  # ADD: the new attribute's name
    required: bool = True  # False: the target exists only in some releases (absence is fine, drift is not)
    fingerprinted: bool = True
    # Alternatives: the optional targets of one patch sharing a label are one premise whose home differs by release
    # (e.g. moved to another module); at least one of them must be present, else the premise has vanished.
    one_of: str = ""

    @property
    def name(self) -> str:
        suffix = f".{self.attr}" if self.kind is Kind.ADD else ""
        return f"{self.module}:{self.qualname}{suffix}"


class TargetProblem(Exception):
    """A target is not the code the patch was written for."""


class StandDown(Exception):
    """Raised by ``Patch.classify`` or ``check_imported`` to stand a patch down with ``status`` (e.g. superseded,
    not-affected) and a reason."""

    def __init__(self, status: Status, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass
class Resolved:
    target: Target
    owner: Any  # module or class holding the attribute
    attr: str
    raw: Any  # owner.__dict__[attr] (or None for ADD / inherited)
    own: bool  # attr defined in owner's own __dict__
    matched: tuple[str, ...] = ()  # releases whose source has this target's fingerprint
    fingerprint: str | None = None  # the live source's fingerprint (compared across ranks at start-up)


class Patch:
    """Base class of a patch. Subclasses set the class attributes and implement ``replacements``."""

    id: str = ""
    requires: tuple[str, ...] = ()
    targets: tuple[Target, ...] = ()

    deferred_until_import: str | None = None  # a module name: checked and applied when it is imported (core doc)
    # The releases its targets were written for: a target's fingerprint must have been seen in one of them.
    written_for: tuple[str, ...] = AFFECTED_RELEASES
    # False: it does not fix the hang (a diagnostic, or an opt-in setting); ``doctor``'s verdict is about the patches
    # that fix.
    fixes: bool = True
    # The variable that switches an opt-in patch on (``switched_off`` reads it); None for every other patch.
    setting: str | None = None

    def switched_off(self, config: Config) -> str | None:
        """Why the configuration leaves this patch off (it is then ``disabled`` with that reason), or None. For a
        patch the operator opts into (a setting whose default is off); checked after the kill switch and the skip
        list, before ``classify``."""
        return None

    def classify(self) -> None:
        """Raise ``StandDown`` when the installed SGLang already has the fix or is not affected.

        For a deferred patch it runs at load and must not import ``deferred_until_import``."""

    def check_imported(self) -> None:
        """Feature detection that needs the imported modules: runs right before the targets are checked (for a
        deferred patch: once its module is imported). Raise ``StandDown`` or ``TargetProblem``."""

    def at_scheduler_start(self, scheduler: Any) -> None:
        """Runs once per scheduler, at the end of its ``__init__``, for an applied patch: read what only the built
        scheduler knows (its ServerArgs, its workers). Raise ``TargetProblem`` when it cannot be read."""

    def replacements(self, resolved: dict[Target, Resolved], config: Config) -> dict[Target, Any]:
        """New values for WRAP and ADD targets, built for ``config`` (load-time choices such as the vote counters);
        ``UNCHANGED`` leaves a WRAP target as it is. Keep originals in closures, never in module globals."""
        raise NotImplementedError


@dataclass
class Outcome:
    id: str
    status: Status
    reason: str
    held_back: HeldBack | None = None  # set for every ``unsupported`` outcome the core decides
    blocked_by: str | None = None  # the patch whose problem holds this one back (GROUP_MEMBER, OTHER_PATCH)

    def hold_back(self, why: HeldBack, reason: str, blocked_by: str | None = None) -> None:
        """Make this outcome ``unsupported``, in place (the held report line and the cross-rank check read it)."""
        self.status, self.reason, self.held_back, self.blocked_by = Status.UNSUPPORTED, reason, why, blocked_by

    def take(self, other: Outcome) -> None:
        """Become ``other``, in place (a deferred patch decided at its module's import)."""
        self.status, self.reason = other.status, other.reason
        self.held_back, self.blocked_by = other.held_back, other.blocked_by

    @property
    def held_back_by_another(self) -> bool:
        return self.held_back is not None and self.held_back.by_another

    def as_dict(self) -> dict[str, str | None]:
        held_back = self.held_back.value if self.held_back is not None else None
        return {
            "id": self.id,
            "status": self.status.value,
            "reason": self.reason,
            "held_back": held_back,
            "blocked_by": self.blocked_by,
        }


def unsupported(patch_id: str, why: HeldBack, reason: str, blocked_by: str | None = None) -> Outcome:
    return Outcome(patch_id, Status.UNSUPPORTED, reason, why, blocked_by)
