"""`POST /v1/embeddings` on `llmserve serve all-MiniLM-L6-v2` (one server for the module), through the
official openai client: both encodings, batches against single inputs, the errors, and aborts."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest

from benchmarks.embeddings import Workload
from tests.entrypoints.remote_server import RemoteServer

MODEL = "all-MiniLM-L6-v2"
SENTENCES = ["A short one.", *Workload(7, seed=3).sentences(), "Another, a little longer, sentence here."]


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    remote = RemoteServer([MODEL, "--disable-log-stats"])
    yield remote
    remote.stop()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused") as c:
        yield c


def metric(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(f"llmserve:{name}{{"))
    return float(line.rsplit(" ", 1)[1])


def vectors(response: openai.types.CreateEmbeddingResponse) -> np.ndarray:
    assert [d.index for d in response.data] == list(range(len(response.data)))
    return np.array([d.embedding for d in response.data], dtype=np.float32)


def test_float_and_base64_and_one_at_a_time_agree(client: openai.OpenAI, server: RemoteServer) -> None:
    floats = client.embeddings.create(model=MODEL, input=SENTENCES, encoding_format="float")
    assert floats.model == MODEL and floats.object == "list"
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 100
    batch = vectors(floats)
    assert batch.shape == (len(SENTENCES), 384)
    np.testing.assert_allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)
    # the client's default asks for base64 and decodes it itself; here the raw body is decoded too
    np.testing.assert_array_equal(vectors(client.embeddings.create(model=MODEL, input=SENTENCES)), batch)
    body = {"model": MODEL, "input": SENTENCES[:2], "encoding_format": "base64"}
    raw = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60).json()
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["data"]]
    np.testing.assert_array_equal(np.stack(decoded), batch[:2])
    alone = np.concatenate([vectors(client.embeddings.create(model=MODEL, input=s)) for s in SENTENCES])
    np.testing.assert_allclose(alone, batch, rtol=0, atol=1e-6)
    ids = client.embeddings.create(model=MODEL, input=[[101, 1037, 102], [101, 102]], user="u1")
    text = client.embeddings.create(model=MODEL, input="a", encoding_format="float")
    np.testing.assert_allclose(vectors(ids)[0], vectors(text)[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "dimensions": 64}, "dimensions"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["fine", ""]}, "input"),
        ({"input": " ".join(["word"] * 300)}, "input"),
        ({"input": [[1, 2], [30522]]}, "input"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "x", "truncate_prompt_tokens": 257}, "truncate_prompt_tokens"),
        ({"input": "x", "unknown": 1}, "unknown"),
    ],
)
def test_bad_inputs_get_a_400_naming_the_field(
    server: RemoteServer, body: dict[str, object], param: str
) -> None:
    response = httpx.post(f"{server.url}/v1/embeddings", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_generating_on_an_embedding_server_is_a_400(server: RemoteServer) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": "Hello"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]}),
    ):
        response = httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == "model"
        assert "serves embeddings" in response.json()["error"]["message"]


def test_truncation_keeps_the_last_tokens(client: openai.OpenAI) -> None:
    long_text = " ".join(f"word{i}" for i in range(400))
    truncated = client.embeddings.create(
        model=MODEL, input=long_text, extra_body={"truncate_prompt_tokens": 16}
    )
    assert truncated.usage.prompt_tokens == 16


async def test_an_abandoned_request_is_aborted_and_frees_its_blocks(server: RemoteServer) -> None:
    """2,048 long inputs take a one-thread server minutes; the client leaves once they run, and every
    one is gone from the engine within seconds, its blocks free."""
    body = {"model": MODEL, "input": [" ".join(["token"] * 200)] * 2048}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:

        async def counts() -> tuple[float, float, float]:
            text = (await http.get("/metrics")).text
            names = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
            return tuple(metric(text, name) for name in names)  # type: ignore[return-value]

        leaving = asyncio.create_task(http.post("/v1/embeddings", json=body))
        for _ in range(100):  # a pooling request finishes in the step it runs: the others wait
            _, waiting, _ = await counts()
            if waiting > 1000:
                break
            await asyncio.sleep(0.1)
        assert waiting > 1000
        leaving.cancel()  # closes the connection: the server aborts the requests
        for _ in range(50):
            if await counts() == (0, 0, 0):
                break
            await asyncio.sleep(0.2)
        assert await counts() == (0, 0, 0)
        text = (await http.get("/metrics")).text
        assert metric(text, "prompt_tokens_total") < 1024 * 202  # most never ran
