"""LoRA adapters through the HTTP server (tiny model, float32, a live server.py): a request's
`model` picks the adapter and gets the engine's tokens for it, /v1/models lists the adapters,
adapters load and unload while a stream runs (at tensor-parallel size 2 too), and every bad name or
adapter gets its own error."""

import json
import threading

import httpx
import pytest

from engine import Request, build_engine
from live_server import http, serve
from peft_adapters import hf_base, make_adapter
from sampling import SamplingParams

MODEL = "tiny-llama3"
PROMPT = [1, 400, 401, 402, 403, 404, 405]
N = 8


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root, base = tmp_path_factory.mktemp("adapters"), hf_base()
    return {
        "a": make_adapter(root / "a", 4, seed=1, size=0.1, base=base),
        "b": make_adapter(root / "b", 8, ["q_proj", "v_proj", "down_proj"], seed=2, size=0.1, base=base),
        "late": make_adapter(root / "late", 2, ["o_proj", "up_proj"], seed=3, size=0.1, base=base),
    }


@pytest.fixture(scope="module")
def expected(paths):
    """Each adapter's (and the base's) greedy text of N tokens from the engine in this process."""
    engine, _ = build_engine(MODEL, "cpu", "float32", lora_modules=paths, num_blocks=64)
    names = [None, *paths]
    outs = engine.generate([Request(PROMPT, SamplingParams(temperature=0), max_tokens=N, ignore_eos=True, adapter=a) for a in names])
    return {a: out[0].text for a, out in zip(names, outs)}


@pytest.fixture(scope="module")
def server(tmp_path_factory, paths):
    flags = ["--lora-modules", f"a={paths['a']}", f"b={paths['b']}", "--max-loras", "2", "--max-lora-rank", "8"]
    with serve(tmp_path_factory.mktemp("lora-server"), MODEL, *flags) as (url, _proc, log):
        yield url, log


def complete(url: str, model: str | None, **extra) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True, **extra}
    if model is not None:
        body["model"] = model
    return http.post(url + "/v1/completions", json=body, timeout=120)


def text_of(reply: dict) -> str:
    return reply["choices"][0]["text"]


