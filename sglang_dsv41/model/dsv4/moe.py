"""DeepSeek V4 MoE: sqrtsoftplus top-k routing with an fp32 correction bias, hash-routed layers
(``tid2eid``), SwiGLU experts with a clamp, one shared expert; R3 record/replay.

Names are SGLang's flat ones: ``ffn.gate.{weight,bias,tid2eid}``, ``ffn.experts.E.w{1,2,3}``,
``ffn.shared_experts.w{1,2,3}`` (w1 gate, w3 up, w2 down). The routed experts are held stacked
(``ffn.experts.w13``, ``ffn.experts.w2``: RoutedExperts) and shown per expert in the state dict.
The bias picks the experts only; the weights come from the unbiased scores, renormalised and
scaled by routed_scaling_factor (transformers' DeepseekV4TopKRouter / DeepseekV4HashRouter).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import DSV4Config
from .context import DSV4Context, rank_part
from .names import expert_names, join_experts, split_experts
from .projections import linear_packed
from .v41 import renormalize_topk_weights, sqrtsoftplus_log1p


def route_scores(logits: torch.Tensor, scoring_func: str, log1p: bool = False) -> torch.Tensor:
    """Router scores from logits; ``log1p`` is V4.1's sqrtsoftplus written through log1p."""
    if scoring_func == "sqrtsoftplus":
        if log1p:
            return sqrtsoftplus_log1p(logits)
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)


