"""The OpenAI server on quantized weights: one HTTP test, apart from test_quant_model.py so that the
model tests skip where only the server changed (common/tools/carried.py)."""

from common.tools.testing import SERVER_STACK, require

PROMPT = "What is the capital of France? Answer in one sentence."


def test_the_server_serves_a_quantized_model(tmp_path):
    require(*SERVER_STACK)
    from openai import OpenAI

    from live_server import serve

    with serve(tmp_path, "smollm2-135m", "--quant", "int8") as (url, proc, log):
        client = OpenAI(base_url=url + "/v1", api_key="none")
        reply = client.chat.completions.create(
            model="smollm2-135m", temperature=0, max_tokens=12, messages=[{"role": "user", "content": PROMPT}]
        )
        assert "Paris" in reply.choices[0].message.content
        stream = client.chat.completions.create(
            model="smollm2-135m",
            temperature=0,
            max_tokens=12,
            stream=True,
            messages=[{"role": "user", "content": PROMPT}],
        )
        assert (
            "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == reply.choices[0].message.content
        )
    assert "serving smollm2-135m (int8 weights, " in log.read_text()
