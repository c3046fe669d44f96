"""The continuous-batching server through HTTP with the official openai client: concurrent
streams give the texts of serial requests, clients that leave free their blocks at once, and the
server keeps serving."""

import asyncio
import time

import pytest

from common.tools.testing import SERVER_STACK, require

require(*SERVER_STACK)  # before the imports that need them: without them, this module skips

import httpx
from openai import AsyncOpenAI, OpenAI

from live_server import http, serve

MODEL = "tiny-llama3"
PROMPTS = [f"Tell me about the number {i}." + " And more." * (i % 5) for i in range(16)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve(
        tmp_path_factory.mktemp("logs"), MODEL, "--kv-cache-memory-gb", "0.05", "--max-num-batched-tokens", "64"
    ) as s:
        yield s


def health(url):
    return http.get(url + "/health", timeout=5).json()


async def stream_text(client: AsyncOpenAI, prompt: str, max_tokens: int = 24) -> str:
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=max_tokens, stream=True
    )
    text = ""
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    return text


def test_16_concurrent_streams_equal_serial_requests(server):
    url = server[0]
    serial = OpenAI(base_url=url + "/v1", api_key="none")
    want = [
        serial.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": p}], temperature=0, max_tokens=24
        )
        .choices[0]
        .message.content
        for p in PROMPTS
    ]

    async def together():
        client = AsyncOpenAI(base_url=url + "/v1", api_key="none")
        busiest = 0

        async def watch():
            nonlocal busiest
            async with httpx.AsyncClient() as h:
                while True:
                    busiest = max(busiest, (await h.get(url + "/health")).json()["running"])
                    await asyncio.sleep(0.02)

        watcher = asyncio.create_task(watch())
        try:
            return await asyncio.gather(*[stream_text(client, p) for p in PROMPTS]), busiest
        finally:
            watcher.cancel()

    got, busiest = asyncio.run(together())
    assert got == want
    assert busiest > 1, "the streams never ran together"
    assert health(url)["kv_blocks_used"] == 0


def test_clients_that_disconnect_mid_stream_free_their_blocks(server):
    url = server[0]

    async def leave_early(i):
        async with httpx.AsyncClient(timeout=30) as h:
            body = {"model": MODEL, "prompt": PROMPTS[i], "max_tokens": 2000, "ignore_eos": True, "stream": True}
            async with h.stream("POST", url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data:")
                    if seen >= 3 + i % 4:
                        return  # the client hangs up in the middle of its stream

    async def storm():
        await asyncio.gather(*[leave_early(i) for i in range(12)])

    asyncio.run(storm())
    deadline = time.time() + 10
    while time.time() < deadline and (h := health(url))["kv_blocks_used"]:
        time.sleep(0.05)
    h = health(url)
    assert h["kv_blocks_used"] == 0 and h["running"] == 0 and h["waiting"] == 0, h
    # and the server still answers
    reply = OpenAI(base_url=url + "/v1", api_key="none").completions.create(model=MODEL, prompt="Hi", max_tokens=4)
    assert reply.choices[0].finish_reason in ("length", "stop")


def test_n_choices_through_http(server):
    client = OpenAI(base_url=server[0] + "/v1", api_key="none")
    reply = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=10, n=3, temperature=0)
    texts = [c.text for c in reply.choices]
    assert len(texts) == 3 and texts[0] == texts[1] == texts[2]  # greedy: every choice the same


def test_a_request_the_pool_can_never_hold_is_a_400(server):
    url = server[0]
    total = health(url)["kv_blocks_total"] * 16
    r = http.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": total + 1}, timeout=10)
    assert r.status_code == 400
    assert "KV cache holds" in r.json()["error"]["message"]


def test_health_reports_the_engine(server):
    h = health(server[0])
    for key in (
        "running",
        "waiting",
        "kv_blocks_total",
        "kv_blocks_used",
        "kv_blocks_free",
        "kv_blocks_cached",
        "prefix_cache_hit_rate",
        "preemptions",
    ):
        assert key in h
    assert h["kv_blocks_used"] + h["kv_blocks_free"] == h["kv_blocks_total"] > 0


def test_health_counts_a_finished_reply_as_soon_as_the_client_has_it():
    # /health's figures were refreshed after the step's replies went out: a client reading it as its
    # reply ended could still see its request running (and, with speculation, its last drafts
    # uncounted). A slow stats() makes the old order lose that race every time.
    import asyncio as aio
    import time

    from common.models import resolve_model
    from common.tokenizer import Tokenizer
    from engine import Engine, Request
    from model import load_model
    from sampling import SamplingParams
    from worker import Worker

    d = resolve_model(MODEL)
    engine = Engine(load_model(d), Tokenizer(d), {}, num_blocks=64)
    real_stats = engine.stats
    engine.stats = lambda: (time.sleep(0.2), real_stats())[1]

    async def run():
        job = worker.submit(Request([5, 6, 7], SamplingParams(temperature=0), max_tokens=2, ignore_eos=True))
        while await job.next_events() is not None:
            pass
        return dict(worker.stats)

    worker = Worker(lambda: engine)
    seen = aio.run(run())
    assert (seen["running"], seen["waiting"]) == (0, 0), seen


def test_health_counts_a_request_while_its_first_step_runs(tmp_path):
    """The engine loop refreshes /health's figures when it takes requests in, not only after the step."""
    import asyncio as aio

    from common.models import resolve_model
    from common.tokenizer import Tokenizer
    from engine import Engine, Request
    from model import load_model
    from sampling import SamplingParams
    from worker import Worker

    d = resolve_model(MODEL)
    engine = Engine(load_model(d), Tokenizer(d), {}, num_blocks=400, chunked_prefill=False)
    real_step = engine.step
    seen = []
    engine.step = lambda: (seen.append(dict(worker.stats)), real_step())[1]

    async def run():
        job = worker.submit(Request([5] * 300, SamplingParams(temperature=0), max_tokens=1, ignore_eos=True))
        while await job.next_events() is not None:
            pass

    worker = Worker(lambda: engine)
    aio.run(run())
    assert seen and seen[0]["waiting"] + seen[0]["running"] == 1
