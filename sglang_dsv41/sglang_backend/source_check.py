"""Every plugin target checked in an SGLang source tree with ``ast``: nothing is imported, so
the check runs before start-up, and in CI on a machine without CUDA."""

from __future__ import annotations

import ast
import functools
import os
from dataclasses import dataclass
from typing import Iterable

from .plugins import PLUGINS, SGLANG_VERSION, Plugin, PluginTargetError, Target


def module_path(src_root: str, module: str) -> str:
    return os.path.join(src_root, *module.split(".")) + ".py"


def _ast_params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args]
    if a.vararg:
        names.append("*" + a.vararg.arg)
    names += [p.arg for p in a.kwonlyargs]
    if a.kwarg:
        names.append("**" + a.kwarg.arg)
    return tuple(names)


def _find_def(tree: ast.Module, qualname: str):
    scope: list[ast.stmt] = tree.body
    parts = qualname.split(".")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        kinds = (ast.FunctionDef, ast.AsyncFunctionDef) if last else (ast.ClassDef,)
        found = [n for n in scope if isinstance(n, kinds) and n.name == part]
        if not found:
            return None
        if last:
            return found[-1]  # a later definition wins, as at runtime
        scope = found[-1].body
    return None


@functools.lru_cache(maxsize=64)
def _parse_cached(path: str, mtime_ns: int, size: int) -> ast.Module:
    with open(path) as f:
        return ast.parse(f.read(), filename=path)


def _parse(path: str) -> ast.Module:
    st = os.stat(path)
    return _parse_cached(path, st.st_mtime_ns, st.st_size)


def source_version(src_root: str) -> str:
    """The version of the SGLang tree under src_root (its generated sglang/_version.py)."""
    path = os.path.join(src_root, "sglang", "_version.py")
    if not os.path.isfile(path):
        raise PluginTargetError(f"no sglang/_version.py under {src_root}: not an SGLang tree")
    for node in _parse(path).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and any(
                isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets):
            return str(node.value.value)
    raise PluginTargetError(f"{path} sets no __version__")


def check_target_in_source(target: Target, src_root: str) -> str | None:
    """None when the target exists with the expected parameters, else what is wrong."""
    path = module_path(src_root, target.module)
    if not os.path.isfile(path):
        return f"{target.path}: module file {path} is missing"
    node = _find_def(_parse(path), target.qualname)
    if node is None:
        return f"{target.path} is not defined in {path}"
    got = _ast_params(node)
    if got != target.params:
        return f"{target.path}: parameters changed: expected {target.params}, found {got}"
    return None


@dataclass(frozen=True)
class PluginStatus:
    plugin: Plugin
    state: str                  # verified | off | failed
    problems: tuple[str, ...] = ()


def verify_source(src_root: str, disabled: Iterable[str] = (),
                  plugins: Iterable[Plugin] = PLUGINS) -> tuple[str, list[PluginStatus]]:
    """-> (the tree's SGLang version, each plugin's status). A plugin fails when the tree is
    not SGLang 0.5.23 or one of its targets is missing or changed."""
    version = source_version(src_root)
    off = set(disabled)
    statuses = []
    for p in plugins:
        if p.name in off:
            statuses.append(PluginStatus(p, "off"))
            continue
        problems = [] if version == SGLANG_VERSION else [
            f"SGLang {version} is not the supported {SGLANG_VERSION}"]
        problems += [m for m in (check_target_in_source(t, src_root) for t in p.targets) if m]
        statuses.append(PluginStatus(p, "failed" if problems else "verified", tuple(problems)))
    return version, statuses


def require_verified(statuses: list[PluginStatus]) -> None:
    failures = [f"plugin {s.plugin.name}: {m}" for s in statuses if s.state == "failed"
                for m in s.problems]
    if failures:
        raise PluginTargetError("SGLang plugin targets missing or changed; start-up stopped:\n  "
                                + "\n  ".join(failures) + "\n(switch a plugin off with "
                                "--dsv41-disable-plugins NAME)")


def format_table(version: str, statuses: list[PluginStatus]) -> str:
    rows = [("PLUGIN", "ENTRY POINT", "SGLANG", "STATE", "TARGET", "FIXES")]
    for s in statuses:
        p = s.plugin
        state = s.state + (f" (opt-in: {p.opt_in})" if p.opt_in and s.state == "verified" else "")
        for i, t in enumerate(p.targets):
            kind = "verified only" if t.hook_type == "check" else t.hook_type
            rows.append((p.name if i == 0 else "", p.entry_point if i == 0 else "",
                         version if i == 0 else "", state if i == 0 else "",
                         f"{t.path} [{kind}]", p.fixes if i == 0 else ""))
        rows += [("", "", "", "", f"  ! {m}", "") for m in s.problems]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5]
                     for r in rows)
