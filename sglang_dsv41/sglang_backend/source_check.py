"""Patch targets checked in an SGLang source tree with ``ast``: nothing is imported, so the
check runs before start-up, and in CI on a machine without CUDA."""

from __future__ import annotations

import ast
import functools
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .registry import Target


class PatchTargetError(RuntimeError):
    """A patch target is missing or changed; the message names every failing target."""


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
        node = found[-1]  # a later definition wins, as at runtime
        if last:
            return node
        scope = node.body
    return None


def _class_attrs(cls: ast.ClassDef) -> set[str]:
    """Names a class defines: class-level (annotated) assignments and ``self.x = ...``."""
    names = set()
    for node in ast.walk(cls):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, ast.AnnAssign) else [])
        for t in targets:
            for leaf in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(leaf, ast.Name) and node in cls.body:
                    names.add(leaf.id)
                elif (isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name)
                      and leaf.value.id == "self"):
                    names.add(leaf.attr)
    return names


def check_requirement(module: str, name: str, src_root: str) -> str | None:
    path = module_path(src_root, module)
    if not os.path.isfile(path):
        return f"module file {path} is missing"
    tree = _parse(path)
    if "." not in name:
        return None if _find_def(tree, name) else f"{module}.{name} is not defined"
    cls_name, attr = name.split(".", 1)
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name]
    if not classes:
        return f"class {module}.{cls_name} is not defined"
    if attr not in _class_attrs(classes[-1]):
        return f"{module}.{name} is no longer set"
    return None


def _imports_name(tree: ast.Module, module: str, name: str) -> bool:
    return any(isinstance(n, ast.ImportFrom) and n.module == module
               and any(a.name == name and a.asname is None for a in n.names) for n in tree.body)


def _parse(path: str) -> ast.Module:
    st = os.stat(path)
    return _parse_cached(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=32)
def _parse_cached(path: str, mtime_ns: int, size: int) -> ast.Module:
    with open(path) as f:
        return ast.parse(f.read(), filename=path)


def source_version(src_root: str) -> str:
    """The version of the SGLang tree under src_root (its generated sglang/_version.py)."""
    path = os.path.join(src_root, "sglang", "_version.py")
    if not os.path.isfile(path):
        raise PatchTargetError(f"no sglang/_version.py under {src_root}: not an SGLang tree")
    for node in _parse(path).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and any(
                isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets):
            return str(node.value.value)
    raise PatchTargetError(f"{path} sets no __version__")


def check_target_in_source(target: Target, src_root: str) -> str | None:
    """None when the target exists with the expected parameters, else what is wrong."""
    path = module_path(src_root, target.module)
    if not os.path.isfile(path):
        return f"module file {path} is missing"
    node = _find_def(_parse(path), target.qualname)
    if node is None:
        return f"{target.qualname} is not defined in {path}"
    got = _ast_params(node)
    if got != target.params:
        return f"parameters changed: expected {target.params}, found {got}"
    if target.bound_in:
        bound_path = module_path(src_root, target.bound_in)
        if not os.path.isfile(bound_path) or not _imports_name(
                _parse(bound_path), target.module, target.qualname):
            return (f"{target.bound_in} no longer does "
                    f"`from {target.module} import {target.qualname}`")
    return None
