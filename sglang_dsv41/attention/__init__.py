"""Sink attention: torch reference, Triton kernels, and one dispatch for trainer and server."""

from .reference import sink_attention_reference, sink_decode_reference


def sink_attention(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, causal=True, window=None,
                   softmax_scale=None):
    return sink_attention_reference(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, causal, window,
                                    softmax_scale)


def sink_decode(q, k_cache, v_cache, page_table, seq_lens, sinks, window=None, softmax_scale=None):
    return sink_decode_reference(q, k_cache, v_cache, page_table, seq_lens, sinks, window,
                                 softmax_scale)
