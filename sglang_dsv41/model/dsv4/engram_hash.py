"""Engram hashing (DeepSeek V4.1): which table rows each token's n-grams read.

Mirrors the torch path of SGLang 0.5.23's ``sglang/srt/layers/engram.py``:

  compressed_token_map   build_compressed_token_map (the same HF normalizer sequence)
  EngramLayout           EngramLayout.from_config / column_bounds (primes: _find_next_prime)
  hash_multipliers       compute_hash_multipliers (numpy rng seeded 10007 x layer_id)
  EngramHasher           EngramHasher.forward -> _torch_hash_ids -> hash_windows ->
                         compute_engram_hash_ids, over packed sequences (cu_seqlens) instead of
                         a ForwardBatch; history rows as in EngramHasher.history_row

Not mirrored: the image-token rule (SGLang sets image_token_id only for V4.1 with a vision
tower; text-only models pass None) and the history commit (the runtime keeps each request's
last tokens and passes them as ``history``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import nn

from .config import DSV4Config

SCALE_BLOCK = 32  # columns per e8m0 scale (SGLang's FP8_BLOCK_SIZE)
_MULTIPLIER_SEED = 10007
_WITNESSES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # exact Miller-Rabin below 3.3e24


# ---- compressed vocabulary ------------------------------------------------------------------
class ByteTokenizerHFView:
    """The slice of a HF tokenizer that SGLang's build_compressed_token_map reads (len, decode of
    one id, id_to_token) over the project's ByteTokenizer, so SGLang's own function can run on
    it. As in HF, an added token (bos, eos, the chat-template tags) decodes to its text, which
    is also its name here. id_to_token is read only for partial UTF-8 bytes, as a key:
    SentencePiece's byte names."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.backend_tokenizer = self

    def __len__(self) -> int:
        return len(self.tokenizer)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        return f"<0x{token_id:02X}>" if token_id < 256 else self.decode([token_id])


def compressed_token_map(tokenizer) -> tuple[list[int], int]:
    """Token id -> compressed id and the compressed vocabulary size, as SGLang builds them from
    a HF tokenizer (one with ``backend_tokenizer``) or from the project's ByteTokenizer."""
    from tokenizers import Regex, normalizers

    if not hasattr(tokenizer, "backend_tokenizer"):
        tokenizer = ByteTokenizerHFView(tokenizer)
    sentinel = "\ue000"  # keeps a lone-space token from collapsing to "" under Strip()
    normalizer = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(),
        normalizers.Lowercase(), normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), sentinel), normalizers.Strip(),
        normalizers.Replace(sentinel, " "),
    ])
    backend = tokenizer.backend_tokenizer
    key_to_new: dict[str, int] = {}
    lookup = [0] * len(tokenizer)
    for token_id in range(len(tokenizer)):
        text = backend.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:  # a partial UTF-8 byte: nothing to normalize, key by its name
            key = backend.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        lookup[token_id] = key_to_new.setdefault(key, len(key_to_new))
    return lookup, len(key_to_new)


def default_token_map(cfg: DSV4Config) -> list[int]:
    """The byte tokenizer's map for a vocabulary of cfg.vocab_size (the tiny/small presets).
    Special ids all normalize to distinct keys, so where they sit does not change the map."""
    from ...tokenizer import ByteTokenizer

    return compressed_token_map(ByteTokenizer(vocab_size=cfg.vocab_size))[0]


