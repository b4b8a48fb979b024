"""The gateway end to end: real daemons (tiny model), real Redis, the official openai client.

One fleet per module (start-up is the expensive part). The last two tests break the fleet
on purpose (Redis stopped, then a daemon killed), so they run last, in file order.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator

import openai
import pytest

from pagefleet.dev.local_fleet import FleetSpec, LocalFleet
from pagefleet.gateway.discovery import StaticDiscovery
from pagefleet.gateway.policies import make_policy
from pagefleet.gateway.prompts import PromptTokenizer
from pagefleet.gateway.router import Router
from pagefleet.gateway.server import HIT_HEADER, POD_HEADER
from pagefleet.kvindex.redis_index import RedisKVIndex

pytestmark = pytest.mark.slow

SYSTEM = "You are the routing test assistant. " + " ".join(
    f"fact{i} is that kalo mine rusa tivo {i}" for i in range(40)
)

REDIS_SYSTEM = "You are the Redis outage test assistant. " + SYSTEM


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    spec = FleetSpec(
        num_daemons=2,
        log_dir=tmp_path_factory.mktemp("fleet-logs"),
        seed=0,
        num_gpu_blocks=512,
        gateway_args=["--log-level", "info"],
    )
    with LocalFleet(spec) as f:
        yield f


def test_daemons_get_the_asked_kv_pool(fleet: LocalFleet) -> None:
    import json
    import urllib.request

    for url in fleet.daemon_urls:
        with urllib.request.urlopen(url + "/get_server_info", timeout=10) as r:
            assert json.loads(r.read())["num_blocks"] == 512


def _client(fleet: LocalFleet) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=fleet.gateway_url + "/v1", api_key="x", max_retries=0, timeout=60
    )


def _chat(user: str, system: str = SYSTEM) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


async def test_streaming_and_non_streaming_through_the_gateway(fleet: LocalFleet) -> None:
    client = _client(fleet)
    try:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny"]
        full = await client.chat.completions.create(
            model="tiny",
            messages=_chat("hello"),
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert full.usage is not None and full.usage.completion_tokens == 6
        text = ""
        n_chunks = 0
        stream = await client.chat.completions.create(
            model="tiny",
            messages=_chat("hello"),
            max_tokens=6,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices:
                n_chunks += 1
                text += chunk.choices[0].delta.content or ""
        # Greedy: the streamed text equals the non-streamed one, token by token.
        assert text == full.choices[0].message.content
        assert n_chunks >= 2
        comp = await client.completions.create(
            model="tiny", prompt="once upon a time", max_tokens=4, temperature=0
        )
        assert comp.choices[0].text is not None and comp.usage.completion_tokens == 4
        # An upstream 400 (unknown model is the daemon's verdict) comes back as a 400.
        with pytest.raises((openai.NotFoundError, openai.BadRequestError)):
            await client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    finally:
        await client.close()


async def _wait_predicted(client: openai.AsyncOpenAI, messages: list, at_least: int) -> None:
    """Until the index shows the prefix (KV events are published per engine step)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        raw = await client.chat.completions.with_raw_response.create(
            model="tiny", messages=messages, max_tokens=1
        )
        if int(raw.headers[HIT_HEADER]) >= at_least:
            return
        await asyncio.sleep(0.2)
    raise AssertionError("the index never reported the prefix")


async def test_requests_sharing_a_prefix_land_on_the_pod_that_holds_it(fleet: LocalFleet) -> None:
    client = _client(fleet)
    system = SYSTEM + " tenant alpha"
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model="tiny", messages=_chat("first question", system), max_tokens=2
        )
        holder = raw.headers[POD_HEADER]
        assert holder in {u.removeprefix("http://") for u in fleet.daemon_urls}
        await _wait_predicted(client, _chat("probe", system), 16 * 10)
        for i in range(6):
            raw = await client.chat.completions.with_raw_response.create(
                model="tiny", messages=_chat(f"follow-up number {i}", system), max_tokens=2
            )
            resp = raw.parse()
            assert raw.headers[POD_HEADER] == holder
            predicted = int(raw.headers[HIT_HEADER])
            cached = resp.usage.prompt_tokens_details.cached_tokens
            # The gateway's block keys equal the daemon's: its prediction is the real hit.
            assert predicted == cached > 16 * 10, (predicted, cached)
        # A second gateway replica over the same Redis ranks the same pod first.
        tok = PromptTokenizer.from_dir(fleet.model_dir)
        index = RedisKVIndex.from_url(fleet.redis_url or "", namespace=fleet.namespace)
        replica = Router(
            StaticDiscovery(fleet.daemon_urls),
            make_policy("cache_aware"),
            index,
            kv_namespace=fleet.namespace,
        )
        await replica.start()
        try:
            from pagefleet.api.openai import ChatCompletionRequest

            req = ChatCompletionRequest(model="tiny", messages=_chat("another one", system))
            decision = await replica.route(tok.chat_ids(req))
            assert decision.ranked[0].endpoint.pod == holder
            assert decision.predicted_hit_tokens > 16 * 10
        finally:
            await replica.close()
    finally:
        await client.close()


