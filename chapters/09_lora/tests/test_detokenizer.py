"""The streaming detokenizer against the one-shot decode, on the bundled SmolLM2 tokenizer
(a GPT-2 style byte-level BPE, where one character is often several tokens)."""

import random

import pytest

from common.models import resolve_model
from common.tokenizer import Tokenizer
from detokenizer import (
    MAX_PENDING_TOKENS,
    REPLACEMENT,
    IncrementalDetokenizer,
    bytes_to_unicode,
    is_byte_level,
    token_bytes,
)

TEXTS = {
    "chinese": "你好，世界！今天天气很好，我们去公园散步吧。",
    "emoji": "I ❤️ llamas 🦙🦙! Family: 👩‍👩‍👧 and 👨🏽‍💻, flags 🇫🇷🇯🇵🏳️‍🌈.",
    "mixed_scripts": "Привет, мир! こんにちは 안녕하세요 مرحبا नमस्ते Γειά σου ∑x² ≤ ∞",
    "accented_latin": "Crème brûlée à la française, naïve façade, Ærøskøbing, Łódź, São Paulo",
    "spaces_and_newlines": "   leading spaces\n\n\ttabs and  double  spaces  \n trailing \n\n",
    "code": 'def f(x):\n    return x ** 2  # squares, ü\n\nprint(f"{f(3)}")\n',
}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(resolve_model("smollm2-135m"))


