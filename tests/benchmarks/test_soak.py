"""The soak benchmark's request mix covers every shape it promises, reproducibly."""

from __future__ import annotations

import random

from benchmarks.soak import draw_shape


def test_the_mix_holds_every_shape_and_is_seeded() -> None:
    rng = random.Random(1)
    shapes = [draw_shape(rng, "m") for _ in range(2000)]
    paths = {s.path for s in shapes}
    assert paths == {"/completions", "/chat/completions"}
    assert any(s.body["stream"] for s in shapes) and not all(s.body["stream"] for s in shapes)
    assert any(s.body.get("n") == 2 for s in shapes)
    assert any("logprobs" in s.body for s in shapes)
    invalid = [s for s in shapes if s.expect_status == 400]
    assert invalid and all(s.body["max_tokens"] == -1 for s in invalid)
    dropped = [s for s in shapes if s.drop_after_first_chunk]
    assert dropped and all(s.body["stream"] and s.expect_status == 200 for s in dropped)
    rng_a, rng_b = random.Random(5), random.Random(5)
    assert [draw_shape(rng_a, "m") for _ in range(50)] == [draw_shape(rng_b, "m") for _ in range(50)]
