import pytest
from transformers import AutoTokenizer

from common.models import resolve_model
from common.tokenizer import Tokenizer, TokenizerError

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "你好，世界！这是一个测试。",
    "emoji 🙂🚀👩‍👩‍👧 and ñ, é, ß",
    "  leading and trailing spaces  ",
    "\n\nnewlines\nand\ttabs\n",
    "<|im_start|>user\nspecial tokens in text<|im_end|>",
    "",
]


@pytest.fixture(scope="module", params=["smollm2-135m", "tiny-llama3"])
def pair(request):
    d = resolve_model(request.param)
    return Tokenizer(d), AutoTokenizer.from_pretrained(str(d))


@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_transformers_and_round_trip(pair, text):
    ours, hf = pair
    ids = ours.encode(text)
    assert ids == hf.encode(text)
    assert ours.decode(ids) == hf.decode(ids) == text


def test_special_tokens(pair):
    ours, _ = pair
    assert (ours.bos_token, ours.bos_id, ours.eos_token, ours.eos_id) == ("<|im_start|>", 1, "<|im_end|>", 2)
    ids = ours.encode("<|im_start|>hi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert ours.decode(ids, skip_special_tokens=True) == "hi"


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "你好 🙂"},
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(pair, messages, add_generation_prompt):
    ours, hf = pair
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)["input_ids"]
    assert ours.encode_chat(messages, add_generation_prompt) == ids


def test_malformed_messages_are_rejected(pair):
    with pytest.raises(TokenizerError, match="message 0 must be an object with 'role' and 'content'"):
        pair[0].apply_chat_template([{"text": "hi"}])


def test_missing_tokenizer(tmp_path):
    with pytest.raises(TokenizerError, match="has no tokenizer.json"):
        Tokenizer(tmp_path)
