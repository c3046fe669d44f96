import pytest
import torch

from common.config import load_config
from common.models import ModelNotFoundError, resolve_model
from kv_cache import KVCache
from model import attention_mask


@pytest.fixture(scope="module")
def config():
    try:
        return load_config(resolve_model("smollm2-135m"))
    except ModelNotFoundError as e:  # a bare GPU machine (slurm/gpu_check.sh) has no SmolLM2
        pytest.skip(str(e))


def test_layout_and_bytes(config, device):
    cache = KVCache(config, batch_size=2, max_seq=16, device=device, dtype=torch.bfloat16)
    assert cache.k[0].shape == (2, config.num_key_value_heads, 16, config.head_dim)
    assert len(cache.k) == len(cache.v) == config.num_hidden_layers
    assert cache.nbytes == config.kv_bytes_per_token(2) * 2 * 16 == 23040 * 32


def test_writes_in_place_and_returns_filled_views(config, device):
    cache = KVCache(config, 1, 8, device, torch.float32)
    before = cache.k[3].data_ptr()
    k = torch.randn(1, config.num_key_value_heads, 5, config.head_dim, device=device)
    k_all, v_all = cache.write(3, k, k * 2)
    assert cache.k[3].data_ptr() == before  # no reallocation, no torch.cat growth
    assert k_all.shape[2] == 5 and torch.equal(k_all, k) and torch.equal(v_all, 2 * k)
    cache.length = 5
    k1 = torch.randn(1, config.num_key_value_heads, 1, config.head_dim, device=device)
    k_all, _ = cache.write(3, k1, k1)
    assert k_all.shape[2] == 6 and torch.equal(k_all[:, :, :5], k) and torch.equal(k_all[:, :, 5:], k1)


def test_overflow_is_an_error(config):
    cache = KVCache(config, 1, 4, "cpu", torch.float32)
    cache.length = 4
    with pytest.raises(ValueError, match="KV cache full"):
        cache.write(0, *(torch.zeros(1, config.num_key_value_heads, 1, config.head_dim),) * 2)


def test_max_seq_beyond_context_is_rejected(config):
    with pytest.raises(ValueError, match="exceeds the model's context of 8192 tokens"):
        KVCache(config, 1, 8193, "cpu", torch.float32)


def test_cache_larger_than_memory_is_rejected_before_allocating():
    config = load_config(resolve_model("tiny-llama3"))  # a 131072-token context
    with pytest.raises(MemoryError, match="lower --max-seq or the batch size"):
        KVCache(config, batch_size=100_000, max_seq=131072, device="cpu", dtype=torch.float32)


def test_attention_mask_causal_padding_and_decode():
    assert attention_mask(7, 1, None, "cpu") is None  # one new token sees every filled slot
    m = attention_mask(0, 4, None, "cpu")[0]  # [new, keys]
    assert torch.equal(m, torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    m = attention_mask(0, 4, torch.tensor([0, 2]), "cpu")  # second sequence left-padded by 2
    assert m.shape == (2, 1, 4, 4)
    assert torch.equal(m[1, 0, 3], torch.tensor([False, False, True, True]))
    assert torch.equal(m[1, 0, 0], torch.tensor([True, False, False, False]))  # a pad query sees only itself
    m = attention_mask(4, 1, torch.tensor([0, 2]), "cpu")  # decode with padding
    assert torch.equal(m[1, 0, 0], torch.tensor([False, False, True, True, True]))
