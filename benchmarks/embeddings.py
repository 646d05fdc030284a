"""Embeddings benchmark: a fixed, seeded set of sentences of mixed lengths (2,000 by default) embedded by
our server and by sentence-transformers' `encode`, on the same model and threads, in one run.

    python3.11 -m venv $PEERS/st  # the peer's own environment, outside the repository
    $PEERS/st/bin/pip install torch==2.13.0 transformers==5.24.0 sentence-transformers
    .venv/bin/python -m benchmarks.embeddings --st-python $PEERS/st/bin/python
    .venv/bin/python -m benchmarks.embeddings --st-python $ST_PYTHON --threads 2 --concurrency 4

Ours: `llmserve serve MODEL --num-threads N`, started here; the client posts the sentences to
/v1/embeddings `--batch-size` at a time, `--concurrency` requests in flight, as base64 (what the
official openai client asks for), and decodes every vector. The clock runs from the first request to
the last vector, so tokenizing, HTTP and JSON count, and the client shares the machine with the
server. sentence-transformers: `SentenceTransformer(folder).encode(sentences, batch_size=32)` on N
torch threads in its own interpreter (`--st-python`, a virtual environment with sentence-transformers;
see `benchmarks/common/peer_runner.py`), after a warm-up batch, as its users call it: it sorts the sentences
by length and pads each batch to its longest. Both read the same HF folder. Sentence lengths stay
within the model's 256 tokens, so neither truncates.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import random
import time
from dataclasses import asdict, dataclass

import httpx
import numpy as np

from benchmarks.common.machine import warn_if_busy
from benchmarks.common.peers import engine_threads, interpreter_with, run_peer
from benchmarks.common.results import add_json_arg, write_results
from benchmarks.common.servers import free_port, llmserve_command, running

DEFAULT_MODEL = "all-MiniLM-L6-v2"
# fmt: off
WORDS = [
    "time", "person", "year", "way", "day", "thing", "man", "world", "life", "hand", "part", "child", "eye",
    "woman", "place", "work", "week", "case", "point", "company", "number", "group", "problem", "fact",
    "house", "river", "music", "story", "water", "light", "city", "road", "tree", "paper", "table", "the",
    "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "small",
    "large", "new", "old", "good", "great", "little", "long", "early", "young", "important", "public",
    "bad", "same", "able", "make", "know", "take", "see", "come", "think", "look", "want", "give", "use",
    "find", "tell", "ask", "seem", "feel", "try", "leave", "call", "garden", "window", "morning", "school",
    "question", "government", "country", "market", "family", "history", "science", "answer", "language",
]
# fmt: on
# (share of the sentences, fewest words, most words): short queries, sentences, and passages
LENGTH_MIX = ((0.5, 4, 16), (0.35, 17, 60), (0.15, 61, 180))


@dataclass(frozen=True)
class Workload:
    num_sentences: int
    seed: int

    def sentences(self) -> list[str]:
        """Seeded sentences of common words (about one token each), of `LENGTH_MIX`'s lengths."""
        rng = random.Random(self.seed)
        shares = [share for share, _, _ in LENGTH_MIX]
        out = []
        for _ in range(self.num_sentences):
            _, fewest, most = rng.choices(LENGTH_MIX, weights=shares)[0]
            words = [rng.choice(WORDS) for _ in range(rng.randint(fewest, most))]
            out.append(" ".join(words).capitalize() + ".")
        return out


def batches(items: list[str], size: int) -> list[list[str]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


@dataclass(frozen=True)
class Result:
    name: str
    sentences: int
    seconds: float

    @property
    def sentences_per_s(self) -> float:
        return self.sentences / self.seconds


def decode_vectors(body: dict[str, object]) -> list[np.ndarray]:
    """The vectors of an /v1/embeddings response asked for as base64, in input order."""
    data = sorted(body["data"], key=lambda d: d["index"])  # type: ignore[call-overload]
    return [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in data]


async def embed_all(base_url: str, model: str, work: list[list[str]], concurrency: int) -> int:
    """Every batch through /v1/embeddings, `concurrency` at a time; the number of vectors received."""
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as http:

        async def one(batch: list[str]) -> int:
            async with limit:
                body = {"model": model, "input": batch, "encoding_format": "base64"}
                response = await http.post(f"{base_url}/embeddings", json=body)
                response.raise_for_status()
                vectors = decode_vectors(response.json())
                if len(vectors) != len(batch):
                    raise RuntimeError(f"{len(batch)} sentences, {len(vectors)} vectors")
                return len(vectors)

        return sum(await asyncio.gather(*(one(batch) for batch in work)))


def ours(args: argparse.Namespace, sentences: list[str]) -> Result:
    port = free_port()
    command = [*llmserve_command(args.model, port, "auto"), "--num-threads", str(args.threads)]
    work = batches(sentences, args.batch_size)
    with running("llmserve", command, port) as url:
        asyncio.run(embed_all(url, args.model, work[:2], args.concurrency))  # warm up
        start = time.perf_counter()
        count = asyncio.run(embed_all(url, args.model, work, args.concurrency))
        return Result("llmserve", count, time.perf_counter() - start)


def sentence_transformers(args: argparse.Namespace, sentences: list[str]) -> Result | None:
    """The peer in its own interpreter, or None (with the reason) where there is none."""
    python = interpreter_with("sentence_transformers", args.st_python)
    if python is None:
        print("no sentence-transformers comparison: not installed (pass --st-python PATH).")
        return None
    from llmserve.model_executor.loader import resolve_model

    job = {
        "peer": "sentence-transformers",
        "model": str(resolve_model(args.model).path),
        "sentences": sentences,
        "batch_size": args.st_batch_size,
        "threads": args.threads,
    }
    result = run_peer(python, job)
    return Result("sentence-transformers", int(result["sentences"]), result["elapsed"])


def report(results: list[Result]) -> str:
    lines = [f"{'':24}{'sentences':>10}{'seconds':>10}{'sentences/s':>13}"]
    lines += [f"{r.name:24}{r.sentences:10d}{r.seconds:10.2f}{r.sentences_per_s:13.1f}" for r in results]
    mine, *others = results
    lines += [f"llmserve / {r.name}: {mine.sentences_per_s / r.sentences_per_s:.2f}x" for r in others]
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help="an embedding model: packaged name or HF folder"
    )
    parser.add_argument("--num-sentences", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="each side's (default: the engine's)")
    parser.add_argument("--batch-size", type=int, default=32, help="sentences per request to our server")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight to our server")
    parser.add_argument("--st-python", default=None, help="interpreter with sentence-transformers")
    parser.add_argument("--st-batch-size", type=int, default=32, help="sentence-transformers' batch_size")
    add_json_arg(parser)
    args = parser.parse_args()
    args.threads = args.threads or engine_threads()
    return args


def main() -> None:
    args = parse_args()
    load = warn_if_busy()
    workload = Workload(args.num_sentences, args.seed)
    sentences = workload.sentences()
    results = [ours(args, sentences)]
    peer = sentence_transformers(args, sentences)
    if peer is not None:
        results.append(peer)
    print(f"\n{workload}, {args.threads} threads each")
    print(report(results))
    summary = {"model": args.model, "threads": args.threads, "workload": asdict(workload)}
    write_results(
        args.json, "benchmarks.embeddings", {**summary, "results": [asdict(r) for r in results]}, load
    )


if __name__ == "__main__":
    main()
