"""Command-line tools and what their command lines share."""

from __future__ import annotations

import sys
from typing import Any, Callable


def help_description(doc: str | None) -> str | None:
    """--help text from a tool's module docstring: its first paragraph (what the tool does)
    and its last (its rules and exit status). None under ``python -OO``, which strips
    docstrings (argparse then prints no description)."""
    if not doc:
        return None
    paragraphs = doc.split("\n\n")
    return " ".join(paragraphs[0].split() + paragraphs[-1].split())


def run_reporting_errors(work: Callable[[], Any]) -> tuple[Any, int]:
    """``work()`` for a tool's main: -> (its result, 0), or (None, 1) after one ``error:``
    line on stderr for a refusal (ValueError) or a filesystem error (OSError: the message
    and the path, no traceback)."""
    from ..loader.atomic_dir import os_error_text

    try:
        return work(), 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
    except OSError as e:  # disk full, permissions
        print(f"error: {os_error_text(e)}", file=sys.stderr)
    return None, 1
