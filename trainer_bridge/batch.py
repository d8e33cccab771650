"""Stage objects between rollout and loss: Sample (one trajectory) and MicroBatch (packed)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from sglang_dsv41.wire import decode_array, encode_array


@dataclass
class Sample:
    tokens: list[int]                 # the whole episode: prompt, model turns, env replies
    loss_mask: list[int]              # 1 on tokens the model generated
    rollout_logprobs: list[float]     # the server's logprob of each generated token, else 0
    reward: float
    group_id: int                     # GRPO: samples of one prompt share a group
    # R3: the server's routing of positions 0..len-2, [len-1, num_layers, top_k] (every V4 layer
    # is routed: hash layers by tid2eid, the others by top-k). None when the server did not
    # return it.
    routed_experts: np.ndarray | None = None
    routed_weights: np.ndarray | None = None
    prompt_tokens: int = 0            # summed over the episode's requests
    cached_tokens: int = 0
    route: tuple[str, int] | None = None
    advantage: float = field(default=0.0, init=False)  # set by loss.compute_advantages

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if n < 2 or len(self.loss_mask) != n or len(self.rollout_logprobs) != n:
            raise ValueError(f"sample needs >= 2 tokens and mask/logprobs of the same length; got "
                             f"{n}, {len(self.loss_mask)}, {len(self.rollout_logprobs)}")
        if self.loss_mask[0]:
            raise ValueError("the first token has no logprob: it cannot be in the loss mask")
        if self.routed_experts is not None and self.routed_experts.shape[0] != n - 1:
            raise ValueError(f"routed_experts has {self.routed_experts.shape[0]} rows, expected "
                             f"{n - 1} (one per position but the last)")

    @property
    def response_length(self) -> int:
        return int(sum(self.loss_mask))

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("routed_experts", "routed_weights"):
            arr = getattr(self, key)
            if arr is not None:
                b64, shape = encode_array(arr, str(arr.dtype))
            d[key] = None if arr is None else {"shape": shape, "dtype": str(arr.dtype), "b64": b64}
        d["route"] = list(self.route) if self.route else None
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Sample":
        d = dict(d)
        adv = d.pop("advantage", 0.0)
        for key in ("routed_experts", "routed_weights"):
            if d.get(key) is not None:
                a = d[key]
                d[key] = decode_array(a["b64"], a["shape"], a["dtype"])
        d["route"] = tuple(d["route"]) if d.get("route") else None
        s = cls(**d)
        s.advantage = adv
        return s


@dataclass
class MicroBatch:
    input_ids: torch.Tensor           # int64 [T], the samples packed
    seq_lens: list[int]
    hidden_index: torch.Tensor        # int64 [N]: rows whose hidden state predicts targets
    targets: torch.Tensor             # int64 [N] = tokens 1..n-1 of each sample
    loss_mask: torch.Tensor           # fp32 [N]
    advantages: torch.Tensor          # fp32 [N]
    rollout_logprobs: torch.Tensor    # fp32 [N]
    routing: dict[int, tuple[torch.Tensor, torch.Tensor]] | None  # layer -> ids/weights [T, k]
    num_samples: int
    old_logprobs: torch.Tensor | None = field(default=None, init=False)  # set by the trainer
    ref_logprobs: torch.Tensor | None = field(default=None, init=False)  # set by the trainer

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum().item())


def pack(samples: list[Sample], routed_layers: list[int], use_routing: bool, top_k: int = 1
         ) -> MicroBatch:
    """Packs samples; an empty list gives a 2-token dummy with an all-zero mask (the micro-batch
    a rank runs when it has fewer than the others: every rank issues the same number of calls)."""
    if not samples:
        # With R3 the dummy replays a routing too: a rank whose router ran while the others
        # replayed would all-gather the router's FSDP group alone.
        ids = np.tile(np.arange(top_k, dtype=np.int32), (1, max(routed_layers, default=0) + 1, 1))
        dummy = Sample([0, 0], [0, 0], [0.0, 0.0], 0.0, -1, routed_experts=ids,
                       routed_weights=np.full(ids.shape, 1.0 / top_k, np.float32))
        mb = pack([dummy], routed_layers, use_routing, top_k)
        mb.num_samples = 0
        return mb
    ids, hidden_index, targets, mask, adv, rlp = [], [], [], [], [], []
    start = 0
    for s in samples:
        n = len(s.tokens)
        ids += s.tokens
        hidden_index += range(start, start + n - 1)
        targets += s.tokens[1:]
        mask += s.loss_mask[1:]
        adv += [s.advantage] * (n - 1)
        rlp += s.rollout_logprobs[1:]
        start += n
    routing = None
    if use_routing and routed_layers:
        if any(s.routed_experts is None or s.routed_weights is None for s in samples):
            raise ValueError("R3 is on but a sample has no routed experts/weights from the server")
        for s in samples:
            if (s.routed_experts.ndim != 3 or s.routed_experts.shape[1] <= max(routed_layers)
                    or s.routed_weights.shape != s.routed_experts.shape):
                raise ValueError(f"the server's routing has shape {s.routed_experts.shape} "
                                 f"(weights {s.routed_weights.shape}); expected [positions, "
                                 f">{max(routed_layers)} layers, top_k] for both")
        routing = {}
        for layer in routed_layers:
            per_ids, per_w = [], []
            for s in samples:
                e, w = s.routed_experts[:, layer], s.routed_weights[:, layer]
                if (e < 0).any():
                    raise ValueError(f"layer {layer} is routed but the server's routing has "
                                     "-1 rows")
                # The last position is never forwarded by the server and predicts nothing.
                per_ids.append(np.concatenate([e, e[-1:]]))
                per_w.append(np.concatenate([w, w[-1:]]))
            routing[layer] = (torch.from_numpy(np.concatenate(per_ids)).to(torch.int32),
                              torch.from_numpy(np.concatenate(per_w)).to(torch.float32))
    f32 = dict(dtype=torch.float32)
    return MicroBatch(
        input_ids=torch.tensor(ids, dtype=torch.long), seq_lens=[len(s.tokens) for s in samples],
        hidden_index=torch.tensor(hidden_index, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long), loss_mask=torch.tensor(mask, **f32),
        advantages=torch.tensor(adv, **f32), rollout_logprobs=torch.tensor(rlp, **f32),
        routing=routing, num_samples=len(samples))


def random_tokens(vocab_size: int, n: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, min(vocab_size, 256), (n,), generator=gen).tolist()


def random_batch(vocab_size: int, routed_layers: list[int], lengths: list[int],
                 seed: int = 0) -> MicroBatch:
    """Sequences of random tokens of ``lengths`` (every token after the first in the loss,
    advantage 1, old logprobs 0) packed into one micro-batch: what the memory plan's probes and
    bench/train.py step on. Sequence i's tokens are random_tokens(..., seed + i)."""
    samples = []
    for i, n in enumerate(lengths):
        s = Sample(random_tokens(vocab_size, n, seed + i), [0] + [1] * (n - 1), [0.0] * n, 1.0,
                   0)
        s.advantage = 1.0
        samples.append(s)
    mb = pack(samples, routed_layers, use_routing=False)
    mb.old_logprobs = torch.zeros_like(mb.rollout_logprobs)
    return mb


def split_evenly(items: list, n: int) -> list[list]:
    """``items`` cut in order into ``n`` parts whose sizes differ by one at most: none is empty
    while there are ``n`` items (a ceil-sized cut leaves the last parts empty)."""
    return [items[len(items) * i // n:len(items) * (i + 1) // n] for i in range(n)]


def split_by_token_budget(samples: list[Sample], budget: int) -> list[list[Sample]]:
    """Greedy packing in order; a sample longer than the budget gets a micro-batch of its own."""
    out: list[list[Sample]] = []
    cur: list[Sample] = []
    used = 0
    for s in samples:
        if cur and used + len(s.tokens) > budget:
            out.append(cur)
            cur, used = [], 0
        cur.append(s)
        used += len(s.tokens)
    if cur:
        out.append(cur)
    return out
