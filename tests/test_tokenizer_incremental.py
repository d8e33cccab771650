"""The gateway's streamed text: incremental decoding gives the whole answer's text, never a
character cut inside its UTF-8 bytes, and decodes each id a bounded number of times."""

from sglang_dsv41.tokenizer import IncrementalDecoder
from sglang_dsv41.model.dsv4 import get_preset
from sglang_dsv41.tokenizer import ByteTokenizer


def test_streamed_deltas_are_the_whole_text_and_never_split_a_character():
    tok = ByteTokenizer.from_config(get_preset("tiny"))
    think = tok.encode("<think>")
    assert len(think) == 1
    # multi-byte characters, an added token, a dropped special inside a character, and an
    # invalid byte that never completes
    valid = tok.encode("héllo €😀 ") + think + [0xE2, tok.eos_token_id, 0x82, 0xAC]
    ids = valid + [0xFF] + tok.encode("ok") * 200 + [0xF0, 0x9F]
    decoded = []

    def counting_decode(window):
        decoded.append(len(window))
        return tok.decode(window)

    for chunk in (1, 3):
        stream, deltas = IncrementalDecoder(counting_decode), []
        ends = range(chunk, len(ids) + chunk, chunk)
        for end in ends:
            deltas.append(stream.step(ids[:end], final=end >= len(ids)))
        assert "".join(deltas) == tok.decode(ids)
        # a text ending in U+FFFD is held for the next chunk; the unfinished tail goes out at
        # the end only
        assert deltas[-1].endswith("\ufffd")
        assert not any(d.endswith("\ufffd") for d in deltas[:-1])
        if chunk == 1:
            before_invalid = "".join(d for end, d in zip(ends, deltas) if end <= len(valid))
            assert before_invalid == "héllo €😀 <think>€"
    assert sum(decoded) < 8 * len(ids)   # linear: the whole prefix each time would be ~n²/2
