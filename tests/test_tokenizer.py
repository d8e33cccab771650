"""The byte tokenizer's added tokens: DeepSeek V4.1's chat-template tags are one id each (as in
the real tokenizer), decode keeps plain tags and drops specials when asked, a rendered
multi-turn chat keeps token-in/token-out exact, and the table round-trips through
tokenizer_config.json (old files get the default table, malformed ones are refused)."""

from __future__ import annotations

import json

import pytest

from sglang_dsv41.gateway.trajectory import END_OF_ASSISTANT, Trajectory, Turn
from sglang_dsv41.model.dsv4 import get_preset
from sglang_dsv41.tokenizer import (BOS_TOKEN, CHAT_TEMPLATE_TOKENS, EOS_TOKEN, AddedToken,
                                    ByteTokenizer, load_model_tokenizer)

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tok():
    return ByteTokenizer.from_config(get_preset("tiny"))


def _render(messages: list[dict]) -> str:
    import deepseek_recipe as dr

    body = {"model": "DeepSeek-V4.1-Flash", "messages": messages, "tools": TOOLS}
    conv = dr.ChatCompletionRequest(body).convert(
        dr.ConversionOptions(default_thinking_mode=True))
    return dr.DeepseekV41Encoding().render_conversation(conv.conversation).prompt


def test_the_table_is_the_v41_encodings_tags(tok):
    from deepseek_recipe import SpecialToken

    spellings = {getattr(SpecialToken, n).default_str() for n in dir(SpecialToken)
                 if isinstance(getattr(SpecialToken, n), SpecialToken)}
    assert spellings == {BOS_TOKEN, EOS_TOKEN, *CHAT_TEMPLATE_TOKENS}
    assert tok.encode(END_OF_ASSISTANT) == [tok.eos_token_id] == [257]
    assert tok.encode(BOS_TOKEN) == [tok.bos_token_id] == [256]
    assert tok.all_special_ids == [256, 257, 258]
    assert all(tok.encode(t.content) == [tid] for tid, t in tok.added_tokens.items())
    assert sorted(tok.added_tokens) == list(range(256, 256 + 19))


def test_round_trip_with_and_without_tags(tok):
    plain = "héllo wörld 🙂\n\ttabs <thin k> <｜User |> ｜DSML"
    assert tok.encode(plain) == list(plain.encode("utf-8"))
    assert tok.decode(tok.encode(plain)) == plain
    text = (f"{BOS_TOKEN}sys<｜User｜>hi<｜Assistant｜><think>é</think><<think>>"
            f"<｜DSML｜ calls>x</｜DSML｜ calls>{EOS_TOKEN}")
    ids = tok.encode(text, add_bos=True)
    assert ids[:2] == [256, 256] and ids[-1] == 257
    assert tok.decode(ids, skip_special_tokens=False) == BOS_TOKEN + text
    assert len(ids) == len(text.encode("utf-8")) - sum(
        len(s.encode("utf-8")) - 1 for s in (BOS_TOKEN, "<｜User｜>", "<｜Assistant｜>", "<think>",
                                             "</think>", "<think>", "｜DSML｜", "｜DSML｜",
                                             EOS_TOKEN)) + 1


def test_longest_added_token_wins():
    table = {256: AddedToken("<b>", True), 257: AddedToken("<e>", True),
             258: AddedToken("<p>", True), 259: AddedToken("ab", False),
             260: AddedToken("abc", False)}
    t = ByteTokenizer(300, added_tokens=table)
    assert t.encode("abcd ab") == [260, ord("d"), ord(" "), 259]
    assert t.decode([260, 259, 256, 299]) == "abcab"
    assert t.decode([260, 256, 299], skip_special_tokens=False) == "abc<b><|reserved_299|>"


def test_skip_special_tokens_drops_only_specials(tok):
    ids = [256, *b"a", 257, 258, *tok.encode("<think>b</think><｜User｜>"), 300, 0xC3]
    assert tok.decode(ids) == "a<think>b</think><｜User｜>\ufffd"
    assert tok.decode(ids, skip_special_tokens=False) == (
        f"{BOS_TOKEN}a{EOS_TOKEN}<｜▁pad▁｜><think>b</think><｜User｜><|reserved_300|>\ufffd")


