"""R3 rows of hash-routed MoE layers.

SGLang 0.5.23 captures routed experts (``--enable-return-routed-experts``) only for
score-routed layers: HashTopK.forward (layers/moe/hash_topk.py) never calls the capturer and the
mega gate (layers/moe/mega_gate.py) opts hash layers out, so their rows come back as zeros. A
hash layer's experts are ``tid2eid[token]``; capturing them fills the rows the trainer replays.
"""

from __future__ import annotations


def capture_hash_rows(layer_id, tid2eid, input_ids, num_tokens: int) -> None:
    from sglang.srt.state_capturer.routed_experts import get_global_experts_capturer

    capturer = get_global_experts_capturer()
    if capturer is None or layer_id is None or input_ids is None:
        return
    ids = tid2eid[input_ids[:num_tokens].long()].to(capturer.device_cache.buffer.dtype)
    capturer.capture(layer_id=layer_id, topk_indices=ids)


def after_hash_topk_forward(result, self, hidden_states, router_logits, input_ids, *args,
                            **kwargs):
    if not getattr(self, "is_draft", False):  # drafts never write the target's R3 rows
        capture_hash_rows(self.layer_id, self.tid2eid, input_ids, hidden_states.shape[0])


def after_run_mega_gate(result, moe, hidden_states, input_ids, *args, **kwargs):
    if result is not None and moe.is_hash and not getattr(moe.topk, "is_draft", False):
        capture_hash_rows(moe.layer_id, moe.topk.tid2eid, input_ids, hidden_states.shape[0])
