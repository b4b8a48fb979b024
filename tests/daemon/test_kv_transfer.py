"""The TCP KV pull between two real engines over a real aiohttp server on loopback.

A pulled prompt decodes to the unified engine's tokens; the bytes and blocks are counted on
both sides; a stale handle, a forged one, another model's layout and a dead host each fail
with their reason, quickly, and leave no block behind on either side.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from pagefleet.daemon.kv_transfer import (
    KVExportServer,
    KVPullError,
    KVTransferMetrics,
    KVTransferParams,
    TcpKVTransfer,
)
from pagefleet.engine.config import EngineConfig
from pagefleet.engine.engine import LLMEngine
from pagefleet.engine.loader import load_model, resolve_model
from pagefleet.engine.parts import load_parts
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.testing.pd import drain, run_prefill

_LOADED: dict[str, tuple] = {}


def _engine(preset: str = "tiny", **kw) -> LLMEngine:
    if preset not in _LOADED:
        _LOADED[preset] = load_model(resolve_model(preset))
    config = EngineConfig(model=preset, block_size=8, num_gpu_blocks=128, **kw)
    return LLMEngine(config, parts=load_parts(config, loaded=_LOADED[preset]))


def _metrics() -> tuple[CollectorRegistry, KVTransferMetrics]:
    reg = CollectorRegistry()
    return reg, KVTransferMetrics(reg, ("pod",), ["p"], lambda: 0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _serve(prefill: LLMEngine, metrics: KVTransferMetrics) -> tuple[web.AppRunner, int]:
    app = web.Application()
    KVExportServer(lambda: prefill, prefill.collect_transfers, metrics).add_routes(app)
    runner = web.AppRunner(app)
    await runner.setup()
    port = _free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


def _params(port: int, handle: str) -> KVTransferParams:
    return KVTransferParams(
        do_remote_prefill=True, remote_host="127.0.0.1", remote_port=port,
        remote_request_id=handle,
    )  # fmt: skip


def _unified_tokens(prompt: list[int], params: SamplingParams) -> list[int]:
    """What a unified engine generates for ``prompt``: the oracle for a pulled request."""
    unified = _engine()
    unified.add_request("u", prompt, params)
    return drain(unified)["u"]


@asynccontextmanager
async def _pair(
    prefill_metrics: KVTransferMetrics, decode_metrics: KVTransferMetrics | None = None
) -> AsyncIterator[tuple[LLMEngine, LLMEngine, TcpKVTransfer, int]]:
    """A prefill engine served on loopback, a decode engine and its pull client (closed,
    the server stopped, on the way out)."""
    prefill, decode = _engine(), _engine()
    server, port = await _serve(prefill, prefill_metrics)
    client = TcpKVTransfer(timeout_s=5.0, metrics=decode_metrics)
    try:
        yield prefill, decode, client, port
    finally:
        await client.close()
        await server.cleanup()


def test_pull_over_tcp_matches_unified_and_fails_cleanly() -> None:
    prompt = [(i * 7) % 200 + 5 for i in range(43)]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    want = _unified_tokens(prompt, params)

    async def main() -> None:
        preg, pm = _metrics()
        dreg, dm = _metrics()
        async with _pair(pm, dm) as (prefill, decode, client, port):
            run_prefill(prefill, "h1", prompt)
            plan = decode.reserve_import("r1", prompt)
            assert plan is not None and plan.num_pull_blocks == 6  # positions 0..41
            kv = await client.pull(_params(port, "h1"), plan, decode.runner.kv_layout())
            decode.commit_import(plan, kv.tensors(), params)
            assert drain(decode)["r1"] == want
            assert prefill.exports.handles() == [], "a pulled handle must be freed"
            text = generate_latest(dreg).decode()
            layout = decode.runner.kv_layout()
            nbytes = 2 * layout.num_layers * 6 * layout.block_bytes_per_layer
            assert (
                f'pagefleet:kv_transfer_bytes_total{{direction="received",pod="p"}} {nbytes:.1f}'
                in text
            )
            assert "pagefleet:kv_transfer_seconds_count" in text
            assert f'direction="sent",pod="p"}} {nbytes:.1f}' in generate_latest(preg).decode()

            # Stale: the handle was consumed by the first pull.
            plan = decode.reserve_import("r2", prompt + [9] * 8)
            assert plan is not None
            with pytest.raises(KVPullError) as err:
                await client.pull(_params(port, "h1"), plan, decode.runner.kv_layout())
            assert err.value.reason == "not_found"
            decode.cancel_import(plan)

            # Forged: a live handle, but for another prompt (keys differ): refused.
            run_prefill(prefill, "h2", prompt)
            other = [5, 6, *prompt[2:]]
            plan = decode.reserve_import("r3", other)
            with pytest.raises(KVPullError) as err:
                await client.pull(_params(port, "h2"), plan, decode.runner.kv_layout())
            assert err.value.reason == "hash_mismatch"
            decode.cancel_import(plan)
            assert prefill.exports.handles() == ["h2"], "a refused pull leaves the handle"

            # Another model's layout (Qwen preset): refused before any byte moves.
            qwen = _engine("tiny-qwen2")
            plan = qwen.reserve_import("r4", prompt)
            with pytest.raises(KVPullError) as err:
                await client.pull(_params(port, "h2"), plan, qwen.runner.kv_layout())
            assert err.value.reason in ("layout_mismatch", "hash_mismatch")
            qwen.cancel_import(plan)

            # Dead host: fails fast as unreachable.
            plan = decode.reserve_import("r5", prompt)
            t0 = asyncio.get_running_loop().time()
            with pytest.raises(KVPullError) as err:
                await client.pull(_params(_free_port(), "h2"), plan, decode.runner.kv_layout())
            assert err.value.reason == "unreachable"
            assert asyncio.get_running_loop().time() - t0 < 4
            decode.cancel_import(plan)
            # Missing coordinates are a clear error, not a crash.
            with pytest.raises(KVPullError) as err:
                await client.pull(KVTransferParams(do_remote_prefill=True), plan, layout)
            assert err.value.reason == "bad_params"

            prefill.collect_transfers(float("inf"))
            for e in (prefill, decode, qwen):
                e.check_integrity()
                assert e.kv.pool.num_referenced_blocks == 0

    asyncio.run(main())


def test_pull_into_a_shared_memory_stage_and_stage_lifetime(tmp_path) -> None:
    """A pull landed in a KVStage gives the same tokens; the engine-process side maps the
    same file by path and sees the same bytes; close unlinks it; no tmpfs means None."""
    import torch

    from pagefleet.daemon.kv_stage import KVStage, stage_bytes, stage_tensors

    prompt = [(i * 11) % 200 + 5 for i in range(43)]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    want = _unified_tokens(prompt, params)

    async def main() -> None:
        async with _pair(_metrics()[1]) as (prefill, decode, client, port):
            run_prefill(prefill, "h1", prompt)
            plan = decode.reserve_import("r1", prompt)
            layout = decode.runner.kv_layout()
            stage = KVStage.create(stage_bytes(layout, plan.num_pull_blocks), str(tmp_path))
            assert stage is not None
            kv = await client.pull(_params(port, "h1"), plan, layout, into=stage)
            assert kv.buf.obj is not None and len(kv.buf) == stage.nbytes
            mapped = stage_tensors(stage.path, layout, plan.num_pull_blocks)
            for (k, v), (mk, mv) in zip(kv.tensors(), mapped, strict=True):
                assert torch.equal(k, mk) and torch.equal(v, mv)
            decode.commit_import(plan, mapped, params)
            del kv, mapped
            stage.close()
            assert list(tmp_path.iterdir()) == [], "a closed stage leaves no file"
            assert drain(decode)["r1"] == want

    asyncio.run(main())
    assert KVStage.create(1024, str(tmp_path / "missing")) is None
    assert KVStage.create(0, str(tmp_path)) is None


def test_a_wait_whose_caller_leaves_forgets_the_unknown_handle() -> None:
    """A decode pod that gives up on /v1/kv/wait for a handle this pod never heard of (its
    own timeout, a cut connection) must not leave the handle in the wait table for good."""

    async def run() -> None:
        server = KVExportServer(lambda: None, lambda: None)
        server.unknown_grace_s = 30.0  # the caller leaves long before the grace ends
        app = web.Application()
        server.add_routes(app)
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        port = _free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            _reader, writer = await asyncio.open_connection("127.0.0.1", port)
            body = b'{"handle": "never-announced", "wait_s": 20}'
            writer.write(
                b"POST /v1/kv/wait HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await writer.drain()
            for _ in range(100):  # the handler is in its wait
                if server._awaited:
                    break
                await asyncio.sleep(0.02)
            assert server._awaited, "the wait never started"
            writer.close()  # the caller goes away mid-wait
            for _ in range(100):
                if not server._awaited:
                    break
                await asyncio.sleep(0.02)
            assert not server._awaited, "the abandoned wait stayed in the table"
        finally:
            await runner.cleanup()

    asyncio.run(run())