def test_two_turn_v41_chat_tags_are_one_id_and_token_in_token_out_is_exact(tok):
    first = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": "What does 'zephyr' mean?"}]
    reply = {"role": "assistant", "content": "", "reasoning_content": "Look it up.",
             "tool_calls": [{"id": "c1", "type": "function", "function": {
                 "name": "lookup", "arguments": json.dumps({"word": "zephyr"})}}]}
    second = first + [reply, {"role": "tool", "tool_call_id": "c1", "content": "a west wind"}]
    prompt1, prompt2 = _render(first), _render(second)
    ids1 = tok.encode(prompt1)
    for tag in (BOS_TOKEN, "<｜System｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "｜DSML｜"):
        assert ids1.count(tok.encode(tag)[0]) == prompt1.count(tag) > 0, tag
    assert tok.decode(ids1, skip_special_tokens=False) == prompt1
    # What the model generated in turn 1: the rendered assistant message up to its eos.
    generated = prompt2[len(prompt1):prompt2.index(END_OF_ASSISTANT, len(prompt1))]
    assert "</think>" in generated and "｜DSML｜" in generated
    out1 = tok.encode(generated) + [tok.eos_token_id]
    traj = Trajectory("s", [Turn(ids1, out1, [0.0] * len(out1), "e", 0, 0,
                                 {"type": "stop", "matched": tok.eos_token_id})], prompt1)
    ids2, retokenized = traj.next_prompt_ids(prompt2, lambda start: tok.encode(prompt2[start:]),
                                             tok.encode)
    assert not retokenized and ids2[:len(ids1) + len(out1)] == ids1 + out1
    assert ids2 == tok.encode(prompt2)  # the same as tokenizing the whole conversation
    tags = sum(prompt2.count(t) for t in (BOS_TOKEN, EOS_TOKEN, *CHAT_TEMPLATE_TOKENS))
    assert len(ids2) == len(prompt2.encode("utf-8")) - sum(
        prompt2.count(t) * (len(t.encode("utf-8")) - 1)
        for t in (BOS_TOKEN, EOS_TOKEN, *CHAT_TEMPLATE_TOKENS)) and tags > 10


def test_saved_table_round_trips_and_old_config_loads(tmp_path, tok):
    tok.save_pretrained(str(tmp_path))
    d = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert d["eos_token"] == EOS_TOKEN and d["added_tokens_decoder"]["260"] == {
        "content": "<｜User｜>", "special": False}
    again = ByteTokenizer.from_pretrained(str(tmp_path))
    assert again.added_tokens == tok.added_tokens
    custom = {**tok.added_tokens, 300: AddedToken("<tool_result>", False)}
    ByteTokenizer(320, added_tokens=custom).save_pretrained(str(tmp_path / "c"))
    assert ByteTokenizer.from_pretrained(str(tmp_path / "c")).encode("<tool_result>") == [300]
    old = {"tokenizer_class": "ByteTokenizer", "vocab_size": 320, "bos_token_id": 256,
           "eos_token_id": 257, "pad_token_id": 258, "bos_token": "<|bos|>",
           "eos_token": "<|eos|>", "pad_token": "<|pad|>"}
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert ByteTokenizer.from_pretrained(str(tmp_path / "old.json")).added_tokens == \
        tok.added_tokens


@pytest.mark.parametrize("table, error", [
    ([], "added_tokens_decoder must be an object"),
    ({"x": {"content": "a", "special": False}}, "key 'x' is not a token id"),
    ({"259": {"content": "a"}}, r"added_tokens_decoder\['259'\] must be an object"),
    ({"259": {"content": 5, "special": False}}, "string 'content'"),
    ({"259": {"content": "", "special": False}}, "non-empty text"),
    ({"320": {"content": "a", "special": False}}, "added token id 320 must lie in"),
    ({"100": {"content": "a", "special": False}}, "added token id 100 must lie in"),
    ({"256": {"content": "b", "special": True}, "257": {"content": "b", "special": True}},
     "both spell 'b'"),
    ({"256": {"content": "b", "special": True}, "258": {"content": "p", "special": True}},
     "eos_token_id=257 as a special token"),
    ({"256": {"content": "b", "special": True}, "257": {"content": "e", "special": False},
      "258": {"content": "p", "special": True}}, "eos_token_id=257 as a special token"),
])
def test_malformed_table_is_refused(tmp_path, table, error):
    d = {**ByteTokenizer().to_dict(), "added_tokens_decoder": table}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=error) as e:
        ByteTokenizer.from_pretrained(str(tmp_path))
    assert "tokenizer_config.json" in str(e.value)


def test_the_served_models_tokenizer_is_its_file_or_its_config_never_a_silent_default(tmp_path):
    """What the engine and the gateway load: no file -> the config's ids; a malformed or
    foreign file is refused (it used to be replaced by the default without a word)."""
    cfg = get_preset("tiny")
    assert load_model_tokenizer(str(tmp_path), cfg).to_dict() == ByteTokenizer.from_config(
        cfg).to_dict()
    assert load_model_tokenizer(None, cfg).vocab_size == cfg.vocab_size
    bad = {**ByteTokenizer().to_dict(), "added_tokens_decoder": {"259": {"content": ""}}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        load_model_tokenizer(str(tmp_path), cfg)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Other"}))
    with pytest.raises(ValueError, match="tokenizer_class is 'Other'"):
        load_model_tokenizer(str(tmp_path), cfg)


def test_a_vocabulary_without_room_is_refused():
    with pytest.raises(ValueError, match=r"chat-template tokens need 19 \(vocab_size >= 275\)"):
        ByteTokenizer(vocab_size=274)
    assert len(ByteTokenizer(vocab_size=275).added_tokens) == 19
