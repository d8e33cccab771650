"""Every environment variable of the SGLang backend, typed, in one place (prefix SGLANG_DSV41_).

The launcher sets them in the main process before SGLang spawns its children (spawned children
inherit the environment), and the patches read them in whichever process they run. Settings
travel this way because SGLang's own objects cannot carry them: ServerArgs rejects unknown
fields, and the dummy loader rejects ``model_loader_extra_config``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Generic, Mapping, TypeVar

T = TypeVar("T")
PREFIX = "SGLANG_DSV41_"
ENGRAM_LAYOUTS = ("shared", "private")


def _parse_bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0/true/false), got {raw!r}")


def _parse_names(raw: str) -> tuple[str, ...]:
    return tuple(sorted({n.strip() for n in raw.split(",") if n.strip()}))


def _parse_layout(raw: str) -> str:
    if raw not in ENGRAM_LAYOUTS:
        raise ValueError(f"expected one of {ENGRAM_LAYOUTS}, got {raw!r}")
    return raw


def _format(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, tuple):
        return ",".join(value)
    return str(value)


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    parse: Callable[[str], T]
    default: T
    doc: str

    def get(self, environ: Mapping[str, str] | None = None) -> T:
        raw = (os.environ if environ is None else environ).get(self.name)
        if raw is None:
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ValueError(f"environment variable {self.name}: {e}") from e

    def to_env(self, value: T) -> tuple[str, str]:
        return self.name, _format(value)


class _Env:
    DISABLED_PLUGINS = EnvVar(PREFIX + "DISABLED_PLUGINS", _parse_names, (),
                              "comma-separated plugin names switched off")
    STALL_TIMEOUT = EnvVar(PREFIX + "STALL_TIMEOUT", float, 60.0,
                           "seconds a collective may block before it is reported; <= 0: off")
    RUN_DIR = EnvVar(PREFIX + "RUN_DIR", str, "",
                     "per-server directory where scheduler ranks drop stall reports")
    ENGRAM_DUMMY_LOAD = EnvVar(PREFIX + "ENGRAM_DUMMY_LOAD", _parse_bool, True,
                               "with --load-format dummy, still load the Engram tables")
    ENGRAM_CHECKPOINT = EnvVar(PREFIX + "ENGRAM_CHECKPOINT", str, "",
                               "checkpoint directory holding the Engram tables (default: "
                               "--model-path)")
    ENGRAM_LAYOUT = EnvVar(PREFIX + "ENGRAM_LAYOUT", _parse_layout, "shared",
                           "resolved host layout of the Engram tables: shared or private")


ENV = _Env()
