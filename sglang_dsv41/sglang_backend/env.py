"""Every environment variable of the SGLang plugins, typed, in one place (prefix SGLANG_DSV41_).

Settings travel as environment variables because SGLang's own objects cannot carry them
(ServerArgs refuses unknown fields, the dummy loader refuses ``model_loader_extra_config``) and
SGLang spawns its schedulers, DP controller and detokenizer with the parent's environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Generic, Mapping, TypeVar

T = TypeVar("T")
PREFIX = "SGLANG_DSV41_"
DISPATCH_METHODS = ("sglang", "routing_key")


def _parse_bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0/true/false), got {raw!r}")


def _parse_names(raw: str) -> tuple[str, ...]:
    return tuple(sorted({n.strip() for n in raw.split(",") if n.strip()}))


def _parse_choice(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in choices:
            raise ValueError(f"expected one of {choices}, got {raw!r}")
        return raw

    return parse


def format_value(value) -> str:
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

    def set(self, value: T, environ=None) -> None:
        (os.environ if environ is None else environ)[self.name] = format_value(value)


class _Env:
    DISABLED_PLUGINS = EnvVar(PREFIX + "DISABLED_PLUGINS", _parse_names, (),
                              "comma-separated plugin names switched off")
    STALL_TIMEOUT = EnvVar(PREFIX + "STALL_TIMEOUT", float, 60.0,
                           "seconds a batch run or MLP sync may block before the rank is "
                           "reported unhealthy; <= 0: off")
    RUN_DIR = EnvVar(PREFIX + "RUN_DIR", str, "",
                     "per-server directory where scheduler ranks drop stall reports")
    SERVER_PID = EnvVar(PREFIX + "SERVER_PID", str, "",
                        "set by the server's first process (its children inherit it): the "
                        "one that clears stall reports an earlier server left in RUN_DIR")
    ENGRAM_CHECKPOINT = EnvVar(PREFIX + "ENGRAM_CHECKPOINT", str, "",
                               "checkpoint holding Engram tables and tid2eid for a dummy load "
                               "(default: --model-path)")
    ENGRAM_LAYOUT = EnvVar(PREFIX + "ENGRAM_LAYOUT", _parse_choice(("auto", "shared", "private")),
                           "auto", "Engram host-table layout: auto picks by node count")
    ALLOW_ENGRAM_UPDATE = EnvVar(PREFIX + "ALLOW_ENGRAM_UPDATE", _parse_bool, False,
                                 "accept weight updates that name an Engram table")
    DP_DISPATCH = EnvVar(PREFIX + "DP_DISPATCH", _parse_choice(DISPATCH_METHODS), "sglang",
                         "routing_key: requests with a routing_key stick to one DP rank")


ENV = _Env()
