"""Byte-level tokenizer: ids 0..255 are the UTF-8 bytes, specials and reserved ids sit above.

The tiny presets have no trained vocabulary, so every test, the embedded server and the
trainer bridge share this tokenizer. It is saved next to the weights as
``tokenizer_config.json`` with ``"tokenizer_class": "ByteTokenizer"``.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Iterable

from .jsonio import read_json_object

if TYPE_CHECKING:
    from .model.dsv4.config import DSV4Config

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
TOKENIZER_CLASS = "ByteTokenizer"
NUM_BYTES = 256


class ByteTokenizer:
    def __init__(self, vocab_size: int = 320, bos_token_id: int = 256, eos_token_id: int = 257,
                 pad_token_id: int = 258):
        specials = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
                    "pad_token_id": pad_token_id}
        if not isinstance(vocab_size, int) or vocab_size < NUM_BYTES + 3:
            raise ValueError(f"ByteTokenizer needs vocab_size >= {NUM_BYTES + 3} (256 bytes + bos, "
                             f"eos, pad), got {vocab_size!r}")
        for name, tid in specials.items():
            if not isinstance(tid, int) or not NUM_BYTES <= tid < vocab_size:
                raise ValueError(f"ByteTokenizer: {name}={tid!r} must lie in "
                                 f"[{NUM_BYTES}, {vocab_size}) (ids below 256 are bytes)")
        if len(set(specials.values())) != 3:
            raise ValueError(f"ByteTokenizer: special ids must be distinct, got {specials}")
        self.vocab_size = vocab_size
        self.bos_token_id, self.eos_token_id, self.pad_token_id = (
            bos_token_id, eos_token_id, pad_token_id)
        self._special_names = {bos_token_id: "<|bos|>", eos_token_id: "<|eos|>",
                               pad_token_id: "<|pad|>"}

    @classmethod
    def from_config(cls, cfg: "DSV4Config | dict[str, Any]") -> "ByteTokenizer":
        get = cfg.get if isinstance(cfg, dict) else lambda k: getattr(cfg, k, None)
        pad = get("pad_token_id")  # DSV4Config has none: the byte tokenizer's default
        return cls(get("vocab_size"), get("bos_token_id"), get("eos_token_id"),
                   258 if pad is None else pad)

    @property
    def all_special_ids(self) -> list[int]:
        return [self.bos_token_id, self.eos_token_id, self.pad_token_id]

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"encode expects str, got {type(text).__name__}")
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id] + ids if add_bos else ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Bytes are decoded as UTF-8 (invalid sequences become U+FFFD); ids above 255 are
        specials or reserved ids: dropped, or rendered as ``<|...|>`` markers when kept."""
        parts: list[str] = []
        buf = bytearray()
        for tid in ids:
            tid = int(tid)
            if not 0 <= tid < self.vocab_size:
                raise ValueError(f"token id {tid} outside the vocabulary [0, {self.vocab_size})")
            if tid < NUM_BYTES:
                buf.append(tid)
                continue
            if skip_special_tokens:
                continue
            parts.append(buf.decode("utf-8", errors="replace"))
            buf.clear()
            parts.append(self._special_names.get(tid, f"<|reserved_{tid}|>"))
        parts.append(buf.decode("utf-8", errors="replace"))
        return "".join(parts)

    # ---- files ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"tokenizer_class": TOKENIZER_CLASS, "vocab_size": self.vocab_size,
                "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
                "pad_token_id": self.pad_token_id, "bos_token": "<|bos|>",
                "eos_token": "<|eos|>", "pad_token": "<|pad|>"}

    def save_pretrained(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, TOKENIZER_CONFIG_FILE), "w") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)

    @classmethod
    def from_pretrained(cls, path: str) -> "ByteTokenizer":
        file = os.path.join(path, TOKENIZER_CONFIG_FILE) if os.path.isdir(path) else path
        d = read_json_object(file, "tokenizer file")
        if d.get("tokenizer_class") != TOKENIZER_CLASS:
            raise ValueError(f"{file}: tokenizer_class is {d.get('tokenizer_class')!r}, "
                             f"expected {TOKENIZER_CLASS!r}")
        try:
            return cls(d["vocab_size"], d["bos_token_id"], d["eos_token_id"], d["pad_token_id"])
        except KeyError as e:
            raise ValueError(f"{file}: missing key {e.args[0]!r}") from e