def stream_text(url: str, body: dict, on_chunk=lambda: None) -> tuple[str, int]:
    """A streamed completion's text and its number of tokens (from the final usage chunk)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    text, n = "", 0
    with http.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    text += chunk["choices"][0]["text"]
                    on_chunk()
                if chunk.get("usage"):
                    n = chunk["usage"]["completion_tokens"]
    return text, n


def test_the_model_field_picks_the_adapter_and_the_models_list_names_them(server, paths, expected):
    url, log = server
    assert "LoRA: 2 adapters, 2 slots of rank up to 8" in log.read_text()
    data = http.get(url + "/v1/models").json()["data"]
    assert [m["id"] for m in data] == [MODEL, "a", "b"]
    assert data[1]["parent"] == MODEL and data[1]["root"] == str(paths["a"])
    for model, adapter in ((MODEL, None), (None, None), ("a", "a"), ("b", "b")):
        r = complete(url, model)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == (adapter or MODEL)
        assert text_of(r.json()) == expected[adapter], model
    assert len({tuple(expected[a]) for a in (None, "a", "b")}) == 3  # each adapter says something else


def test_an_unknown_model_is_a_404_that_names_the_adapters(server):
    url, _ = server
    r = complete(url, "nope")
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert err["message"] == f"The model 'nope' does not exist; this server serves '{MODEL}' and the LoRA adapters a, b"


def test_load_and_unload_while_a_stream_runs(server, paths, expected):
    url, log = server
    streamed, errors = [], []

    def stream():  # the base model, streamed, across the load and the unload
        body = {"prompt": PROMPT, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
        try:
            streamed.append(stream_text(url, body))
        except Exception as e:  # noqa: BLE001  (the test thread asserts on it)
            errors.append(e)

    streamer = threading.Thread(target=stream)
    streamer.start()
    r = http.post(url + "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(paths["late"])}, timeout=60)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' added successfully."
    assert "late" in [m["id"] for m in http.get(url + "/v1/models").json()["data"]]
    got = complete(url, "late")
    assert got.status_code == 200 and text_of(got.json()) == expected["late"]
    r = http.post(url + "/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=60)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' removed successfully.", log.read_text()[-3000:]
    assert complete(url, "late").status_code == 404
    assert "late" not in [m["id"] for m in http.get(url + "/v1/models").json()["data"]]
    streamer.join(timeout=120)
    assert not errors and streamed[0][1] == 48
    assert streamed[0][0].startswith(expected[None])  # the base stream never saw the adapters come and go


def streaming(url: str, model: str) -> tuple[threading.Thread, dict]:
    """A 64-token stream of `model` in a thread, once its first chunk has come. -> (the thread, a
    dict that gets its text and token count when it ends)."""
    result, started = {}, threading.Event()
    body = {"model": model, "prompt": PROMPT, "max_tokens": 64, "temperature": 0, "ignore_eos": True}

    def run():
        result["text"], result["n"] = stream_text(url, body, started.set)

    t = threading.Thread(target=run)
    t.start()
    assert started.wait(60)
    return t, result


def test_unloading_an_adapter_in_use_lets_its_request_finish_with_it(server, expected):
    url, _ = server
    t, result = streaming(url, "b")
    r = http.post(url + "/v1/unload_lora_adapter", json={"lora_name": "b"}, timeout=60)
    assert r.status_code == 200
    t.join(timeout=120)
    assert result["n"] == 64 and result["text"].startswith(expected["b"])
    assert complete(url, "b").status_code == 404


def test_load_inplace_gives_new_requests_the_new_weights_while_a_running_one_keeps_the_old(server, paths, expected):
    # vLLM's `load_inplace` (its clients send it): refused as an unknown field before
    url, _ = server
    t, result = streaming(url, "a")  # ("a": the test before this one unloads "b")
    load = {"lora_name": "a", "lora_path": str(paths["late"]), "load_inplace": True}
    r = http.post(url + "/v1/load_lora_adapter", json=load, timeout=60)
    assert r.status_code == 200, r.text
    assert text_of(complete(url, "a").json()) == expected["late"]  # the new weights, under the old name
    t.join(timeout=120)
    assert result["n"] == 64 and result["text"].startswith(expected["a"])  # the old ones to its end
    r = http.post(url + "/v1/load_lora_adapter", json=load | {"lora_path": str(paths["a"])}, timeout=60)
    assert r.status_code == 200 and text_of(complete(url, "a").json()) == expected["a"]


def test_a_load_in_place_and_an_unload_in_flight_at_once_leave_the_servers_list_as_the_engines(paths):
    # The routes in this process, both calls submitted before the engine thread runs either: the
    # load used to put the name back on the server's list after the unload had taken it off the
    # engine's, and /v1/models then listed an adapter no request could use.
    import asyncio
    from types import SimpleNamespace

    from lora_routes import LoadLoraRequest, UnloadLoraRequest, load_lora_adapter, unload_lora_adapter
    from worker import Worker

    engine, _ = build_engine(MODEL, "cpu", "float32", lora_modules={"x": paths["a"]}, num_blocks=64)
    state = SimpleNamespace(worker=Worker(lambda: engine), model_name=MODEL, adapters={"x": str(paths["a"])})
    http_request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(server=state)))
    load = LoadLoraRequest(lora_name="x", lora_path=str(paths["b"]), load_inplace=True)

    async def both():
        return await asyncio.gather(
            load_lora_adapter(load, http_request), unload_lora_adapter(UnloadLoraRequest(lora_name="x"), http_request)
        )

    answers = asyncio.run(both())
    assert [a.split()[-1] for a in answers] == ["successfully."] * 2
    assert engine.adapters.names() == [] and state.adapters == {}


@pytest.mark.parametrize(
    "path, body, status, message",
    [
        ("load", {"lora_name": "x", "lora_path": "/nonexistent/adapter"}, 400, "/nonexistent/adapter"),
        ("load", {"lora_name": "a", "lora_path": "{a}"}, 400, "LoRA adapter 'a' is already loaded; unload it first"),
        ("load", {"lora_name": MODEL, "lora_path": "{a}"}, 400, "is the base model's name"),
        ("load", {"lora_name": "x"}, 400, "lora_path"),
        ("load", {"lora_name": "x", "lora_path": "{a}", "rank": 3}, 400, "rank"),
        ("unload", {"lora_name": "never-loaded"}, 404, "no LoRA adapter named 'never-loaded' is loaded"),
        ("unload", {}, 400, "lora_name"),
        ("load", {"lora_name": "x", "lora_path": "{a}", "load_inplace": "yes"}, 400, "load_inplace"),  # read as true
        ("load", {"lora_name": "x" * 100_000, "lora_path": "{a}"}, 400, "lora_name"),  # then in every 404, whole
    ],
    ids=[
        "missing-dir", "name-in-use", "base-name", "no-path", "unknown-field", "unknown-unload", "no-name",
        "inplace-not-bool", "name-too-long",
    ],  # fmt: skip
)
def test_bad_load_and_unload_requests_get_their_error(server, paths, path, body, status, message):
    url, _ = server
    body = {k: v.format(a=paths["a"]) if isinstance(v, str) else v for k, v in body.items()}
    r = http.post(url + f"/v1/{path}_lora_adapter", json=body, timeout=60)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]


def test_an_adapter_over_the_rank_limit_is_refused_and_the_server_keeps_serving(server, tmp_path, expected):
    url, _ = server
    big = make_adapter(tmp_path / "r16", 16, ["q_proj"], seed=4)
    r = http.post(url + "/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(big)}, timeout=60)
    assert r.status_code == 400 and "16" in r.json()["error"]["message"], r.text
    assert text_of(complete(url, "a").json()) == expected["a"]


def test_a_bad_adapter_at_startup_is_one_line(tmp_path, capsys):
    from common.tools.warm_python import run_python
    from live_server import CHAPTER
    from server import parse_args

    def refused(*flags: str) -> str:  # the parser's exit 2 and its message, asked in-process
        with pytest.raises(SystemExit) as stopped:
            parse_args(["--model", MODEL, *flags])
        assert stopped.value.code == 2
        return capsys.readouterr().err

    # A missing directory is a usage error before anything loads.
    missing = f"x={tmp_path / 'missing'}"
    assert f"--lora-modules {missing}: no such directory" in refused("--lora-modules", missing)
    assert "--lora-modules takes NAME=PATH pairs, got 'no-equals-sign'" in refused("--lora-modules", "no-equals-sign")
    # The base model's name, as --model gives it or --served-model-name: a request naming it gets the base.
    for flags, name in (([], MODEL), (["--served-model-name", "base"], "base")):
        err = refused(*flags, "--lora-modules", f"{name}={tmp_path}")
        assert f"'{name}' is the base model's name; give the adapter another" in err
    # A directory that is no adapter: the engine's sentence, one line, no traceback.
    (tmp_path / "empty").mkdir()
    flags = ["--device", "cpu", "--max-model-len", "256", "--kv-cache-memory-gb", "0.01"]
    r = run_python(["server.py", "--model", MODEL, *flags, "--lora-modules", f"x={tmp_path / 'empty'}"], cwd=CHAPTER, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and str(tmp_path / "empty") in last, r.stderr
    r = run_python(["server.py", "--model", MODEL, *flags, "--max-loras", "2", "--max-cpu-loras", "1"], cwd=CHAPTER, timeout=300)
    assert r.returncode == 2 and "error: --max-cpu-loras must be at least --max-loras (2), got 1" in r.stderr, r.stderr


def test_at_tensor_parallel_size_2_adapters_load_and_answer_as_at_1(tmp_path, paths, expected):
    """The load runs on the engine thread, which sends it to the other rank: both ranks read their
    slices of the new adapter, and the answers are TP=1's."""
    with serve(tmp_path, MODEL, "--tensor-parallel-size", "2", "--lora-modules", f"a={paths['a']}") as (url, _proc, log):
        assert "tensor parallel: 2 ranks" in log.read_text()
        r = http.post(url + "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(paths["late"])}, timeout=60)
        assert r.status_code == 200, r.text
        for model in ("a", "late", MODEL):
            assert text_of(complete(url, model).json()) == expected[None if model == MODEL else model], model
        assert http.post(url + "/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=60).status_code == 200
        assert complete(url, "late").status_code == 404


def test_an_adapter_gone_between_the_servers_check_and_the_engines_is_a_404(paths):
    # An unload can land between the server's look at its list and the engine's: that request got
    # a 400 "unknown LoRA adapter" with no field, where the same name a moment later is a 404
    from lora_slots import UnknownAdapter
    from server import refused

    engine, _ = build_engine(MODEL, "cpu", "float32", lora_modules={"a": paths["a"]}, num_blocks=8)
    engine.adapters.unregister("a")
    with pytest.raises(UnknownAdapter) as caught:
        engine.validate(Request(PROMPT, adapter="a"))
    error = refused(caught.value)
    assert (error.status, error.param, error.code) == (404, "model", "model_not_found")
    assert error.message == "unknown LoRA adapter 'a' (loaded: none)"


def test_a_load_into_a_server_without_slots_names_the_flag_not_the_path(tmp_path, paths):
    with serve(tmp_path, MODEL, "--max-loras", "0") as (url, _proc, _log):
        r = http.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(paths["a"])}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] is None, r.text
    assert "start it with --max-loras (max_loras) of 1 or more" in r.json()["error"]["message"]


def test_lora_modules_take_a_prepared_adapters_name_as_cli_lora_does():
    # a path relative to the repository (the README's) is no path in a chapter copied out
    import argparse

    from common.models import MODELS_DIR, is_adapter_prepared
    from server import lora_modules

    if not is_adapter_prepared(MODELS_DIR / "smollm2-135m-lora-pirate"):
        pytest.skip("the pirate adapter is not prepared here (make models)")
    got = lora_modules(argparse.ArgumentParser(), ["pirate=smollm2-135m-lora-pirate"], "smollm2-135m")
    assert got == {"pirate": str(MODELS_DIR / "smollm2-135m-lora-pirate")}