# ---- layout: primes, offsets, multipliers ---------------------------------------------------
def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in _WITNESSES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in _WITNESSES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@dataclass(frozen=True)
class EngramLayout:
    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    head_dim: int
    primes: tuple[tuple[tuple[int, ...], ...], ...]  # [layer][n-gram size - 2][head]

    @classmethod
    def from_config(cls, cfg: DSV4Config) -> "EngramLayout":
        """Primes in (layer, n-gram size, head) order, each the next unused prime above the
        previous one, every (layer, n-gram size) run restarting at engram_vocab_size - 1."""
        n, heads, dim = cfg.engram_max_ngram_size, cfg.engram_n_heads, cfg.engram_head_dim
        if not cfg.engram_layer_ids:
            raise ValueError("Engram needs engram_layer_ids")
        if n < 2 or heads < 1 or cfg.engram_vocab_size < 1:
            raise ValueError(f"Engram needs engram_max_ngram_size >= 2, engram_n_heads >= 1 and "
                             f"engram_vocab_size >= 1, got {n}, {heads}, {cfg.engram_vocab_size}")
        if dim < 1 or dim % SCALE_BLOCK:
            raise ValueError(f"engram_head_dim {dim} must be a positive multiple of {SCALE_BLOCK}")
        seen: set[int] = set()
        primes = []
        for _ in cfg.engram_layer_ids:
            per_ngram = []
            for _ in range(n - 1):
                sizes, current = [], cfg.engram_vocab_size - 1
                for _ in range(heads):
                    current += 1
                    while current in seen or not _is_prime(current):
                        current += 1
                    seen.add(current)
                    sizes.append(current)
                per_ngram.append(tuple(sizes))
            primes.append(tuple(per_ngram))
        layout = cls(tuple(cfg.engram_layer_ids), n, heads, dim, tuple(primes))
        expected = [layout.column_bounds(i)[-1] for i in range(len(primes))]
        if list(cfg.engram_num_embeddings) != expected:
            raise ValueError(f"engram_num_embeddings {cfg.engram_num_embeddings} disagrees with "
                             f"the primes' table sizes {expected}")
        return layout

    @property
    def n_hash_cols(self) -> int:
        return (self.max_ngram_size - 1) * self.n_heads

    def column_bounds(self, hash_index: int) -> tuple[int, ...]:
        """Prefix sums of one layer's segments: hash column c owns rows [b[c], b[c + 1])."""
        bounds = [0]
        for per_ngram in self.primes[hash_index]:
            for prime in per_ngram:
                bounds.append(bounds[-1] + prime)
        return tuple(bounds)


