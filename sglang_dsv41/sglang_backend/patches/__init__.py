"""Every SGLang patch, one module per concern. Nothing here imports SGLang at import time."""

VERSIONS = ("0.5.10.post1",)  # the SGLang versions whose source these targets were checked in

from . import dp_attention, dp_routing, engram, process_entry, watchdog  # noqa: E402

ALL_PATCHES = [*process_entry.PATCHES, *dp_attention.PATCHES, *watchdog.PATCHES,
               *engram.PATCHES, *dp_routing.PATCHES]

__all__ = ["ALL_PATCHES", "VERSIONS"]