def stream(tok, ids, skip_special_tokens=True, prompt_ids=None):
    """Feeds ids one by one; returns (the delta of each token, what flush returned, the detokenizer)."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens, prompt_ids=prompt_ids)
    deltas = [detok.add(i) for i in ids]
    return deltas, detok.flush(), detok


def byte_token_ids(tok, data: bytes) -> list[int]:
    """One single-byte token per byte: the most broken-up way to spell `data`."""
    table = bytes_to_unicode()
    ids = [tok.token_to_id(table[b]) for b in data]
    assert None not in ids, "a byte with no token of its own in this vocabulary"
    return ids


def test_bytes_to_unicode_matches_the_vocabulary(tok):
    table = bytes_to_unicode()
    assert len(set(table.values())) == 256
    assert table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ" and table[ord("A")] == "A"
    # Each byte's stand-in is a token of its own, decoding to that byte. SmolLM2's vocabulary
    # lacks a few (0xC0, 0xC1 and 0xF5-0xFF never occur in UTF-8, some controls never in its data).
    present = 0
    for b, char in table.items():
        token_id = tok.token_to_id(char)
        if token_id is not None:
            present += 1
            assert tok.decode([token_id]) == bytes([b]).decode("utf-8", errors="replace")
    assert present >= 230
    assert is_byte_level(tok)


@pytest.mark.parametrize("name", TEXTS)
def test_stream_equals_one_shot_decode(tok, name):
    ids = tok.encode(TEXTS[name], add_special_tokens=False)
    deltas, tail, detok = stream(tok, ids)
    one_shot = tok.decode(ids, skip_special_tokens=True)
    assert one_shot == TEXTS[name]  # the tokenizer itself round-trips these texts
    assert REPLACEMENT not in one_shot
    for delta in deltas:
        assert REPLACEMENT not in delta  # never half a character
    assert "".join(deltas) + tail == one_shot
    assert tail == ""  # every character was complete by the last token
    assert detok.text == one_shot


@pytest.mark.parametrize("name", ["chinese", "emoji", "mixed_scripts", "accented_latin"])
def test_partial_characters_are_held_back(tok, name):
    """A token that ends inside a multi-byte character emits "" (the whole token waits, so a
    piece like 'Ġâ', a space plus the first byte of '❤', waits with its space), and once a token
    ends on a character boundary everything up to there has been emitted."""
    ids = tok.encode(TEXTS[name], add_special_tokens=False)
    reference = _Utf8Boundary()
    detok = IncrementalDetokenizer(tok)
    emitted, held = "", 0
    for i in ids:
        delta = detok.add(i)
        emitted += delta
        whole_characters = reference.feed(token_bytes(tok, i))
        if reference.pending:
            assert delta == ""
            held += 1
        else:
            assert emitted == whole_characters
    assert held > 0, "the text should contain tokens that end inside a character"


class _Utf8Boundary:
    """The reference: which prefix of the byte stream is whole characters (Python's own decoder)."""

    def __init__(self):
        import codecs

        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self.text = ""

    def feed(self, data: bytes) -> str:
        self.text += self._decoder.decode(data)
        return self.text

    @property
    def pending(self) -> int:
        return len(self._decoder.getstate()[0])


@pytest.mark.parametrize("char", ["é", "中", "€", "🦙", "👩‍👩‍👧", "🇫🇷"])
def test_single_byte_tokens_emit_nothing_until_the_character_is_complete(tok, char):
    ids = byte_token_ids(tok, char.encode("utf-8"))
    deltas, tail, _ = stream(tok, ids)
    # Every code point is emitted by the token carrying its last byte, and only then.
    expected = []
    for code_point in char:
        n = len(code_point.encode("utf-8"))
        expected += [""] * (n - 1) + [code_point]
    assert deltas == expected
    assert tail == ""


def test_token_bytes_rebuilds_split_characters(tok):
    for text in [*TEXTS.values(), "中", "🦙", "👩‍👩‍👧"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(token_bytes(tok, i) for i in ids) == text.encode("utf-8")
        byte_ids = byte_token_ids(tok, text.encode("utf-8"))
        assert [token_bytes(tok, i) for i in byte_ids] == [bytes([b]) for b in text.encode("utf-8")]


def test_token_bytes_of_special_tokens_and_whole_vocabulary(tok):
    assert token_bytes(tok, tok.eos_id) == tok.eos_token.encode("utf-8") == b"<|im_end|>"
    # Every token's bytes, decoded leniently, give what the tokenizer's own decode gives.
    for i in range(tok.vocab_size):
        assert token_bytes(tok, i).decode("utf-8", errors="replace") == tok.decode([i]), i
    with pytest.raises(ValueError):
        token_bytes(tok, tok.vocab_size + 10)


def test_leading_space_of_the_first_token(tok):
    prompt = tok.encode("The capital of France is", add_special_tokens=False)
    answer = tok.encode(" Paris, of course.", add_special_tokens=False)
    assert tok.id_to_token(answer[0]).startswith("Ġ")  # the space belongs to the first generated token
    for prompt_ids in [None, prompt]:
        deltas, tail, detok = stream(tok, answer, prompt_ids=prompt_ids)
        assert deltas[0] == " Paris"
        assert detok.text == " Paris, of course." == tok.decode(answer)


def test_prompt_context_after_a_chat_template(tok):
    prompt = tok.encode_chat([{"role": "user", "content": "Say hi in Chinese"}])
    answer = tok.encode("你好！ 👋\n", add_special_tokens=False)
    for skip in [True, False]:
        deltas, tail, detok = stream(tok, answer + [tok.eos_id], skip_special_tokens=skip, prompt_ids=prompt)
        assert detok.text == tok.decode(answer + [tok.eos_id], skip_special_tokens=skip)
        assert all(REPLACEMENT not in d for d in deltas)


def test_prompt_ending_inside_a_character_is_not_used_as_context(tok):
    """The prompt ends with two bytes of '中' and the first generated token is the third: the
    generated ids alone decode to a U+FFFD and " ok", and that is what must come out."""
    prompt = tok.encode("Say: ", add_special_tokens=False) + byte_token_ids(tok, "中".encode()[:2])
    generated = byte_token_ids(tok, "中".encode()[2:]) + tok.encode(" ok", add_special_tokens=False)
    deltas, tail, detok = stream(tok, generated, prompt_ids=prompt)
    assert detok.text == tok.decode(generated) == REPLACEMENT + " ok"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, skip):
    ids = (
        [tok.bos_id]
        + tok.encode("assistant\nHello", add_special_tokens=False)
        + [tok.eos_id]
        + tok.encode(" wörld 🦙", add_special_tokens=False)
        + [tok.eos_id]
    )
    deltas, tail, detok = stream(tok, ids, skip_special_tokens=skip)
    assert detok.text == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in detok.text) is not skip
    assert ("<|im_start|>" in detok.text) is not skip
    if not skip:
        assert deltas[0] == "<|im_start|>"  # a special token is emitted as soon as it arrives


def test_special_token_inside_a_split_character(tok):
    """A skipped special token between the bytes of one character: the bytes still join up
    (that is what the one-shot decode does); kept, it breaks the character into U+FFFDs."""
    data = "🦙".encode("utf-8")
    ids = byte_token_ids(tok, data[:2]) + [tok.eos_id] + byte_token_ids(tok, data[2:])
    for skip in [True, False]:
        _, tail, detok = stream(tok, ids, skip_special_tokens=skip)
        assert detok.text == tok.decode(ids, skip_special_tokens=skip)
    assert stream(tok, ids, skip_special_tokens=True)[2].text == "🦙"


def _random_ids(rng, tok, n):
    """Mostly ordinary tokens, with runs of raw byte tokens (lead and continuation bytes) and
    special tokens mixed in, so that invalid and unfinished UTF-8 show up often."""
    table = bytes_to_unicode()
    byte_ids = [tok.token_to_id(table[b]) for b in range(0x80, 0x100) if tok.token_to_id(table[b]) is not None]
    special = sorted(tok.special_ids)
    ids = []
    while len(ids) < n:
        kind = rng.random()
        if kind < 0.5:
            ids.append(rng.randrange(tok.vocab_size))
        elif kind < 0.9:
            ids += [rng.choice(byte_ids) for _ in range(rng.randint(1, 12))]
        else:
            ids.append(rng.choice(special))
    return ids[:n]


