"""JSON files of a checkpoint directory (config, tokenizer, index) read with errors that name
the file. No torch import: the tokenizer and the config use it too."""

from __future__ import annotations

import json
import os


def read_json_object(path: str, what: str) -> dict:
    if not os.path.isfile(path):
        raise ValueError(f"{what} {path} is missing")
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"corrupt {what} {path}: {e}") from e
    if not isinstance(d, dict):
        raise ValueError(f"corrupt {what} {path}: top level is not an object")
    return d