async def test_bench_report_from_a_real_run(fleet: LocalFleet, tmp_path) -> None:
    from pagefleet.dev.loadgen import BenchOptions, run_bench, write_plots

    opts = BenchOptions(
        url=fleet.gateway_url,
        num_requests=12,
        concurrency=4,
        max_tokens=4,
        num_tenants=3,
        system_prompt_words=60,
        progress=False,
        cost_per_hour=3.6,
        replicas=len(fleet.daemon_urls),
    )
    report, results = await run_bench(opts)
    assert report["requests"] == 12 and report["failed"] == 0, report["errors"]
    # Replica-dollars over the run per 1M tokens of each kind.
    spent = 3.6 * len(fleet.daemon_urls) * report["wall_s"] / 3600
    assert report["completion_tokens"] == 12 * 4
    assert report["cost_per_1m_output_tokens"] == round(spent / 48 * 1e6, 4)
    want_in = spent / report["prompt_tokens"] * 1e6
    assert report["cost_per_1m_input_tokens"] == round(want_in, 4)
    # 3 tenants over 12 turns: later turns reuse earlier prefixes on the same pod.
    assert 0.2 < report["prefix_hit_rate"] < 1.0
    assert set(report["pod_share"]) <= {u.removeprefix("http://") for u in fleet.daemon_urls}
    assert abs(sum(report["pod_share"].values()) - 1.0) < 1e-3
    assert report["ttft_ms_p50"] > 0 and report["tpot_ms_p50"] > 0
    assert report["ttft_ms_p50"] <= report["ttft_ms_p90"] <= report["ttft_ms_p99"]
    assert all(r.completion_tokens == 4 for r in results)
    paths = write_plots(results, report, tmp_path / "plots")
    assert all(p.stat().st_size > 1000 for p in paths)


async def test_open_loop_starts_conversations_on_the_arrival_schedule(fleet: LocalFleet) -> None:
    from pagefleet.dev.loadgen import BenchOptions, poisson_arrivals, run_bench

    opts = BenchOptions(
        url=fleet.gateway_url,
        num_requests=10,
        request_rate=8.0,
        max_turns=2,
        max_tokens=2,
        num_tenants=2,
        system_prompt_words=30,
        seed=5,
        progress=False,
    )
    report, results = await run_bench(opts)
    assert report["failed"] == 0, report["errors"]
    firsts = sorted((r.conversation, r.start) for r in results if r.turn == 0)
    want = poisson_arrivals(len(firsts), 8.0, seed=5)
    t0 = firsts[0][1]
    # Each conversation starts at its arrival, not when an earlier one finished.
    for (_, start), at in zip(firsts, want, strict=True):
        assert abs((start - t0) - at) < 0.15, (start - t0, at)


def test_poisson_arrivals_are_seeded_with_the_asked_rate() -> None:
    from pagefleet.dev.loadgen import poisson_arrivals

    a = poisson_arrivals(4000, 20.0, seed=1)
    assert a == poisson_arrivals(4000, 20.0, seed=1) and a != poisson_arrivals(4000, 20.0, seed=2)
    assert a[0] == 0.0 and all(x <= y for x, y in itertools.pairwise(a))
    assert abs(a[-1] / (len(a) - 1) - 1 / 20.0) < 0.005  # mean gap 50 ms
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(3, 0.0)


async def test_redis_stopped_mid_run_degrades_to_load_only(fleet: LocalFleet) -> None:
    client = _client(fleet)
    failures: list[str] = []
    pods: set[str] = set()

    async def one(i: int) -> None:
        try:
            # A system prompt of its own: with the module's, an earlier test's prompt could
            # end on the very block where these diverge, and the gateway takes such a
            # prompt for that conversation's next turn and skips the index (router.py), so
            # no lookup ever met the stopped Redis (as it did once chat prompts lost the BOS
            # their template does not write: every block boundary moved by one token).
            raw = await client.chat.completions.with_raw_response.create(
                model="tiny", messages=_chat(f"redis test {i}", REDIS_SYSTEM), max_tokens=3
            )
            raw.parse()
            pods.add(raw.headers[POD_HEADER])
        except Exception as exc:
            failures.append(repr(exc))

    try:
        await asyncio.gather(*(one(i) for i in range(6)))
        fleet.stop_redis()
        for wave in range(3):
            await asyncio.gather(*(one(100 + 10 * wave + i) for i in range(6)))
    finally:
        await client.close()
    assert failures == []
    assert len(pods) == 2
    import urllib.request

    with urllib.request.urlopen(fleet.gateway_url + "/metrics", timeout=5) as r:
        metrics = r.read().decode()
    assert 'pagefleet_gateway_index_errors_total{op="lookup"}' in metrics


async def test_a_killed_daemon_is_routed_around(fleet: LocalFleet) -> None:
    victim = fleet.daemons[0]
    victim_pod = victim.url.removeprefix("http://")
    victim.kill()
    client = _client(fleet)
    try:
        served = []
        for i in range(8):
            raw = await client.chat.completions.with_raw_response.create(
                model="tiny", messages=_chat(f"after the crash {i}"), max_tokens=2
            )
            raw.parse()
            served.append(raw.headers[POD_HEADER])
    finally:
        await client.close()
    assert set(served) == {fleet.daemons[1].url.removeprefix("http://")}
    assert victim_pod not in served
