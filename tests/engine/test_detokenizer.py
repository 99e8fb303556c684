"""IncrementalDetokenizer: incremental text equals a full decode, stop strings, streaming."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from jaxserve.engine.detokenizer import IncrementalDetokenizer, decode_logprob_tokens
from jaxserve.sampling_params import SamplingParams

FFFD = "\ufffd"

# Embedded training corpus: English, Chinese (3 bytes a character), emoji (4 bytes, some with
# modifiers), Latin/Greek/Cyrillic (2 bytes). A small vocabulary leaves many multi-byte characters
# split across tokens, which is the case under test.
CORPUS = [
    "Hello world, this is a tiny corpus for a byte-level BPE tokenizer.",
    "The quick brown fox jumps over the lazy dog. Stop here. STOP!",
    "你好，世界！今天天气很好。我们一起去公园散步吧。",
    "中文字符需要三个字节，表情符号需要四个字节。",
    "Emoji: 😀 🎉 👍🏽 🚀 ❤️ 🇯🇵 and more 😀😀 🎉🎉",
    "Ünïcödé àccents, naïve café, Straße, Ελληνικά, русский текст.",
] * 4
MULTIBYTE_TEXTS = [
    "你好，世界！今天天气很好。",
    "😀 🎉 👍🏽 🚀 ❤️ 🇯🇵",
    "Hello 世界 😀 café Straße 中文字符 ok",
    "表情符号需要四个字节😀😀",
]


@functools.cache
def byte_level_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>", "</s>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def byte_token(char: str) -> int:
    """Id of the single-byte token of an ASCII char (' ' is 'Ġ' in the byte-level alphabet)."""
    token_id = byte_level_tokenizer().token_to_id("Ġ" if char == " " else char)
    assert token_id is not None
    return token_id


def detok(stop: list[str] | None = None, prompt: list[int] | None = None, **kwargs: object):
    params = SamplingParams(stop=stop, **kwargs)  # type: ignore[arg-type]
    return IncrementalDetokenizer(byte_level_tokenizer(), prompt or [], params)


def test_multibyte_text_matches_full_decode_at_every_step() -> None:
    tokenizer = byte_level_tokenizer()
    num_split_steps = 0
    for text in MULTIBYTE_TEXTS:
        ids = tokenizer.encode(text).ids
        d = detok(prompt=tokenizer.encode("Hello").ids)
        for k, token_id in enumerate(ids, start=1):
            assert d.update([token_id], finished=k == len(ids)) is None
            full = tokenizer.decode(ids[:k])
            if full.endswith(FFFD) and k < len(ids):
                num_split_steps += 1
                assert not d.output_text.endswith(FFFD)
                assert full.startswith(d.output_text)
            else:
                assert d.output_text == full
        assert d.output_text == text
        assert d.get_next_output_text(finished=True, delta=False) == text
    # The premise: characters really are split across tokens in these texts.
    assert num_split_steps >= 5


def test_finish_inside_a_character_shows_the_replacement_char_like_a_full_decode() -> None:
    tokenizer = byte_level_tokenizer()
    ids = tokenizer.encode("你好，世界").ids
    cut = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith(FFFD))
    d = detok()
    d.update(ids[: cut - 1])
    d.update(ids[cut - 1 : cut], finished=True)
    assert d.output_text == tokenizer.decode(ids[:cut])
    assert d.output_text.endswith(FFFD)


def test_prompt_context_that_ends_inside_a_character_is_not_used() -> None:
    tokenizer = byte_level_tokenizer()
    ids = tokenizer.encode("你好，世界").ids
    cut = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith(FFFD))
    d = detok(prompt=ids[:cut])
    d.update(ids[cut:], finished=True)
    assert d.output_text == tokenizer.decode(ids[cut:])


def test_wordpiece_continuation_uses_the_left_context() -> None:
    vocab = {"[UNK]": 0, "play": 1, "##ing": 2, "world": 3, "hello": 4}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.decoder = decoders.WordPiece()
    d = IncrementalDetokenizer(tokenizer, [4], SamplingParams())
    texts = []
    for token_id in [1, 2, 3]:
        d.update([token_id])
        texts.append(d.output_text)
    # "##ing" glues onto "play" only because "play" is decoded again as context.
    assert texts == [" play", " playing", " playing world"]


def sentencepiece_like_tokenizer() -> Tokenizer:
    """Llama-2 style: "▁" for spaces, a leading space stripped at the start of a decode, and
    <0xNN> byte-fallback tokens for characters outside the vocabulary."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", *"abcdehlorw", "▁h", "▁he", "ll", "▁hell", "or", "▁w", "▁wor"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "h"), ("▁h", "e"), ("l", "l"), ("▁he", "ll"), ("o", "r"), ("▁w", "or")]
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return tokenizer