def hash_multipliers(layer_ids: Sequence[int], max_ngram_size: int,
                     vocab_size: int) -> torch.Tensor:
    """int64 [layers, n]: odd, and small enough that compressed_id x multiplier fits int64."""
    bound = max(1, (np.iinfo(np.int64).max // vocab_size) // 2)
    rows = [np.random.default_rng(_MULTIPLIER_SEED * layer_id).integers(
        low=0, high=bound, size=(max_ngram_size,), dtype=np.int64) for layer_id in layer_ids]
    return torch.tensor(np.stack(rows) * 2 + 1)


# ---- hashing over packed sequences ----------------------------------------------------------
class EngramHasher(nn.Module):
    """Hash ids [T, n_engram_layers, n_hash_cols] (int64 rows into each layer's table) for
    packed sequences. Call once per forward; layer i reads ``ids[:, engram.layer_hash_index]``.
    """

    def __init__(self, cfg: DSV4Config, token_map: Sequence[int] | None = None):
        super().__init__()
        layout = EngramLayout.from_config(cfg)
        token_map = default_token_map(cfg) if token_map is None else list(token_map)
        size = max(token_map) + 1 if token_map else 0
        if sorted(set(token_map)) != list(range(size)) or size != cfg.engram_compressed_vocab_size:
            raise ValueError(f"the token map has {size} dense compressed ids, the config expects "
                             f"engram_compressed_vocab_size={cfg.engram_compressed_vocab_size}; "
                             "every hash multiplier depends on it")
        if not 0 <= cfg.engram_pad_token_id < len(token_map):
            raise ValueError(f"engram_pad_token_id {cfg.engram_pad_token_id} is not a token id")
        self.max_ngram_size = layout.max_ngram_size
        self.pad_id = token_map[cfg.engram_pad_token_id]
        flat = [[p for per_ngram in layer for p in per_ngram] for layer in layout.primes]
        offsets = np.array([np.cumsum([0, *sizes[:-1]]) for sizes in flat])
        # Derived from the config, never checkpointed (persistent=False, as in SGLang).
        self.register_buffer("token_map", torch.tensor(token_map, dtype=torch.int64), False)
        self.register_buffer("multipliers", hash_multipliers(
            layout.layer_ids, layout.max_ngram_size, size), False)
        self.register_buffer("primes", torch.tensor(layout.primes, dtype=torch.int64), False)
        self.register_buffer("offsets", torch.tensor(offsets, dtype=torch.int64), False)

    def history_rows(self, prefixes: Sequence[Sequence[int]]) -> torch.Tensor:
        """int64 [B, n-1]: each sequence's last n-1 earlier tokens, oldest first, left-padded
        with 0 (the pad slots are blocked by position)."""
        n1 = self.max_ngram_size - 1
        rows = [[0] * max(0, n1 - len(p)) + [int(t) for t in list(p)[-n1:]] for p in prefixes]
        return torch.tensor(rows, dtype=torch.int64, device=self.token_map.device).view(-1, n1)

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                history: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T], cu_seqlens [B+1]. Without history every sequence starts here: no
        n-gram reaches across a sequence start (those slots hash as the pad token). With
        history [B, n-1] (history_rows of what precedes each sequence: an extend after a cached
        prefix, or a decode step) and positions [T], look-back continues into the history and
        stops at position 0, as SGLang's extend and decode do."""
        n = self.max_ngram_size
        if input_ids.dim() != 1 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            raise ValueError(f"need input_ids [T] and cu_seqlens [B+1], got "
                             f"{tuple(input_ids.shape)} and {tuple(cu_seqlens.shape)}")
        if (history is None) != (positions is None):
            raise ValueError("pass history and positions together (or neither)")
        num_tokens, device = input_ids.shape[0], input_ids.device
        cu = cu_seqlens.to(device=device, dtype=torch.int64)
        lens = cu.diff()
        seq = torch.repeat_interleave(torch.arange(lens.numel(), device=device), lens,
                                      output_size=num_tokens)
        t = torch.arange(num_tokens, device=device)
        offset = t - cu[:-1][seq]
        shifts = torch.arange(n, device=device)
        ids = input_ids.to(torch.int64)
        # Column s holds the s-th predecessor: from this sequence while s <= offset, else from
        # the history's column n-1-(s-offset).
        from_batch = shifts.unsqueeze(0) <= offset.unsqueeze(-1)
        windows = ids[(t.unsqueeze(-1) - shifts).clamp_min(0)]
        if history is None:
            blocked = ~from_batch
        else:
            if tuple(history.shape) != (lens.numel(), n - 1) or positions.shape != ids.shape:
                raise ValueError(f"history must be [{lens.numel()}, {n - 1}] and positions "
                                 f"[{num_tokens}], got {tuple(history.shape)} and "
                                 f"{tuple(positions.shape)}")
            hist_col = (n - 1 - (shifts.unsqueeze(0) - offset.unsqueeze(-1))).clamp(0, n - 2)
            from_hist = history.to(device=device, dtype=torch.int64)[seq].gather(1, hist_col)
            windows = torch.where(from_batch, windows, from_hist)
            blocked = positions.to(device=device, dtype=torch.int64).unsqueeze(-1) < shifts
        return self.hash_windows(windows, blocked)

    def hash_windows(self, windows: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
        """windows [T, n] (column s = s-th predecessor), blocked [T, n] -> hash ids."""
        compressed = torch.where(blocked, self.pad_id, self.token_map[windows])
        products = compressed.unsqueeze(1) * self.multipliers  # [T, layers, n]
        rolling, hashes = products[..., 0], []
        for i in range(1, windows.shape[-1]):  # after step i: the (i+1)-gram hash
            rolling = torch.bitwise_xor(rolling, products[..., i])
            hashes.append(rolling.unsqueeze(-1) % self.primes[:, i - 1])
        return torch.cat(hashes, dim=-1) + self.offsets