class Gate(nn.Module):
    def __init__(self, cfg: DSV4Config, layer_id: int):
        super().__init__()
        self.top_k, self.scoring = cfg.num_experts_per_tok, cfg.scoring_func
        self.is_hash = cfg.is_hash_layer(layer_id)
        # V4.1's fused gate scores through log1p and renormalises without an epsilon; its hash
        # layers score with plain softplus().sqrt() (SGLang HashTopK).
        self.v41_gate = cfg.is_v41 and not self.is_hash
        self.norm_topk, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        if self.is_hash:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.top_k,
                                                        dtype=torch.int32))
        else:
            self.register_buffer("bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> expert ids [T, k] int64, weights [T, k] fp32."""
        # x in the weight's dtype: a trainer keeps the router's weight in fp32 (its logits fp32)
        # while the layer computes in bf16; the same dtype elsewhere.
        scores = route_scores(F.linear(x.to(self.weight.dtype), self.weight).float(),
                              self.scoring, self.v41_gate)
        if self.is_hash:
            ids = self.tid2eid[input_ids].long()
        else:
            ids = torch.topk(scores + self.bias.float(), self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.norm_topk and self.v41_gate:
            weights = renormalize_topk_weights(weights)
        elif self.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """DeepSeek V4's clamped SwiGLU: gate <= limit, |up| <= limit."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def swiglu_packed(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """swiglu of gate_up [rows, 2I] (gate columns, then up) -> [rows, I]: on CUDA one Triton
    kernel each way (swiglu_triton.py), elsewhere the torch expression."""
    if gate_up.is_cuda:
        from .swiglu_triton import swiglu_packed_triton

        return swiglu_packed_triton(gate_up, limit)
    return swiglu(*gate_up.chunk(2, dim=-1), limit)


class Expert(nn.Module):
    """One SwiGLU MLP of nn.Linear layers (the shared expert)."""

    def __init__(self, hidden: int, inter: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # w1 and w3 as one GEMM, its [rows, 2I] output packed as the routed experts' is
        gate_up = linear_packed(x, self.w1, self.w3)
        rows = gate_up.reshape(-1, gate_up.shape[-1])
        return self.w2(swiglu_packed(rows, self.limit).view(*x.shape[:-1], self.w1.out_features))


class RoutedExperts(nn.Module):
    """Every routed expert's SwiGLU weights as two parameters: ``w13`` [E, 2I, H] (expert e's
    w1 gate rows, then its w3 up rows) and ``w2`` [E, H, I]: nn.Linear's [out, in] per expert,
    transformers' gate_up_proj/down_proj layout. FSDP2 then casts and gathers 2 tensors per layer
    instead of 3E, the forward stacks nothing, and the grouped GEMMs read them transposed (a
    view). The state dict shows SGLang's per-expert names ``E.w{1,2,3}.weight`` (views of the
    stacks) and load_state_dict accepts them, so checkpoints and weight updates keep their
    names; ``per_expert_state_dict`` off (an FSDP-sharded model, whose stacks are DTensors
    sharded over experts) keeps the stacked names for DCP."""

    def __init__(self, n_experts: int, hidden: int, inter: int):
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(n_experts, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, inter))
        self.per_expert_state_dict = True
        self.register_state_dict_post_hook(_show_per_expert)
        self.register_load_state_dict_pre_hook(_stack_per_expert)

    def __len__(self) -> int:
        return self.w13.shape[0]

    def forward_one(self, e: int, x: torch.Tensor, limit: float) -> torch.Tensor:
        """Expert ``e`` alone (the per-expert reference path)."""
        gate, up = F.linear(x, self.w13[e]).chunk(2, dim=-1)
        return F.linear(swiglu(gate, up, limit), self.w2[e])


def _show_per_expert(module: RoutedExperts, state_dict, prefix: str, local_metadata) -> None:
    if not module.per_expert_state_dict:
        return
    w13, w2 = state_dict.pop(prefix + "w13"), state_dict.pop(prefix + "w2")
    state_dict.update(split_experts(prefix, w13, w2))


def _stack_per_expert(module: RoutedExperts, state_dict, prefix: str, local_metadata, strict,
                      missing_keys, unexpected_keys, error_msgs) -> None:
    if not any(name in state_dict for name in expert_names(prefix, len(module))):
        return  # stacked names (a DCP state) or nothing for this module (dummy loading)
    hidden, inter = module.w2.shape[1:]
    try:
        w13, w2 = join_experts(prefix, state_dict, len(module), hidden, inter)
    except ValueError as e:
        error_msgs.append(str(e))
        return
    for name in expert_names(prefix, len(module)):
        del state_dict[name]
    state_dict[prefix + "w13"], state_dict[prefix + "w2"] = w13, w2


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """rows x [M, K] sorted by group, w [G, K, N], offs int32 [G] group ends -> [M, N].
    CUDA: torch's grouped GEMM (one launch for every expert). CPU: one matmul per group (torch's
    CPU grouped_mm has no backward for every layout); rows past offs[-1] are never read."""
    if x.is_cuda:
        return F.grouped_mm(x, w, offs=offs)
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    parts = [x[s:e] @ w[g] for g, (s, e) in enumerate(zip(starts, ends))]
    return torch.cat(parts) if parts else x.new_zeros(0, w.shape[-1])


class _PermuteRows(torch.autograd.Function):
    """``src[index]`` where ``index`` is a permutation of ``src``'s rows and ``inverse`` its
    inverse (``inverse[index] = arange``). The backward is the gather by ``inverse``: each
    gradient row goes back to its one source row, no index_put (the one indexing's backward
    makes: an element-wise kernel at a fraction of a gather's bandwidth, ~117 us a layer at 4k
    tokens x 6 slots x 1024 on an H200), and no row written twice: deterministic."""

    @staticmethod
    def forward(ctx, src, index, inverse):
        ctx.save_for_backward(inverse)
        return src.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        inverse, = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class _TokenSlotRows(torch.autograd.Function):
    """The rows of the first ``n`` (token, slot) pairs ``order`` lists, each its token's row of
    ``x`` [T, H] (k slots per token, ``order`` a permutation of the T*k pairs): one gather,
    never the [T*k, H] broadcast of ``x``. ``inverse`` is ``order``'s inverse; the backward
    gathers the rows' gradients back into (token, slot) order (pairs past ``n``: zero) and sums
    each token's k of them in slot order: no accumulating scatter, deterministic."""

    @staticmethod
    def forward(ctx, x, order, inverse, k, n):
        ctx.save_for_backward(inverse)
        ctx.k = k
        return x.index_select(0, torch.div(order[:n], k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad):
        inverse, = ctx.saved_tensors
        by_slot = _zero_padded(grad, inverse.shape[0]).index_select(0, inverse)
        return by_slot.view(-1, ctx.k, grad.shape[-1]).sum(dim=1), None, None, None, None


def _zero_padded(rows: torch.Tensor, n: int) -> torch.Tensor:
    """rows [m, H] with zero rows after it up to n (expert parallelism: the pairs of other
    ranks' experts, after this rank's); rows itself when it has n already."""
    if rows.shape[0] >= n:
        return rows
    return torch.cat([rows, rows.new_zeros(n - rows.shape[0], rows.shape[-1])])


def inverse_permutation(index: torch.Tensor) -> torch.Tensor:
    """inverse[index[j]] = j for a permutation ``index`` (one scatter, on the device)."""
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(index.shape[0], device=index.device, dtype=index.dtype)
    return inverse


def combine_slots(y: torch.Tensor, weights: torch.Tensor, inverse: torch.Tensor,
                  order: torch.Tensor) -> torch.Tensor:
    """The expert rows y [rows, H] (in the pairs' ``order``; rows past y's: other ranks'
    experts) back on their tokens, weighted and summed over the k slots -> [T, H]: on CUDA one
    Triton kernel each way (moe_combine_triton.py), elsewhere gathers and torch's product and
    sum (the weights and products rounded to y's dtype)."""
    if y.is_cuda:
        from .moe_combine_triton import combine_slots_triton

        return combine_slots_triton(y, weights, inverse)
    return combine_slots_torch(y, weights, inverse, order)


def combine_slots_torch(y: torch.Tensor, weights: torch.Tensor, inverse: torch.Tensor,
                        order: torch.Tensor) -> torch.Tensor:
    """combine_slots' torch path (the CPU one; the kernel's reference on any device)."""
    n_tok, k = weights.shape
    y = _zero_padded(y, n_tok * k)  # slots of other ranks' experts contribute zero
    y_slot = _PermuteRows.apply(y, inverse, order)  # back in (token, slot) order
    y_slot = y_slot.view(n_tok, k, y.shape[-1]) * weights.to(y.dtype)[..., None]
    return y_slot.sum(dim=1)


class MoE(nn.Module):
    """``grouped``: every expert in two grouped GEMMs (tokens sorted by expert); off, the plain
    per-expert loop (the reference the grouped path is tested against)."""

    def __init__(self, cfg: DSV4Config, layer_id: int, grouped: bool = True):
        super().__init__()
        self.layer_id, self.grouped = layer_id, grouped
        self.limit = cfg.swiglu_limit
        self.gate = Gate(cfg, layer_id)
        self.experts = RoutedExperts(cfg.n_routed_experts, cfg.hidden_size,
                                     cfg.moe_intermediate_size)
        self.shared_experts = Expert(cfg.hidden_size,
                                     cfg.moe_intermediate_size * cfg.n_shared_experts,
                                     cfg.swiglu_limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, ctx: DSV4Context) -> torch.Tensor:
        replay = ctx.replayed_routing(self.layer_id)
        if replay is None:
            ids, weights = self.gate(x, input_ids)
        else:
            ids, weights = replay[0].long(), replay[1].float()
        ctx.record(self.layer_id, ids, weights)
        experts = ctx.expert_range(len(self.experts))
        run = self.routed_grouped if self.grouped else self.routed_loop
        return ctx.mlp_reduce(run(x, ids, weights, experts)) + self.shared_experts(x)

    def routed_loop(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    experts: range) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in experts:
            token, slot = torch.where(ids == e)
            if token.numel():
                y = (self.experts.forward_one(e, x[token], self.limit)
                     * weights[token, slot, None].to(x.dtype))
                out.index_add_(0, token, y.to(out.dtype))
        return out

    def routed_grouped(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                       experts: range) -> torch.Tensor:
        """The (token, slot) pairs sorted by expert (stable: then by token, slot), w1|w3 in one
        grouped GEMM, w2 in another; back in slot order by a permutation and summed over the k
        slots in a fixed order. Every gather is a permutation or one token row per pair, whose
        backwards are gathers and a sum over the k slots: no accumulating scatter,
        bit-reproducible run to run."""
        n_tok, k = ids.shape
        local = ids.reshape(-1) - experts.start
        slots = None
        if len(experts) != len(self.experts):  # expert parallel: this rank's experts only
            mine = (local >= 0) & (local < len(experts))
            slots = torch.nonzero(mine).squeeze(1)
            local = local[slots]
        # 16-bit keys: a radix sort makes one pass per byte of key (8 for int64).
        sorted_ids, order = torch.sort(local.to(torch.int16), stable=True)
        # Group ends by binary search in the sorted ids: bincount on CUDA reads the ids' max
        # back to the host (a sync per layer); this stays on the device.
        bounds = torch.arange(1, len(experts) + 1, device=local.device, dtype=torch.int16)
        offs = torch.searchsorted(sorted_ids, bounds, out_int32=True)
        if slots is None:
            slot_order = order  # a permutation of the T*k (token, slot) pairs
        else:  # other ranks' pairs last, in slot order: still a permutation (their count is
            # known from slots': no second read-back)
            others = torch.nonzero_static(~mine, size=n_tok * k - slots.shape[0]).squeeze(1)
            slot_order = torch.cat([slots[order], others])
        inverse = inverse_permutation(slot_order)
        n_local = order.shape[0]  # this rank's pairs, the first in slot_order
        rows = _TokenSlotRows.apply(x, slot_order, inverse, k, n_local)  # in expert order
        w13 = rank_part(self.experts.w13, 0, experts)  # [E, 2I, H]
        w2 = rank_part(self.experts.w2, 0, experts)    # [E, H, I]
        gate_up = grouped_mm(rows, w13.transpose(1, 2), offs)
        y = grouped_mm(swiglu_packed(gate_up, self.limit), w2.transpose(1, 2), offs)
        return combine_slots(y, weights, inverse, slot_order).to(x.dtype)