@pytest.mark.parametrize("prompt", ["hello", ""])
@pytest.mark.parametrize("text", ["hello world 你好", "hello 😀 world"])
def test_sentencepiece_leading_space_and_byte_fallback(prompt: str, text: str) -> None:
    tokenizer = sentencepiece_like_tokenizer()
    prompt_ids = tokenizer.encode(prompt).ids if prompt else []
    ids = tokenizer.encode(text).ids
    assert any(tokenizer.id_to_token(i).startswith("<0x") for i in ids)  # premise: byte tokens
    d = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams())
    prompt_text = tokenizer.decode(prompt_ids)
    for k, token_id in enumerate(ids, start=1):
        d.update([token_id], finished=k == len(ids))
        # With a prompt, the output keeps the leading space the prompt context gives it.
        expected = tokenizer.decode(prompt_ids + ids[:k])[len(prompt_text) :]
        if FFFD in expected:
            assert FFFD not in d.output_text and len(d.output_text) < len(expected)
        else:
            assert d.output_text == expected
    assert d.output_text == (" " + text if prompt else text)


def test_stop_string_spanning_two_tokens() -> None:
    d = detok(stop=["ab"])
    assert d.update([byte_token("x")]) is None
    assert d.update([byte_token("a")]) is None
    assert d.output_text == "xa"
    assert d.update([byte_token("b")]) == "ab"
    assert d.output_text == "x"
    assert d.finished and d.stop_string == "ab"
    assert d.token_ids == [byte_token(c) for c in "xab"]


def test_stop_string_spanning_real_bpe_tokens() -> None:
    tokenizer = byte_level_tokenizer()
    ids = tokenizer.encode("Hello world").ids
    assert tokenizer.encode("Hello world").tokens == ["Hel", "lo", "Ġ", "wor", "ld"]
    d = detok(stop=["lo w"])
    results = [d.update([token_id]) for token_id in ids[:4]]
    assert results == [None, None, None, "lo w"]
    assert d.output_text == "Hel"


def test_stop_string_inside_the_first_token() -> None:
    tokenizer = byte_level_tokenizer()
    first = tokenizer.encode("Hello").ids[0]  # "Hel"
    d = detok(stop=["Hel"])
    assert d.update([first]) == "Hel"
    assert d.output_text == ""
    d = detok(stop=["Hel"], include_stop_str_in_output=True)
    assert d.update([first]) == "Hel"
    assert d.output_text == "Hel"


def test_include_stop_str_in_output_cuts_the_text_after_it() -> None:
    ids = byte_level_tokenizer().encode("Hello world").ids
    d = detok(stop=["lo"])
    assert d.update(ids) == "lo"
    assert d.output_text == "Hel"
    d = detok(stop=["lo"], include_stop_str_in_output=True)
    assert d.update(ids) == "lo"
    assert d.output_text == "Hello"


def test_several_stop_strings_the_first_to_complete_wins() -> None:
    ids = byte_level_tokenizer().encode("The quick brown fox jumps").ids
    d = detok(stop=["fox", "quick", "jumps"])
    assert d.update(ids) == "quick"
    assert d.output_text == "The "
    # "bc" completes (at char 3) before "abcd" (at char 4), although "abcd" starts first: the
    # result does not depend on how the text is split into tokens.
    d = detok(stop=["abcd", "bc"])
    assert d.update([byte_token(c) for c in "xabcd"]) == "bc"
    assert d.output_text == "xa"
    # At the same end, the longest match wins.
    d = detok(stop=["bc", "abc"])
    assert d.update([byte_token(c) for c in "xabc"]) == "abc"
    assert d.output_text == "x"


def test_stop_string_of_multibyte_characters_split_across_tokens() -> None:
    tokenizer = byte_level_tokenizer()
    ids = tokenizer.encode("你好，世界！今天").ids
    d = detok(stop=["世界"])
    for token_id in ids:
        if d.update([token_id]) is not None:
            break
    assert d.stop_string == "世界"
    assert d.output_text == "你好，"


