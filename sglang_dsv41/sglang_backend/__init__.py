"""The ``sglang`` backend: SGLang 0.5.23 with the sglang-dsv41 plugins, installed through
SGLang's own entry-point group ``sglang.srt.plugins`` and HookRegistry (see plugins.py).
Nothing here imports SGLang at import time."""


def launch(server_args, argv):
    from .launcher import launch as _launch

    return _launch(server_args, argv)


__all__ = ["launch"]