@pytest.mark.parametrize("skip", [True, False])
def test_random_sequences_match_one_shot_decode(tok, skip):
    rng = random.Random(1234)
    for trial in range(300):
        if trial % 3 == 0:
            ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))]
        else:
            ids = _random_ids(rng, tok, rng.randint(1, 60))
        deltas, tail, detok = stream(tok, ids, skip_special_tokens=skip)
        one_shot = tok.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas) + tail == one_shot, ids
        assert detok.text == one_shot


class _CountingTokenizer:
    """Wraps a tokenizer and records the longest id list it was asked to decode."""

    def __init__(self, tok):
        self._tok = tok
        self.longest = 0

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def decode(self, ids, skip_special_tokens=False):
        self.longest = max(self.longest, len(ids))
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize(
    "make_ids",
    [
        lambda tok: tok.encode(" ".join(TEXTS.values()) * 20, add_special_tokens=False),
        # 2000 lone continuation bytes: every decode ends in U+FFFD, never a clean end
        lambda tok: byte_token_ids(tok, bytes([0x80 + i % 64 for i in range(2000)])),
        # lead bytes each broken by the next lead byte
        lambda tok: byte_token_ids(tok, bytes([0xE4, 0xB8] * 1000)),
        lambda tok: [tok.eos_id] * 1000,
    ],
    ids=["long_text", "continuation_bytes", "broken_leads", "skipped_specials"],
)
def test_window_stays_bounded(tok, make_ids):
    ids = make_ids(tok)
    counting = _CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting)
    for i in ids:
        detok.add(i)
    detok.flush()
    assert counting.longest <= 2 * MAX_PENDING_TOKENS + 2
    assert detok.text == tok.decode(ids, skip_special_tokens=True)


def test_character_split_by_many_skipped_special_tokens(tok):
    """Skipped special tokens decode to nothing, so they cannot show where a character ends:
    after a run of stray bytes, the first byte of '中' waits through them for the other two."""
    stray_and_lead = byte_token_ids(tok, bytes([0x80] * 10 + [0xE4]))
    ids = stray_and_lead + [tok.eos_id] * 12 + byte_token_ids(tok, bytes([0xB8, 0xAD]))
    deltas, tail, detok = stream(tok, ids)
    assert detok.text == tok.decode(ids, skip_special_tokens=True) == REPLACEMENT * 10 + "中"
    assert "".join(deltas[:-1]) == REPLACEMENT * 10 and deltas[-1] == "中"


@pytest.fixture(scope="module")
def sentencepiece_tok(tmp_path_factory):
    """A tiny tokenizer with a Llama-2 style decoder: '▁' for spaces, <0xNN> byte fallback, and the
    leading space of the whole text stripped, so decoding tokens one by one loses spaces."""
    import tokenizers
    from tokenizers import decoders, models

    vocab = ["<unk>", "<s>", "</s>", "▁Say", "▁Hello", "▁world", "!", "<0xE4>", "<0xB8>", "<0xAD>"]
    hf = tokenizers.Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    hf.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    hf.add_special_tokens(["<s>", "</s>"])
    directory = tmp_path_factory.mktemp("sentencepiece_tok")
    hf.save(str(directory / "tokenizer.json"))
    return Tokenizer(directory)


def test_decoder_that_strips_the_leading_space(sentencepiece_tok):
    t = sentencepiece_tok
    pieces = ["▁Say", "▁Hello", "▁world", "!", "<0xE4>", "<0xB8>", "<0xAD>", "</s>"]
    ids = {piece: t.token_to_id(piece) for piece in pieces}
    assert not is_byte_level(t)
    assert t.decode([ids["▁world"]]) == "world"  # alone, the space is gone
    generated = [ids[p] for p in ["▁Hello", "▁world", "<0xE4>", "<0xB8>", "<0xAD>", "!", "</s>"]]
    deltas, tail, detok = stream(t, generated)
    # The window keeps "▁Hello" as context, so "▁world" keeps its space.
    assert deltas == ["Hello", " world", "", "", "中", "!", ""]
    assert detok.text == t.decode(generated, skip_special_tokens=True) == "Hello world中!"
    # With the prompt as context, the first generated token keeps its space too.
    deltas, tail, detok = stream(t, generated, prompt_ids=[ids["▁Say"]])
    assert deltas[0] == " Hello"
    assert detok.text == " Hello world中!"