def test_stop_string_in_the_prompt_does_not_stop() -> None:
    tokenizer = byte_level_tokenizer()
    d = detok(stop=["Hello"], prompt=tokenizer.encode("Hello").ids)
    assert d.update(tokenizer.encode(" world").ids) is None
    assert d.output_text == " world"


def test_skip_special_tokens() -> None:
    tokenizer = byte_level_tokenizer()
    eos = tokenizer.token_to_id("</s>")
    ids = [*tokenizer.encode("Hi").ids, eos]
    d = detok()
    d.update(ids, finished=True)
    assert d.output_text == "Hi"
    d = detok(skip_special_tokens=False)
    d.update(ids, finished=True)
    assert d.output_text == "Hi</s>"


def test_no_tokenizer_keeps_text_empty_and_refuses_stop_strings() -> None:
    d = IncrementalDetokenizer(None, [1, 2], SamplingParams())
    assert d.update([5, 6]) is None
    assert d.update([7], finished=True) is None
    assert d.output_text == "" and d.token_ids == [5, 6, 7] and d.finished
    with pytest.raises(ValueError, match="SamplingParams.stop needs a tokenizer"):
        IncrementalDetokenizer(None, [1], SamplingParams(stop=["x"]))


def test_streaming_holds_back_a_possible_stop_string_start() -> None:
    d = detok(stop=["abc"])
    streamed = []
    for c in "xyab":
        d.update([byte_token(c)])
        streamed.append(d.get_next_output_text(finished=False, delta=True))
    # "ab" may begin "abc": held back (2 = len("abc") - 1 characters).
    assert "".join(streamed) == "xy"
    assert d.get_next_output_text(finished=False, delta=False) == "xy"
    d.update([byte_token("d")], finished=True)
    assert d.get_next_output_text(finished=True, delta=True) == "abd"
    assert d.output_text == "xyabd"


def test_streamed_deltas_add_up_to_the_final_text_when_a_stop_string_hits() -> None:
    d = detok(stop=["lo w"])
    streamed = []
    for token_id in byte_level_tokenizer().encode("Hello world").ids:
        if d.update([token_id]) is not None:
            break
        streamed.append(d.get_next_output_text(finished=False, delta=True))
    streamed.append(d.get_next_output_text(finished=True, delta=True))
    assert "".join(streamed) == d.output_text == "Hel"


def test_misuse_raises() -> None:
    d = detok()
    d.update([byte_token("a")])
    with pytest.raises(RuntimeError, match="finished=True"):
        d.get_next_output_text(finished=True, delta=False)
    d.update([], finished=True)
    with pytest.raises(RuntimeError, match="after the output finished"):
        d.update([byte_token("b")])


def test_decode_logprob_tokens() -> None:
    tokenizer = byte_level_tokenizer()
    ids = tokenizer.encode("Hello world").ids
    assert decode_logprob_tokens(tokenizer, ids) == ["Hel", "lo", " ", "wor", "ld"]
    eos = tokenizer.token_to_id("</s>")
    assert decode_logprob_tokens(tokenizer, [eos]) == ["</s>"]


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_incremental_text_equals_full_decode_for_random_tokens(data: st.DataObject) -> None:
    tokenizer = byte_level_tokenizer()
    token = st.integers(0, tokenizer.get_vocab_size() - 1)
    prompt = data.draw(st.lists(token, max_size=8), label="prompt")
    output = data.draw(st.lists(token, min_size=1, max_size=40), label="output")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    # Update boundaries: one token at a time, several at once, or all in one update.
    cuts = data.draw(st.sets(st.integers(1, len(output))), label="cuts")
    d = IncrementalDetokenizer(tokenizer, prompt, SamplingParams(skip_special_tokens=skip))
    bounds = [0, *sorted(cuts - {len(output)}), len(output)]
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        d.update(output[lo:hi], finished=hi == len(output))
        full = tokenizer.decode(output[:hi], skip_special_tokens=skip)
        if hi < len(output):
            assert not d.output_text.endswith(FFFD)
            assert full.startswith(d.output_text)
            if not full.endswith(FFFD):
                assert d.output_text == full
    assert d.output_text == tokenizer.decode(output, skip_special_tokens=skip)
