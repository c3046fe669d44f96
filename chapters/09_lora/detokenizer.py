"""Streaming detokenization: generated token ids in, text out, one token at a time.

Decoding each token on its own and concatenating the pieces goes wrong in two ways:

1. Half characters. A byte-level BPE (GPT-2, Llama 3, SmolLM2) works on UTF-8 bytes, so one
   character can be spread over several tokens: "你" is the two tokens 'ä½' + 'ł', i.e. the bytes
   E4 BD + A0. Decoded alone, the first token is an incomplete UTF-8 sequence and comes out as
   U+FFFD "�". So while the decoded text ends in U+FFFD we hold the tokens back: the next token
   may complete the character.
2. Context. Some decoders treat the start of a text specially (SentencePiece ones drop the leading
   space of the first word), so decode([a]) + decode([b]) need not equal decode([a, b]).

The usual fix (Hugging Face TGI and vLLM do the same): keep a short window of tokens, decode it
with and without the new ones, and emit only the difference.

    ids:   ... | prefix ........ | read ........ |
                 already emitted,   not emitted yet
                 decoded only as
                 context

    prefix_text = decode(ids[prefix:read])        what the context decodes to
    new_text    = decode(ids[prefix:])            context plus the pending tokens
    emit new_text[len(prefix_text):]              once it no longer ends in U+FFFD

After an emission the window slides: prefix moves to the old read offset and read to the end,
so each decode covers the last emission plus the pending tokens, a handful of tokens, whatever
the length of the output. That only works if `read` is always a clean cut, a place where the
UTF-8 decoder holds no unfinished sequence: then decoding from there gives the same text as
decoding the whole stream. A decode that does not end in U+FFFD ends on a whole character, so
every offset chosen that way is clean, and the emitted pieces add up to exactly
`tokenizer.decode(all_ids)`.

One case needs more care: output that is not valid UTF-8 at all (a model emitting stray byte
tokens). Its decode may end in U+FFFD token after token, and the window would grow without end.
For byte-level tokenizers `_cut_invalid` then looks for a cut that is clean in effect, so the
window stays bounded and the output stays exact (see its docstring).
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) valid UTF-8

# How many prompt tokens to decode as context before the first generated token. One is enough
# to give its leading space the right treatment; a few more cost nothing.
PROMPT_CONTEXT_TOKENS = 5

# A UTF-8 character is at most 4 bytes, so a byte-level tokenizer never needs more than 4
# pending tokens to finish one (plus any skipped special tokens between them). More pending
# tokens than this means invalid output, and we look for a cut instead of waiting.
MAX_PENDING_TOKENS = 8


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table from byte values to the printable characters a byte-level BPE vocabulary
    is written in.

    BPE vocabularies are stored as JSON strings, and raw bytes like 0x20 (space) or 0x0A
    (newline) or a lone 0xE4 are awkward there. So every byte gets a visible stand-in: bytes
    that are already printable, non-space Latin-1 characters stand for themselves ('A' is 'A',
    0xE4 is 'ä'), and the other 68 (controls, space, 0x7F-0xA0, 0xAD) are moved to U+0100 and up,
    in order. That is why a leading space shows up as 'Ġ' (0x20 is the 33rd moved byte: U+0120)
    and a newline as 'Ċ'.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    moved = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + moved)
            moved += 1
    return table


_CHAR_TO_BYTE = {char: byte for byte, char in bytes_to_unicode().items()}


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The raw bytes one token stands for.

    A byte-level BPE piece maps back through the GPT-2 table character by character ('ä½' is
    E4 BD). Special tokens stand for their own text, encoded as UTF-8. A piece with a character
    outside the table (an added token like a run of real spaces) is taken as UTF-8 text too, which
    is what the byte-level decoder itself does with such a piece.
    """
    piece = tokenizer.id_to_token(int(token_id))
    if piece is None:
        raise ValueError(f"token id {token_id} is not in the vocabulary ({tokenizer.vocab_size} tokens)")
    if token_id in tokenizer.special_ids:
        return piece.encode("utf-8")
    try:
        return bytes(_CHAR_TO_BYTE[char] for char in piece)
    except KeyError:
        return piece.encode("utf-8")


