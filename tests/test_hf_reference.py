"""The HF reference's answers are kept on disk, and asked again whenever anything they depend on changes."""

import os
import shutil

import numpy as np
import pytest

import common.hf_reference as ref
from common.models import resolve_model

IDS = [1, 5, 9, 13, 2]


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A copy of the tiny model (its files may be touched), a cache of its own, and a count of HF's runs."""
    d = tmp_path / "tiny"
    shutil.copytree(resolve_model("tiny-llama3"), d)
    monkeypatch.setattr(ref, "MODELS_DIR", tmp_path / "models")
    monkeypatch.delenv("HF_REFERENCE_CACHE", raising=False)
    runs = []
    for name in ("_hidden_states", "_greedy"):
        real = getattr(ref, name)
        monkeypatch.setattr(ref, name, lambda *a, real=real, name=name: runs.append(name) or real(*a))
    return d, runs


def test_a_second_question_is_answered_from_disk_with_the_same_arrays(tiny):
    d, runs = tiny
    first, tokens = ref.hf_hidden_states(d, IDS), ref.hf_greedy(d, IDS, 6)
    again, tokens_again = ref.hf_hidden_states(d, IDS), ref.hf_greedy(d, IDS, 6)
    assert runs == ["_hidden_states", "_greedy"]
    assert list(again) == list(first) and all(np.array_equal(again[k], first[k]) for k in first)
    assert tokens_again == tokens and all(type(t) is int for t in tokens)


def test_another_input_length_or_dtype_asks_hf_again(tiny):
    import torch

    d, runs = tiny
    ref.hf_greedy(d, IDS, 6)
    ref.hf_greedy(d, IDS, 7)
    ref.hf_greedy(d, IDS[:-1], 6)
    ref.hf_hidden_states(d, IDS)
    ref.hf_hidden_states(d, IDS, torch.bfloat16)
    assert runs == ["_greedy"] * 3 + ["_hidden_states"] * 2


def test_a_changed_checkpoint_file_asks_hf_again(tiny):
    d, runs = tiny
    ref.hf_greedy(d, IDS, 6)
    weights = d / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    ref.hf_greedy(d, IDS, 6)
    assert runs == ["_greedy", "_greedy"]


def test_the_cache_can_be_turned_off(tiny, monkeypatch):
    d, runs = tiny
    monkeypatch.setenv("HF_REFERENCE_CACHE", "0")
    ref.hf_greedy(d, IDS, 6)
    ref.hf_greedy(d, IDS, 6)
    assert runs == ["_greedy", "_greedy"] and not (ref.MODELS_DIR / ".hf_reference").exists()
