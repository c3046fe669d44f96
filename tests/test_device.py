"""common.device: --device / DEVICE and --dtype / DTYPE, read as the chapters' scripts read them."""

import pytest
import torch

from common.device import pick_device, pick_dtype
from common.errors import UserError


@pytest.mark.parametrize("name", ["cpu:abc", "cpu:", "cpu:-1", "tpu", "cuda:x"])
def test_a_device_that_is_none_is_a_clear_error(name, monkeypatch):
    # torch.device raised "Invalid device string" with a traceback for the ones with a colon
    monkeypatch.delenv("DEVICE", raising=False)
    with pytest.raises(UserError, match="--device must be auto, cpu, cuda or mps"):
        pick_device(name)


def test_a_device_this_machine_lacks_is_said_so():
    if not torch.backends.mps.is_available():  # mps:0 reached torch and failed in the first tensor op
        with pytest.raises(UserError, match="--device mps:0: MPS is not available"):
            pick_device("mps:0")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="--device cuda:1: torch sees no CUDA device"):
            pick_device("cuda:1")
    else:
        with pytest.raises(UserError, match="CUDA devices"):
            pick_device(f"cuda:{torch.cuda.device_count()}")


def test_the_environment_is_named_when_it_gave_the_value(monkeypatch):
    monkeypatch.setenv("DEVICE", "gpu")
    with pytest.raises(UserError, match="^DEVICE must be"):
        pick_device(None)
    with pytest.raises(UserError, match="^--device must be"):
        pick_device("gpu")  # the flag wins over the environment, and is named
    monkeypatch.setenv("DTYPE", "float64")
    with pytest.raises(UserError, match="^DTYPE must be"):
        pick_dtype(None, torch.device("cpu"))


def test_good_values_pass(monkeypatch):
    monkeypatch.delenv("DEVICE", raising=False)
    monkeypatch.delenv("DTYPE", raising=False)
    assert pick_device("cpu") == torch.device("cpu") and pick_device("cpu:0") == torch.device("cpu:0")
    assert pick_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    assert pick_dtype(None, torch.device("cpu")) == torch.float32
