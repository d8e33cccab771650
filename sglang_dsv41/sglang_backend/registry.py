"""The patch registry: what each SGLang patch targets, checks and changes.

Every patch names its target (module + qualified name), the SGLang versions it was checked
against, the parameters the target must have, and what it changes. Before start-up the targets
are verified against the SGLang source tree (parsed with ``ast``, nothing imported), and again
against the live objects when a process applies them; a missing or changed target stops
start-up with a message naming it, unless its plugin is switched off.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .source_check import (PatchTargetError, check_requirement, check_target_in_source,
                           module_path, source_version)

logger = logging.getLogger(__name__)

ROLES = ("main", "dp_controller", "scheduler")
MARK = "__dsv41_patch__"


@dataclass(frozen=True)
class Target:
    module: str                    # e.g. "sglang.srt.managers.scheduler_dp_attn_mixin"
    qualname: str                  # "function" or "Class.method"
    params: tuple[str, ...]        # every parameter name in order (self/cls included)
    bound_in: str | None = None    # replace the name this module imported instead (see install)

    @property
    def label(self) -> str:
        return f"{self.module}.{self.qualname}"

    def source_path(self, src_root: str) -> str:
        return module_path(src_root, self.module)


@dataclass(frozen=True)
class Patch:
    name: str                      # unique, "<plugin>.<what>"
    plugin: str                    # the switch: --dsv41-disable-plugins <plugin>
    target: Target
    role: str                      # the process that applies it: main, dp_controller, scheduler
    versions: tuple[str, ...]
    changes: str
    # original function -> replacement; None: the target is only verified (another patch or a
    # middleware relies on its shape)
    make: Callable[[Callable], Callable] | None = None
    # custom installation (e.g. an HTTP middleware): install(owner, attr, original) -> None
    install: Callable[[Any, str, Any], None] | None = None
    # what else the adapter reads: (module, "Class.attribute") fields, or (module, "function")
    # helpers it calls, checked in the source like the target
    requires: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"patch {self.name}: role must be one of {ROLES}")


@dataclass(frozen=True)
class PatchStatus:
    patch: Patch
    state: str                     # applied | checked | verified | off | failed
    detail: str = ""


# ---- verification ---------------------------------------------------------------------------
def _live_params(fn: Callable) -> tuple[str, ...]:
    names = []
    for p in inspect.signature(fn, follow_wrapped=False).parameters.values():
        prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        names.append(prefix + p.name)
    return tuple(names)


def enabled(patches: Iterable[Patch], disabled: Iterable[str]) -> list[Patch]:
    off = set(disabled)
    return [p for p in patches if p.plugin not in off]


def verify_source(src_root: str, patches: Iterable[Patch] | None = None,
                  disabled: Iterable[str] = (), raise_on_failure: bool = True
                  ) -> list[PatchStatus]:
    """Check every enabled patch against the SGLang tree under src_root (the directory that
    contains the ``sglang`` package). Raises PatchTargetError naming every failing target
    (or, with raise_on_failure=False, returns them as "failed" statuses)."""
    patches = list(all_patches() if patches is None else patches)
    check_plugin_names(patches, disabled)
    version = source_version(src_root)
    on = {p.name for p in enabled(patches, disabled)}
    statuses, failures = [], []
    for p in patches:
        if p.name not in on:
            statuses.append(PatchStatus(p, "off"))
            continue
        problem = (None if version in p.versions
                   else f"SGLang {version} is not a supported version {p.versions}")
        problem = problem or check_target_in_source(p.target, src_root)
        for module, name in p.requires:
            problem = problem or check_requirement(module, name, src_root)
        if problem:
            failures.append(f"patch {p.name} (plugin {p.plugin}): target {p.target.label}: "
                            f"{problem}")
            statuses.append(PatchStatus(p, "failed", problem))
        else:
            statuses.append(PatchStatus(p, "verified"))
    if failures and raise_on_failure:
        raise PatchTargetError(
            "SGLang patch targets missing or changed; start-up stopped:\n  " +
            "\n  ".join(failures) + "\n(switch a plugin off with --dsv41-disable-plugins NAME)")
    return statuses


def check_plugin_names(patches: Iterable[Patch], names: Iterable[str]) -> None:
    known = {p.plugin for p in patches}
    unknown = sorted(set(names) - known)
    if unknown:
        raise ValueError(f"unknown plugin(s) {unknown}; known plugins: {sorted(known)}")


# ---- application ----------------------------------------------------------------------------
def _resolve(target: Target) -> tuple[Any, str, Any]:
    """-> (owner object, attribute name, raw attribute) of the live target."""
    module = importlib.import_module(target.module)
    owner: Any = module
    *outer, attr = target.qualname.split(".")
    for part in outer:
        owner = getattr(owner, part)
    return owner, attr, inspect.getattr_static(owner, attr)


def _unwrap_descriptor(raw: Any) -> tuple[Callable, Callable[[Callable], Any]]:
    if isinstance(raw, staticmethod):
        return raw.__func__, staticmethod
    if isinstance(raw, classmethod):
        return raw.__func__, classmethod
    return raw, lambda f: f


def apply_patch(patch: Patch) -> PatchStatus:
    target = patch.target
    owner, attr, raw = _resolve(target)
    func, rewrap = _unwrap_descriptor(raw)
    current = (getattr(importlib.import_module(target.bound_in), target.qualname)
               if target.bound_in else func)
    if getattr(current, MARK, None) == patch.name:
        return PatchStatus(patch, "applied", "already")
    got = _live_params(func)
    if got != target.params:
        raise PatchTargetError(f"patch {patch.name}: target {target.label}: parameters changed: "
                               f"expected {target.params}, found {got}")
    if patch.install is not None:
        patch.install(owner, attr, func)
        return PatchStatus(patch, "applied")
    if patch.make is None:
        return PatchStatus(patch, "checked")
    replacement = patch.make(func)
    setattr(replacement, MARK, patch.name)
    if target.bound_in:
        setattr(importlib.import_module(target.bound_in), target.qualname, rewrap(replacement))
    else:
        setattr(owner, attr, rewrap(replacement))
    return PatchStatus(patch, "applied")


def apply_patches(role: str, disabled: Iterable[str] = (),
                  patches: Iterable[Patch] | None = None) -> list[PatchStatus]:
    """Apply every enabled patch of this process role; raise PatchTargetError naming the first
    target that is missing or changed (a half-patched SGLang must not start)."""
    patches = list(all_patches() if patches is None else patches)
    check_plugin_names(patches, disabled)
    on = {p.name for p in enabled(patches, disabled)}
    out = []
    for p in patches:
        if p.role != role:
            continue
        if p.name not in on:
            status = PatchStatus(p, "off")
        else:
            try:
                status = apply_patch(p)
            except (ImportError, AttributeError) as e:
                raise PatchTargetError(f"patch {p.name} (plugin {p.plugin}): target "
                                       f"{p.target.label} is missing: {e}") from e
        out.append(status)
        logger.info("sglang-dsv41 patch %s: %s", p.name, status.state)
    return out


def format_table(statuses: Iterable[PatchStatus]) -> str:
    rows = [("PATCH", "PLUGIN", "PROCESS", "STATE", "TARGET", "CHANGES")]
    for s in statuses:
        state = s.state + (f" ({s.detail})" if s.detail else "")
        rows.append((s.patch.name, s.patch.plugin, s.patch.role, state, s.patch.target.label,
                     s.patch.changes))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5]
                     for r in rows)


def all_patches() -> list[Patch]:
    from .patches import ALL_PATCHES

    names = [p.name for p in ALL_PATCHES]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate patch names in {names}")
    return list(ALL_PATCHES)
