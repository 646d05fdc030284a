"""Soak by time: an open-loop load at about twice what the server can serve, for --duration seconds.

A short closed-loop probe (--concurrency at a time, --probe-seconds) measures the server's capacity
in requests/s on the mix; requests then arrive as a seeded Poisson process at --overload times that
(or at --rate), so the queue builds until the clients' --request-timeout sheds the oldest: a client
that gives up disconnects, and the server must abort its request, queued or running. Every
--sample-interval, the API server's and the engine core's resident memory (each on its own) and the
running, waiting and KV-usage gauges of /metrics are sampled. When the load stops, the server drains.

The run passes when each process's resident memory after the drain is within --tolerance of its
value at --warmup-seconds into the load (the queue is at its depth by then), no request is left
running or waiting and no KV block in use, and no request met an unexpected answer (a timeout is the
client shedding load, not an error). The rate answered while overloaded is reported against the
measured capacity; --min-goodput makes too low a rate fail the run as well.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import psutil

from benchmarks.common.results import write_results
from benchmarks.common.servers import running
from benchmarks.common.soak_mix import (
    SHED,
    Shape,
    draw_shape,
    long_prompt_ids,
    parse_gauges,
    process_rss,
    send,
)

MIB = 2**20


def add_duration_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("by time (--duration)")
    group.add_argument("--duration", type=float, default=None, help="seconds of open-loop load")
    group.add_argument("--rate", type=float, default=None, help="arrivals/s; default: overload x capacity")
    group.add_argument("--overload", type=float, default=2.0, help="the rate as a multiple of capacity")
    group.add_argument("--probe-seconds", type=float, default=30.0, help="the capacity probe's length")
    group.add_argument(
        "--warmup-seconds", type=float, default=None, help="the memory baseline (default: 1/4 in, <= 120 s)"
    )
    group.add_argument("--sample-interval", type=float, default=5.0)
    group.add_argument("--request-timeout", type=float, default=60.0, help="a client gives up after this")
    group.add_argument("--drain-timeout", type=float, default=120.0)
    group.add_argument(
        "--min-goodput", type=float, default=0.0, help="least answered/s under load, of capacity (0: off)"
    )


@dataclass
class Tick:
    """One sample, `t` seconds into the load, with what the client sees."""

    t: float
    rss: dict[str, int]
    gauges: dict[str, float]
    in_flight: int
    answered: int
    timed_out: int


@dataclass
class Tally:
    answered: int = 0  # as expected: a 200 (dropped streams too) or the invalid requests' 400
    timed_out: int = 0
    shed: int = 0  # a 503 with Retry-After, or a stream's queue timeout: the server's overload control
    errors: list[str] = field(default_factory=list)


class OpenLoop:
    """The client side of one run: the mix, the requests in flight and what they got."""

    def __init__(self, http: httpx.AsyncClient, base_url: str, pid: int, shapes: Iterator[Shape]) -> None:
        self.http, self.base_url, self.pid, self.shapes = http, base_url, pid, shapes
        self.root = base_url.removesuffix("/v1")
        self.tally = Tally()
        self.in_flight: set[asyncio.Task[None]] = set()
        self.ticks: list[Tick] = []
        self.t0 = time.monotonic()

    async def one(self, shape: Shape, timeout: float | None) -> None:
        try:
            error = await asyncio.wait_for(send(self.http, self.base_url, shape), timeout)
        except TimeoutError:
            self.tally.timed_out += 1  # leaving wait_for closed the connection: the server aborts it
            return
        if error == SHED:
            self.tally.shed += 1
        elif error:
            self.tally.errors.append(error)
        else:
            self.tally.answered += 1

    async def probe(self, concurrency: int, seconds: float) -> float:
        """Requests/s answered with `concurrency` at a time: the closed loop's throughput on the mix."""
        start = time.monotonic()
        before = self.tally.answered + len(self.tally.errors)

        async def worker() -> None:
            while time.monotonic() - start < seconds:
                await self.one(next(self.shapes), None)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return (self.tally.answered + len(self.tally.errors) - before) / (time.monotonic() - start)

    async def arrive(self, rate: float, seconds: float, rng: random.Random, timeout: float) -> None:
        """Poisson arrivals at `rate` for `seconds`, each request on its own task: nothing waits for a
        free slot, so the server's queue takes what it cannot serve."""
        start, next_at = time.monotonic(), 0.0
        while (next_at := next_at + rng.expovariate(rate)) < seconds:
            await asyncio.sleep(max(0.0, start + next_at - time.monotonic()))
            task = asyncio.create_task(self.one(next(self.shapes), timeout))
            self.in_flight.add(task)
            task.add_done_callback(self.in_flight.discard)

    async def tick(self) -> Tick:
        text = (await self.http.get(f"{self.root}/metrics", timeout=30)).text
        tick = Tick(
            t=time.monotonic() - self.t0,
            rss=process_rss(self.pid),
            gauges=parse_gauges(text),
            in_flight=len(self.in_flight),
            answered=self.tally.answered,
            timed_out=self.tally.timed_out,
        )
        self.ticks.append(tick)
        return tick

    async def sample_every(self, interval: float, print_every: float) -> None:
        last_print = -print_every
        while True:
            tick = await self.tick()
            if tick.t - last_print >= print_every:
                last_print = tick.t
                print(f"{tick.t:6.0f} s  {format_rss(tick.rss)}  {format_gauges(tick.gauges)}  "
                      f"in flight {tick.in_flight}, answered {tick.answered}, timed out {tick.timed_out}",
                      flush=True)  # fmt: skip
            await asyncio.sleep(interval)

    async def drain(self, timeout: float) -> Tick:
        """Waits for the clients (each ends by its timeout at the latest), then for the server's gauges
        to read zero (or `timeout`); the last tick."""
        await asyncio.gather(*self.in_flight)
        deadline = time.monotonic() + timeout
        while any((tick := await self.tick()).gauges.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        return tick


def format_rss(rss: dict[str, int]) -> str:
    return ", ".join(f"{name} {value / MIB:.0f} MiB" for name, value in rss.items())


def format_gauges(gauges: dict[str, float]) -> str:
    kv, waiting = gauges.get("kv_cache_usage_perc", 0), gauges.get("num_requests_waiting", 0)
    return f"KV {kv:.0%}, waiting {waiting:.0f}, running {gauges.get('num_requests_running', 0):.0f}"


def baseline_tick(ticks: list[Tick], warmup: float) -> Tick:
    """The first sample at least `warmup` seconds into the load (the last one, if the load was shorter)."""
    return next((tick for tick in ticks if tick.t >= warmup), ticks[-1])


def peak_tick(ticks: list[Tick]) -> Tick:
    """Each figure's maximum over the samples (not one sample)."""
    names = {name for tick in ticks for name in tick.rss}
    gauges = {name for tick in ticks for name in tick.gauges}
    return Tick(
        t=max(tick.t for tick in ticks),
        rss={name: max(tick.rss.get(name, 0) for tick in ticks) for name in sorted(names)},
        gauges={name: max(tick.gauges.get(name, 0.0) for tick in ticks) for name in sorted(gauges)},
        in_flight=max(tick.in_flight for tick in ticks),
        answered=max(tick.answered for tick in ticks),
        timed_out=max(tick.timed_out for tick in ticks),
    )


def duration_failures(
    baseline: Tick, final: Tick, tolerance: float, tally: Tally, goodput: float, floor: float
) -> list[str]:
    """Why the run fails, or nothing when it passes (see the module's docstring)."""
    reasons = []
    for name, before in baseline.rss.items():
        growth = final.rss.get(name, 0) / before - 1
        if growth > tolerance:
            reasons.append(
                f"{name} resident memory grew {growth:+.1%} after the warm-up, more than {tolerance:.0%}"
            )
    if any(final.gauges.values()):
        reasons.append(f"requests or KV blocks left in the server after draining: {final.gauges}")
    if tally.errors:
        reasons.append(f"unexpected answers: {len(tally.errors)}")
    if goodput < floor:
        reasons.append(f"answered {goodput:.2f} requests/s while overloaded, under {floor:.2f}")
    return reasons


async def soak_for(args: argparse.Namespace, base_url: str, pid: int) -> dict[str, Any]:
    rng = random.Random(args.seed)
    long_prompt = long_prompt_ids(base_url)
    shapes = (draw_shape(rng, args.model, long_prompt) for _ in itertools.count())
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as http:
        loop = OpenLoop(http, base_url, pid, shapes)
        capacity = await loop.probe(args.concurrency, args.probe_seconds)
        rate = args.rate if args.rate is not None else args.overload * capacity
        if rate <= 0:
            raise SystemExit("the server answered nothing in the capacity probe: no rate to set")
        print(f"capacity {capacity:.2f} requests/s ({args.concurrency} at a time); "
              f"arrivals at {rate:.2f}/s for {args.duration:.0f} s", flush=True)  # fmt: skip
        loop.tally = Tally(errors=loop.tally.errors)  # the probe's answers are only its throughput
        loop.t0 = time.monotonic()
        sampler = asyncio.create_task(
            loop.sample_every(args.sample_interval, max(30.0, args.sample_interval))
        )
        await loop.arrive(rate, args.duration, random.Random(args.seed + 1), args.request_timeout)
        load_s = time.monotonic() - loop.t0
        answered_under_load = loop.tally.answered
        final = await loop.drain(args.drain_timeout)
        sampler.cancel()
    return {
        "capacity": capacity,
        "rate": rate,
        "load_s": load_s,
        "goodput": answered_under_load / load_s,
        "tally": loop.tally,
        "ticks": loop.ticks,
        "final": final,
    }


def run_for_duration(
    args: argparse.Namespace, command: list[str], port: int, foreign_load: float
) -> list[str]:
    """The duration mode: prints and writes its figures, returns why it failed (nothing if it passed)."""
    with running("llmserve", command, port) as url:
        pid = next(p.pid for p in psutil.Process().children() if str(port) in p.cmdline())
        run = asyncio.run(soak_for(args, url, pid))
    warmup = args.warmup_seconds if args.warmup_seconds is not None else min(120.0, args.duration / 4)
    ticks, final, tally = run["ticks"], run["final"], run["tally"]
    baseline, peak = baseline_tick(ticks, warmup), peak_tick(ticks)
    floor = args.min_goodput * run["capacity"]
    reasons = duration_failures(baseline, final, args.tolerance, tally, run["goodput"], floor)
    print_table({f"after warm-up ({baseline.t:.0f} s)": baseline, "peak": peak, "after drain": final})
    for error in sorted(set(tally.errors))[:10]:
        print(f"request failed: {error}")
    arrived = tally.answered + tally.timed_out + tally.shed + len(tally.errors)
    times = run["rate"] / run["capacity"]
    print(f"{arrived} requests in {run['load_s']:.0f} s at {run['rate']:.2f}/s ({times:.1f}x capacity "
          f"{run['capacity']:.2f}/s): {tally.answered} answered, {tally.shed} shed (503), "
          f"{tally.timed_out} timed out, {len(tally.errors)} unexpected; "
          f"{run['goodput']:.2f}/s answered under load")  # fmt: skip
    figures = {"after_warmup": baseline, "peak": peak, "after_drain": final}
    write_results(
        args.json,
        "benchmarks.soak",
        {
            "mode": "duration",
            "model": args.model,
            "max_model_len": args.max_model_len,
            "duration_s": args.duration,
            "capacity_rps": run["capacity"],
            "rate_rps": run["rate"],
            "goodput_rps": run["goodput"],
            "request_timeout_s": args.request_timeout,
            "warmup_s": warmup,
            "requests": {
                "answered": tally.answered,
                "timed_out": tally.timed_out,
                "shed": tally.shed,
                "unexpected": len(tally.errors),
            },
            "rss_growth": {name: final.rss.get(name, 0) / rss - 1 for name, rss in baseline.rss.items()},
            **{name: asdict(tick) for name, tick in figures.items()},
            "samples": [asdict(tick) for tick in ticks],
            "failures": reasons,
        },
        foreign_load,
    )
    return reasons


def print_table(rows: dict[str, Tick]) -> None:
    names = sorted({name for tick in rows.values() for name in tick.rss})
    header = ["", *(f"{name} MiB" for name in names), "KV used", "waiting", "running"]
    lines = [header]
    for label, tick in rows.items():
        gauges = tick.gauges
        lines.append([label, *(f"{tick.rss.get(name, 0) / MIB:.1f}" for name in names),
                      f"{gauges.get('kv_cache_usage_perc', 0):.1%}",
                      f"{gauges.get('num_requests_waiting', 0):.0f}",
                      f"{gauges.get('num_requests_running', 0):.0f}"])  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for label, *cells in lines:
        print("  ".join([label.ljust(widths[0]), *(c.rjust(w) for c, w in zip(cells, widths[1:]))]))