def is_byte_level(tokenizer) -> bool:
    """Whether the tokenizer decodes GPT-2 style, straight from bytes (Llama 3, SmolLM2): its
    vocabulary has the stand-in for a space, 'Ġ', and that token decodes to a space."""
    space = tokenizer.token_to_id(bytes_to_unicode()[ord(" ")])
    return space is not None and tokenizer.decode([space]) == " "


class IncrementalDetokenizer:
    """Turns generated token ids into text as they arrive; see the module docstring.

    `add` returns the text each token completes (often "", while a character is unfinished);
    `flush` at the end returns whatever is still held back. Everything emitted, `text`, equals
    `tokenizer.decode(generated_ids, skip_special_tokens=...)`. With `prompt_ids`, the last few
    prompt tokens are decoded as context so the first generated token reads as it does after the
    prompt; for a byte-level tokenizer that changes nothing, for a SentencePiece one it keeps the
    leading space that decoding from the start would drop.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True, prompt_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._byte_level = is_byte_level(tokenizer)
        # Only the window is kept: older ids are never decoded again, so they are dropped.
        self._ids: list[int] = []
        self._prefix = 0  # start of the window: decoded as context, already emitted
        self._read = 0  # ids[:read] are emitted; ids[read:] are pending
        self._prefix_text = ""  # decode(ids[prefix:read]), kept so each token costs one decode
        self._pieces: list[str] = []
        if prompt_ids:
            context = [int(i) for i in prompt_ids[-PROMPT_CONTEXT_TOKENS:]]
            context_text = self._decode(context)
            # The context must end on a clean cut (see the module docstring). A prompt cut in the
            # middle of a character is better decoded without context than with a wrong one.
            if context_text and not context_text.endswith(REPLACEMENT):
                self._ids, self._read, self._prefix_text = context, len(context), context_text

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    @property
    def pending(self) -> int:
        """How many added tokens are held back, not yet emitted: usually 0, more while a
        character's UTF-8 bytes are spread over tokens that have not all arrived."""
        return len(self._ids) - self._read

    def add(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        return self._emit(final=False)

    def flush(self) -> str:
        """Emits the pending tokens as they decode now, unfinished character and all (as U+FFFD,
        like the one-shot decode). Meant for the end of generation."""
        return self._emit(final=True) if len(self._ids) > self._read else ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _emit(self, final: bool) -> str:
        new_text = self._decode(self._ids[self._prefix :])
        complete = not new_text.endswith(REPLACEMENT)
        if final or (complete and len(new_text) > len(self._prefix_text)):
            delta = self._advance(len(self._ids), new_text)
        elif self._byte_level and len(self._ids) - self._read > MAX_PENDING_TOKENS:
            # Still nothing after many tokens: either they decode to nothing (skipped special
            # tokens: the end is then a clean cut) or the output is not valid UTF-8.
            delta = self._advance(len(self._ids), new_text) if complete else self._cut_invalid(new_text)
        else:
            delta = ""
        if delta:
            self._pieces.append(delta)
        return delta

    def _advance(self, read: int, upto_read_text: str) -> str:
        """Emits the text of ids[old read:read] (`upto_read_text` is decode(ids[prefix:read]))
        and slides the window: the tokens just emitted become the context."""
        delta = upto_read_text[len(self._prefix_text) :]
        self._prefix, self._read = self._read, read
        del self._ids[: self._prefix]
        self._read -= self._prefix
        self._prefix = 0
        self._prefix_text = self._decode(self._ids[: self._read])
        return delta

    def _cut_invalid(self, new_text: str) -> str:
        """Finds a cut j in the pending tokens where the text before it is final, and emits it.

        Split the window at j into head and tail. If the head ends in an unfinished UTF-8
        sequence s, then in the whole stream the tail's first bytes either finish s (a character
        where the head alone shows U+FFFD), continue s and run out or break later (one U+FFFD
        where the tail alone shows more), or break s at once (one U+FFFD, and the tail then
        decodes exactly as it does alone). So decode(head) + decode(tail) == decode(head + tail)
        holds only when s is empty or broken at once, and then no later token can change the
        head's text. The tail must hold at least one byte for the test to mean anything. This
        is exact for a lossy UTF-8 decoder, i.e. byte-level tokenizers, the only ones this runs for.
        """
        for j in range(len(self._ids) - 1, self._read, -1):
            tail = self._decode(self._ids[j:])
            head = self._decode(self._ids[self._prefix : j])
            if tail and head + tail == new_text:
                return self._advance(j, head)
        return ""
