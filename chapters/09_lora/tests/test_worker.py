"""The worker builds the engine on its own thread, which is then the one thread that computes:
a second thread running OpenMP regions would make every decode step pay thread wake-ups (worker.py)."""

import threading

import pytest
from engine import build_engine
from worker import Worker

from common.errors import UserError


def test_the_engine_is_built_on_the_thread_that_steps_it():
    built_on = []

    def build():
        built_on.append(threading.current_thread())
        # a short context: without it the pool (chapters 05 on) takes a quarter of the free memory,
        # gigabytes of zeros for tiny-llama3's 131072-token context, and its building is not the point
        return build_engine("tiny-llama3", "cpu", "float32", max_model_len=256)[0]

    worker = Worker(build)
    (thread,) = built_on
    assert thread is not threading.main_thread() and thread.is_alive()  # now the worker's loop
    assert thread.name.startswith("engine") and worker.engine is not None


def test_an_engine_that_fails_to_build_is_the_caller_s_error():
    def build():
        raise UserError("model 'nowhere' not found")

    with pytest.raises(UserError, match="model 'nowhere' not found"):
        Worker(build)
