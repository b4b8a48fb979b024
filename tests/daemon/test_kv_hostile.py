"""The KV pull against faulty or hostile peers, on loopback.

The decode side's client pulls from a server that answers exactly the bytes each case needs
(a header that is not an object, one nested past the JSON decoder's depth, one announcing a
huge size); the prefill side's export server serves a reader that stops reading. Every case
must end in a ``KVPullError`` with a reason (the caller falls back to a local prefill) or a
dropped connection, in bounded time and memory, leaving no block pinned on either side.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from pagefleet.daemon.kv_transfer import (
    KVExportServer,
    KVPullError,
    KVTransferParams,
    TcpKVTransfer,
    expected_hashes,
    expected_tail_hash,
    header_limit,
    layout_dict,
)
from pagefleet.engine.config import EngineConfig
from pagefleet.engine.engine import LLMEngine
from pagefleet.engine.loader import load_model, resolve_model
from pagefleet.engine.parts import load_parts
from pagefleet.testing.pd import run_prefill

from .test_kv_transfer import _LOADED, _metrics, _params

PROMPT = [(i * 7) % 200 + 5 for i in range(43)]


def _engine(**kw: object) -> LLMEngine:
    if "tiny" not in _LOADED:
        _LOADED["tiny"] = load_model(resolve_model("tiny"))
    config = EngineConfig(model="tiny", block_size=8, **{"num_gpu_blocks": 128, **kw})
    return LLMEngine(config, parts=load_parts(config, loaded=_LOADED["tiny"]))


@contextlib.asynccontextmanager
async def _serving_exports(prefill: LLMEngine) -> AsyncIterator[int]:
    """The prefill engine's KV export routes on a loopback port, which it yields."""
    _, metrics = _metrics()
    app = web.Application()
    KVExportServer(lambda: prefill, prefill.collect_transfers, metrics).add_routes(app)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


async def _answer_pull(body: bytes, length: int | None = None) -> tuple[asyncio.Server, int]:
    """A server that reads one request, answers 200 with ``body`` under a Content-Length
    of ``length`` (default: the body's), then holds the connection open until the
    client leaves (a short body then stalls instead of ending)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0]))
        n = len(body) if length is None else length
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % n + body)
        await writer.drain()
        await reader.read()  # until the client closes
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.mark.parametrize(
    "header",
    [b"[1, 2]", b"null", b'"layout"', b"[" * 5000 + b"]" * 5000],
    ids=["list", "null", "string", "nested-past-the-decoder-depth"],
)
def test_a_header_that_is_no_json_object_is_a_protocol_failure(header: bytes) -> None:
    """It escaped as AttributeError / RecursionError: the decode daemon answered 500 instead
    of falling back to a local prefill, and counted no failed pull."""

    async def main() -> None:
        decode = _engine()
        plan = decode.reserve_import("r", PROMPT)
        assert plan is not None
        server, port = await _answer_pull(struct.pack(">I", len(header)) + header)
        client = TcpKVTransfer(timeout_s=5.0)
        try:
            async with server:
                with pytest.raises(KVPullError) as err:
                    await client.pull(_params(port, "h"), plan, decode.runner.kv_layout())
                assert err.value.reason == "protocol"
        finally:
            await client.close()
            decode.cancel_import(plan)
        decode.check_integrity()
        assert decode.kv.pool.num_referenced_blocks == 0

    asyncio.run(main())


def test_a_header_announcing_a_huge_size_is_refused_before_it_is_allocated() -> None:
    """A peer that announces a 60 MiB header (and a body to match) then sends nothing made
    the decode side allocate the 60 MiB at once and hold it to the pull's timeout: a few
    such pulls at a time are gigabytes. A truthful header for the range is a few KiB."""
    hlen = 60 << 20

    async def main() -> None:
        decode = _engine()
        plan = decode.reserve_import("r", PROMPT)
        assert plan is not None
        server, port = await _answer_pull(struct.pack(">I", hlen), length=4 + hlen + 4096)
        client = TcpKVTransfer(timeout_s=3.0)
        tracemalloc.start()
        t0 = time.monotonic()
        try:
            async with server:
                with pytest.raises(KVPullError) as err:
                    await client.pull(_params(port, "h"), plan, decode.runner.kv_layout())
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
            await client.close()
            decode.cancel_import(plan)
        assert err.value.reason == "protocol", err.value
        assert time.monotonic() - t0 < 2.0, "it waited for the announced bytes"
        assert peak < 8 << 20, f"{peak} bytes allocated for a header never sent"

    asyncio.run(main())

    # The bound holds any truthful header: the widest keys and token ids there are.
    decode = _engine()
    plan = decode.reserve_import("wide", [(1 << 31) - 1] * 1000)
    assert plan is not None
    layout = decode.runner.kv_layout()
    header = {
        "layout": layout_dict(layout), "layers": [0, layout.num_layers], "first_block": 0,
        "num_blocks": plan.num_pull_blocks, "block_hashes": [(1 << 64) - 1] * plan.num_pull_blocks,
        "token_ids": plan.token_ids[: plan.num_pull_blocks * layout.block_size],
    }  # fmt: skip
    assert len(json.dumps(header, separators=(",", ":"))) <= header_limit(plan, layout)
    decode.cancel_import(plan)


def test_a_reader_that_stops_reading_does_not_pin_the_handle_past_its_deadline() -> None:
    """A decode pod that asks for a pull and then never reads (frozen, partitioned without
    a reset) kept the export server's write waiting for good: a handle being read never
    expires, so its blocks stayed pinned on the prefill pod for as long as the connection
    lived. The send is bounded; the stalled connection is dropped, the handle expires."""
    prompt = [(i * 7) % 200 + 5 for i in range(300)]

    async def main() -> None:
        prefill = _engine(kv_transfer_timeout_s=1.0)
        _, metrics = _metrics()
        server = KVExportServer(lambda: prefill, prefill.collect_transfers, metrics)
        server.send_timeout_s = 1.0
        app = web.Application()
        server.add_routes(app)
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        # Small socket buffers on both ends: the ~600 KB payload cannot all be in flight.
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        listener.bind(("127.0.0.1", 0))
        await web.SockSite(runner, listener).start()
        port = listener.getsockname()[1]
        run_prefill(prefill, "h", prompt)
        decode = _engine()
        plan = decode.reserve_import("r", prompt)
        assert plan is not None
        body = json.dumps({
            "handle": "h", "first_block": 0, "num_blocks": plan.num_pull_blocks,
            "block_hashes": expected_hashes(plan), "layout": layout_dict(decode.runner.kv_layout()),
            "tail_hash": expected_tail_hash(plan),
        }).encode()  # fmt: skip
        decode.cancel_import(plan)
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, ("127.0.0.1", port))
            await loop.sock_sendall(
                sock,
                b"POST /v1/kv/pull HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body) + body,
            )
            # Never read: past the handle's deadline and the send bound, it must be gone.
            for _ in range(60):
                await asyncio.sleep(0.1)
                prefill.collect_transfers()
                if not prefill.exports.handles():
                    break
            assert prefill.exports.handles() == [], "a stalled reader pinned the handle"
            assert prefill.kv.pool.num_referenced_blocks == 0
            prefill.check_integrity()
        finally:
            sock.close()
            await runner.cleanup()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("prefill_ns", "prefill_lora", "prompt_len", "cached"),
    [
        ("another-model", None, 6, 0),  # the prompt is shorter than a block
        ("", "adapter-a", 6, 0),  # computed under an adapter, asked for without one
        ("another-model", None, 20, 17),  # the decode pod holds every full block already
    ],
    ids=["short-prompt-other-model", "short-prompt-other-adapter", "tail-only-other-model"],
)
def test_a_pulled_partial_block_of_another_model_or_adapter_is_refused(
    prefill_ns: str, prefill_lora: str | None, prompt_len: int, cached: int
) -> None:
    """A range holding only the prompt's partial last block carried no key that ties it to
    the model (namespace) or adapter, only token ids: another model's KV of the same layout,
    or the same model's under another adapter, was taken and decoded as this one's. The
    partial block's chain key (tail_hash) is now compared too."""
    prompt = [(i * 7) % 200 + 5 for i in range(prompt_len)]

    async def main() -> None:
        prefill, decode = _engine(kv_namespace=prefill_ns), _engine()
        client = TcpKVTransfer(timeout_s=5.0)
        async with _serving_exports(prefill) as port:
            try:
                run_prefill(prefill, "h", prompt, lora=prefill_lora)
                if cached:
                    run_prefill(decode, "warm", prompt[:cached])
                    decode.collect_transfers(float("inf"))
                layout = decode.runner.kv_layout()
                plan = decode.reserve_import("r", prompt)
                assert plan is not None and plan.first_block == cached // 8
                assert plan.num_pull_blocks == 1  # the partial block alone
                with pytest.raises(KVPullError) as err:
                    await client.pull(_params(port, "h"), plan, layout)
                assert err.value.reason == "hash_mismatch"
                decode.cancel_import(plan)

                # The same prompt under the same model and adapter still pulls.
                run_prefill(prefill, "h2", prompt, lora=prefill_lora)
                same = _engine(kv_namespace=prefill_ns)
                plan = same.reserve_import("r2", prompt, prefill_lora)
                assert plan is not None
                await client.pull(_params(port, "h2"), plan, same.runner.kv_layout())
                same.cancel_import(plan)
                for e in (prefill, decode, same):
                    e.collect_transfers(float("inf"))
                    e.check_integrity()
                    assert e.kv.pool.num_referenced_blocks == 0
            finally:
                await client.close()

    asyncio.run(main())


def test_a_status_code_that_is_not_three_digits_is_a_protocol_failure() -> None:
    """The pull's failure reason names the peer's status (``http_<status>``), and any run of
    digits passed as a status: a peer answering a new number each time minted a new
    ``pulls_failed_total{reason}`` series each time, without bound. HTTP status codes are
    three digits; anything else is not an HTTP response."""

    async def main() -> None:
        decode = _engine()
        plan = decode.reserve_import("r", PROMPT)
        assert plan is not None
        client = TcpKVTransfer(timeout_s=5.0)
        reasons = []
        try:
            for status in (b"1234567", b"99", b"0000000000000000000503"):

                async def handle(
                    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, status=status
                ) -> None:
                    await reader.readuntil(b"\r\n\r\n")
                    writer.write(b"HTTP/1.1 " + status + b" X\r\nContent-Length: 0\r\n\r\n")
                    await writer.drain()
                    writer.close()

                server = await asyncio.start_server(handle, "127.0.0.1", 0)
                async with server:
                    port = server.sockets[0].getsockname()[1]
                    with pytest.raises(KVPullError) as err:
                        await client.pull(_params(port, "h"), plan, decode.runner.kv_layout())
                    reasons.append(err.value.reason)
        finally:
            await client.close()
            decode.cancel_import(plan)
        assert reasons == ["protocol"] * 3

    asyncio.run(main())


def _hostile_peer(kind: str) -> Callable[..., Awaitable[None]]:
    """A "prefill pod" that answers a pull as ``kind`` says (and anything else 404)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0]))
        ok = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n"
        if b"/v1/kv/pull" not in head:
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
        elif kind == "header-is-a-list":
            writer.write(ok % 9 + struct.pack(">I", 5) + b"[1,2]")
        elif kind == "stalls-mid-body":
            writer.write(ok % 100_000 + b"\x00\x00")
            await writer.drain()
            await reader.read()  # never more, until the client leaves
        elif kind == "closes-mid-header":
            writer.write(ok % 100_000 + struct.pack(">I", 50) + b'{"lay')
        elif kind == "an-html-page":
            writer.write(ok % 16 + b"<html>hi</html>\n")
        elif kind == "not-http":
            writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await writer.drain()
        writer.close()

    return handle


async def test_a_real_decode_daemon_falls_back_from_every_faulty_peer() -> None:
    """A decode daemon (engine in its own process, pulls into shared-memory stages) told to
    pull from peers that answer wrongly: every request is answered 200 by a local prefill,
    each failure is counted under its reason, and no block or stage file is left behind."""
    from .conftest import live_daemon
    from .test_pd_fleet import MODEL, PROMPT, _config, _metric

    config = _config("decode").model_copy(update={"kv_pull_timeout_s": 1.0})
    kinds = {
        "header-is-a-list": "protocol",
        "stalls-mid-body": "timeout",
        "closes-mid-header": "protocol",
        "an-html-page": "protocol",
        "not-http": "protocol",
    }
    async with live_daemon(config) as d, aiohttp.ClientSession() as s:
        free = (await d.daemon.engine_loop.stats()).num_free_blocks
        for i, kind in enumerate(kinds):
            server = await asyncio.start_server(_hostile_peer(kind), "127.0.0.1", 0)
            async with server:
                params = {"do_remote_prefill": True, "remote_host": "127.0.0.1",
                          "remote_port": server.sockets[0].getsockname()[1],
                          "remote_request_id": f"h{i}"}  # fmt: skip
                body = {"model": MODEL, "prompt": f"{PROMPT} ({kind})", "max_tokens": 2,
                        "kv_transfer_params": params}  # fmt: skip
                async with s.post(f"{d.url}/v1/completions", json=body) as r:
                    assert r.status == 200, (kind, await r.text())
        failed = "pagefleet:kv_transfer_pulls_failed_total"
        for reason in set(kinds.values()):
            want = list(kinds.values()).count(reason)
            assert await _metric(d.url, failed, reason=reason) == want, reason
        assert await _metric(d.url, "pagefleet:kv_transfer_seconds_count") == 0
        await d.daemon.engine_loop.invoke("check_integrity")
        stats = await d.daemon.engine_loop.stats()
        assert stats.num_free_blocks == free, "a reservation outlived its failed pull"
        assert len(d.daemon.pd.stages.idle_paths()) <= d.daemon.pd.stages.keep


def test_a_handle_the_wire_cannot_carry_is_bad_params() -> None:
    """A caller's remote_request_id longer than a pull or wait request may carry (256)
    escaped the pull client as pydantic's ValidationError: the decode daemon answered the
    wait path 400 with the internal model's validation text, and counted the pull path as
    reservation_expired (a ValueError there means that). Both now fail as bad_params."""

    assert asyncio.run(_pull_and_wait_fail_as_bad_params(_params(1, "x" * 300))) is False


def test_a_host_name_the_resolver_refuses_is_bad_params() -> None:
    """A remote_host with a label over 63 characters makes the resolver raise UnicodeError
    (a ValueError): it escaped wait_ready (the decode daemon answered 400 with the idna
    codec's text instead of falling back) and release (whose contract is never to raise:
    its fire-and-forget task logged 'Task exception was never retrieved'), and the pull
    counted it as a protocol failure. All three now see a KVPullError('bad_params')."""

    params = _params(9, "h").model_copy(update={"remote_host": "a" * 100 + ".example"})
    assert asyncio.run(_pull_and_wait_fail_as_bad_params(params)) is False  # release: no raise


async def _pull_and_wait_fail_as_bad_params(params: KVTransferParams) -> bool:
    """A pull and a wait with ``params`` both fail as bad_params; what a release of them
    returns (it must not raise)."""
    decode = _engine()
    plan = decode.reserve_import("r", PROMPT)
    assert plan is not None
    client = TcpKVTransfer(timeout_s=2.0)
    try:
        with pytest.raises(KVPullError) as err:
            await client.pull(params, plan, decode.runner.kv_layout())
        assert err.value.reason == "bad_params"
        with pytest.raises(KVPullError) as err:
            await client.wait_ready(params, 1.0)
        assert err.value.reason == "bad_params"
        return await client.release(params)
    finally:
        await client.close()
        decode.cancel_import(plan)


def test_a_wait_answered_with_an_endless_error_body_reads_only_its_start() -> None:
    """wait_ready read a non-200 answer's whole body to quote 300 characters of it: a peer
    streaming an endless error body made the decode daemon buffer all it could receive
    until the wait's timeout (wait_s + 3 s), gigabytes at loopback speed."""
    chunk = b"x" * (1 << 20)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 503 Busy\r\nContent-Length: %d\r\n\r\n" % (1 << 40))
        with contextlib.suppress(ConnectionError):
            while True:
                writer.write(chunk)
                await writer.drain()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        client = TcpKVTransfer(timeout_s=2.0)
        tracemalloc.start()
        try:
            async with server:
                port = server.sockets[0].getsockname()[1]
                with pytest.raises(KVPullError) as err:
                    await client.wait_ready(_params(port, "h"), 1.0)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
            await client.close()
        assert err.value.reason == "http_503", err.value
        assert peak < 32 << 20, f"{peak} bytes buffered of an error body"

    asyncio.run(main())


async def _raw_pull(port: int, body: dict) -> tuple[int, bytes]:
    """POST ``body`` to the export server's pull path as any peer could; (status, body)."""
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"http://127.0.0.1:{port}/v1/kv/pull", json=body) as r,
    ):
        return r.status, await r.read()


@pytest.mark.parametrize("tail", ["wrong", "absent"], ids=["a-wrong-tail-hash", "no-tail-hash"])
def test_the_prefill_side_refuses_a_partial_block_asked_for_under_another_tail_hash(
    tail: str,
) -> None:
    """Only the decode side compared the partial last block's chain key (tail_hash): a
    pull whose range is that block alone carries no full block's key, so the prefill pod
    sent its bytes to any caller naming the handle -- another model's or another
    adapter's decode pod (or any peer) got KV that was not computed for it, and only a
    client that checks the header threw it away. The prefill side now refuses (409, no
    byte of KV sent) and the handle stays for the pod it belongs to."""
    prompt = [(i * 7) % 200 + 5 for i in range(20)]  # two full blocks and a partial one

    async def main() -> None:
        prefill = _engine()
        async with _serving_exports(prefill) as port:
            run_prefill(prefill, "h", prompt)
            entry = prefill.exports.acquire("h", time.monotonic())
            assert entry is not None and entry.tail_hash is not None
            prefill.exports.release("h", consumed=False)
            layout = layout_dict(prefill.runner.kv_layout())
            body = {"handle": "h", "first_block": 2, "num_blocks": 1, "block_hashes": [None],
                    "layout": layout}  # fmt: skip
            if tail == "wrong":
                body["tail_hash"] = entry.tail_hash ^ 1
            status, got = await _raw_pull(port, body)
            assert status == 409, (status, got[:200])
            assert b"tail_hash" in got, got[:200]
            assert prefill.exports.handles() == ["h"], "a refused pull consumed the handle"
            # The pod the handle belongs to still pulls it.
            status, got = await _raw_pull(port, {**body, "tail_hash": entry.tail_hash})
            assert status == 200, got[:200]
            prefill.collect_transfers()
            assert prefill.exports.handles() == []
            prefill.check_integrity()
            assert prefill.kv.pool.num_referenced_blocks == 0

    asyncio.run(main())


async def test_concurrent_pulls_stage_no_more_than_the_budget(tmp_path) -> None:
    """Each pull took a shared-memory stage of its whole payload (rounded up to the
    pool's 8 MiB grain) before its first byte arrived, however many ran: N decode requests
    pulling from slow or stalled prefill pods held N stages at once, with no bound but the
    KV pool's size (tmpfs is the pod's memory: a burst of long prompts on a GPU decode
    pod could stage more than it has). Pulls now stage within a byte budget; one that
    finds no room waits for it (back-pressure) up to the pull's own timeout, then falls
    back to a local prefill (``staging_full``), and every request is still answered."""
    from .conftest import live_daemon
    from .test_pd_fleet import MODEL, PROMPT, _config, _metric

    config = _config("decode").model_copy(
        update={"kv_pull_timeout_s": 1.0, "kv_stage_dir": str(tmp_path)}
    )
    n = 6
    async with live_daemon(config) as d, aiohttp.ClientSession() as s:
        side = d.daemon.pd
        side.pull_budget.limit = 2 * side.stages.grain  # room for two pulls' stages
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, len(list(tmp_path.iterdir())))
                await asyncio.sleep(0.005)

        server = await asyncio.start_server(_hostile_peer("stalls-mid-body"), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]

        async def one(i: int) -> int:
            params = {"do_remote_prefill": True, "remote_host": "127.0.0.1",
                      "remote_port": port, "remote_request_id": f"h{i}"}  # fmt: skip
            body = {"model": MODEL, "prompt": f"{PROMPT} ({i})", "max_tokens": 2,
                    "kv_transfer_params": params}  # fmt: skip
            async with s.post(f"{d.url}/v1/completions", json=body) as r:
                return r.status

        watcher = asyncio.create_task(watch())
        try:
            async with server:
                statuses = await asyncio.gather(*(one(i) for i in range(n)))
        finally:
            watcher.cancel()
        assert statuses == [200] * n
        assert peak <= 2, f"{peak} stages of {side.stages.grain} bytes at once, budget two"
        failed = "pagefleet:kv_transfer_pulls_failed_total"
        counted = sum([await _metric(d.url, failed, reason=r) for r in ("timeout", "staging_full")])
        assert counted == n
        assert side.pull_budget.used == 0, "a finished pull kept its share of the budget"
        await d.daemon.engine_loop.invoke("check_integrity")


@contextlib.asynccontextmanager
async def _daemon_with_small_send_buffers(config):  # type: ignore[no-untyped-def]
    """A daemon started as ``live_daemon`` does, on a listener whose accepted sockets have
    4 KiB send buffers: a peer that stops reading holds the daemon's writes at once."""
    from pagefleet.daemon.app import Daemon

    daemon = Daemon(config)
    runner = web.AppRunner(daemon.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    listener.bind(("127.0.0.1", 0))
    await web.SockSite(runner, listener).start()
    try:
        await daemon.start()
        yield daemon, listener.getsockname()[1]
    finally:
        await daemon.drain(grace_s=2.0)
        await daemon.stop()
        await runner.cleanup()


async def _stalled_pull(port: int, body: bytes) -> socket.socket:
    """A connection that asks for a pull and never reads its answer (4 KiB window)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    head = b"POST /v1/kv/pull HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    await loop.sock_sendall(sock, head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return sock


async def test_concurrent_pulls_on_the_prefill_side_stage_no_more_than_its_budget(
    tmp_path,
) -> None:
    """A pull of a handle whose KV was not staged at export (beyond the four kept) had the
    engine process gather it into a new shared-memory stage of its own, however many such
    pulls ran: ten decode pods pulling ten handles from a prefill pod, slowly, held ten
    stages at once, bounded by nothing but the pinned handles. Beyond its byte budget a
    pull now streams layer by layer from the engine instead (the same bytes, slower)."""
    from pagefleet.daemon.kv_stage import ByteBudget
    from pagefleet.engine.kv_export import tail_hash
    from pagefleet.kvindex.hashing import block_hashes

    from .test_pd_fleet import MODEL, _config

    config = _config("prefill").model_copy(
        update={"kv_stage_dir": str(tmp_path), "num_gpu_blocks": 512,
                "kv_transfer_timeout_s": 20.0}
    )  # fmt: skip
    n, bs = 10, config.block_size
    prompts = [[(i * 31 + j * 7) % 200 + 5 for j in range(100)] for i in range(n)]
    async with _daemon_with_small_send_buffers(config) as (daemon, port):
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as s:
            for i, ids in enumerate(prompts):
                body = {"model": MODEL, "prompt": ids, "max_tokens": 1,
                        "kv_transfer_params": {"do_remote_decode": True,
                                               "remote_request_id": f"h{i}"}}  # fmt: skip
                async with s.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
        server = daemon.pd.export_server
        staged_at_export = len(list(tmp_path.iterdir()))
        assert 0 < staged_at_export < n, "some handles were not staged at export"
        server.read_budget = ByteBudget(server.stages.grain)  # one read stage at a time
        layout = layout_dict(daemon.engine_loop.kv_layout())
        socks = []
        try:
            for i, ids in enumerate(prompts):
                hashes = block_hashes(ids, bs, namespace=MODEL)
                body = json.dumps({
                    "handle": f"h{i}", "first_block": 0, "num_blocks": -(-len(ids) // bs),
                    "block_hashes": [*hashes, None] if len(ids) % bs else hashes,
                    "tail_hash": tail_hash(ids, hashes, bs, MODEL, None), "layout": layout,
                }).encode()  # fmt: skip
                socks.append(await _stalled_pull(port, body))
            peak = 0
            for _ in range(100):  # every pull has started sending (or waits to)
                await asyncio.sleep(0.02)
                peak = max(peak, len(list(tmp_path.iterdir())))
            assert peak <= staged_at_export + 1, (
                f"{peak - staged_at_export} stages gathered for pulls at once, budget one"
            )
        finally:
            for sock in socks:
                sock.close()
        for _ in range(250):  # the dropped connections end their pulls
            if server.read_budget.used == 0:
                break
            await asyncio.sleep(0.02)
        assert server.read_budget.used == 0, "a pull that ended kept its share of the budget"


def test_a_handle_pulled_twice_at_once_is_sent_whole_to_both_and_freed_once() -> None:
    """Two decode pods pull one handle at the same moment (a gateway's retry while the
    first pod's pull is still under way): each gets the whole verified range, the handle
    is freed once (counted released once, never expired), a third pull finds it gone, and
    no block stays pinned on any side."""
    prompt = [(i * 11) % 200 + 5 for i in range(300)]

    async def main() -> None:
        prefill = _engine()
        decodes = [_engine(), _engine(), _engine()]
        clients = [TcpKVTransfer(timeout_s=10.0) for _ in decodes]
        async with _serving_exports(prefill) as port:
            try:
                run_prefill(prefill, "h", prompt)
                plans = [e.reserve_import(f"r{i}", prompt) for i, e in enumerate(decodes)]
                assert all(p is not None for p in plans)
                layout = decodes[0].runner.kv_layout()
                got = await asyncio.gather(
                    clients[0].pull(_params(port, "h"), plans[0], layout),
                    clients[1].pull(_params(port, "h"), plans[1], layout),
                )
                assert bytes(got[0].buf) == bytes(got[1].buf) and len(got[0].buf) > 0
                prefill.collect_transfers()
                assert prefill.exports.handles() == []
                assert (prefill.exports.released_total, prefill.exports.expired_total) == (1, 0)
                with pytest.raises(KVPullError) as err:
                    await clients[2].pull(_params(port, "h"), plans[2], layout)
                assert err.value.reason == "not_found"
                for e, p in zip(decodes, plans, strict=True):
                    e.cancel_import(p)
                for e in (prefill, *decodes):
                    e.check_integrity()
                    assert e.kv.pool.num_referenced_blocks == 0
            finally:
                for c in clients:
                    await c.close()

    asyncio.run(main())


def test_a_truthful_header_then_fewer_payload_bytes_than_announced_is_a_protocol_failure(
    tmp_path,
) -> None:
    """A prefill pod whose header checks out and whose stream ends (connection closed)
    halfway through the payload it announced: the pull fails as ``protocol`` at once, into
    a shared-memory stage as well, instead of waiting for its timeout or handing the
    engine a half-filled stage."""
    import torch

    from pagefleet.daemon.kv_stage import KVStage, stage_bytes
    from pagefleet.testing.pd import read_blocks

    async def main() -> None:
        prefill, decode = _engine(), _engine()
        run_prefill(prefill, "h", PROMPT)
        plan = decode.reserve_import("r", PROMPT)
        assert plan is not None
        header, data = read_blocks(prefill, "h", plan)
        payload = b"".join(
            bytes(t.contiguous().view(-1).view(torch.uint8).numpy()) for kv in data for t in kv
        )
        raw = json.dumps(header).encode()
        body = struct.pack(">I", len(raw)) + raw + payload[: len(payload) // 2]

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(n)
            announced = 4 + len(raw) + len(payload)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % announced + body)
            await writer.drain()
            writer.close()  # the stream ends short of what was announced

        layout = decode.runner.kv_layout()
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = TcpKVTransfer(timeout_s=5.0)
        stage = KVStage.create(stage_bytes(layout, plan.num_pull_blocks), str(tmp_path))
        assert stage is not None
        try:
            async with server:
                for into in (None, stage):
                    t0 = time.monotonic()
                    with pytest.raises(KVPullError) as err:
                        await client.pull(_params(port, "h"), plan, layout, into=into)
                    assert err.value.reason == "protocol", err.value
                    assert time.monotonic() - t0 < 2.0, "it waited for bytes never coming"
        finally:
            stage.close()
            await client.close()
            decode.cancel_import(plan)
        prefill.collect_transfers()
        for e in (prefill, decode):
            e.check_integrity()
            assert e.kv.pool.num_referenced_blocks == 0

    asyncio.run(main())


async def test_pulls_of_one_handle_at_once_are_bounded_on_the_prefill_side(tmp_path) -> None:
    """Every pull of a handle, however many named it at once, took a read stage of its own
    (up to the whole 1 GiB read budget) and held the handle: 64 stalled pulls of one
    100-token handle held 64 stages (512 MiB of tmpfs) on the prefill pod. Two run at once
    now (a decode pod's and a gateway's retry on the next one); the rest are answered 429
    at once, take nothing, and the handle stays whole for a pull that comes after."""
    from pagefleet.engine.kv_export import tail_hash
    from pagefleet.kvindex.hashing import block_hashes

    from .test_pd_fleet import MODEL, _config

    config = _config("prefill").model_copy(
        update={"kv_stage_dir": str(tmp_path), "kv_transfer_timeout_s": 20.0}
    )
    ids, bs, n = [(j * 7) % 200 + 5 for j in range(100)], config.block_size, 6
    async with _daemon_with_small_send_buffers(config) as (daemon, port):
        body = {
            "model": MODEL,
            "prompt": ids,
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, "remote_request_id": "h"},
        }
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r,
        ):
            assert r.status == 200, await r.text()
        at_export = len(list(tmp_path.iterdir()))
        hashes = block_hashes(ids, bs, namespace=MODEL)
        pull = {"handle": "h", "first_block": 0, "num_blocks": -(-len(ids) // bs),
                "block_hashes": [*hashes, None], "layout": layout_dict(
                    daemon.engine_loop.kv_layout()),
                "tail_hash": tail_hash(ids, hashes, bs, MODEL, None)}  # fmt: skip
        socks = [await _stalled_pull(port, json.dumps(pull).encode()) for _ in range(n)]
        try:
            loop = asyncio.get_running_loop()
            refused = 0
            for sock in socks:
                try:
                    async with asyncio.timeout(2.0):
                        head = await loop.sock_recv(sock, 64)
                except TimeoutError:
                    continue  # a pull being sent (into a window that is full)
                refused += head.startswith(b"HTTP/1.1 429")
            assert refused == n - 2, f"{n - refused} pulls of one handle served at once"
            stages = len(list(tmp_path.iterdir()))
            assert stages <= max(at_export, 2), f"{stages} stages for one handle"
        finally:
            for sock in socks:
                sock.close()
        for _ in range(250):  # the dropped connections end their pulls
            if not daemon.pd.export_server._pulling:
                break
            await asyncio.sleep(0.02)
        status, got = await _raw_pull(port, pull)
        assert status == 200 and len(got) > 0
        assert daemon.pd.export_server._pulling == {}


async def test_requests_naming_one_handle_at_once_make_one_pull_on_a_decode_pod() -> None:
    """Requests that named the same handle at once each reserved blocks, took a stage of
    the pull budget and pulled the same KV (a replayed params object, a client's retry):
    N requests, N pulls of one handle. One pulls now; the others prefill locally at once
    (``busy``), and every request is answered."""
    from .conftest import live_daemon
    from .test_pd_fleet import MODEL, PROMPT, _config, _metric

    pulls = 0

    async def stalls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal pulls
        head = await reader.readuntil(b"\r\n\r\n")
        pulls += b"/v1/kv/pull" in head
        await reader.read()  # answers nothing until the client leaves
        writer.close()

    config = _config("decode").model_copy(update={"kv_pull_timeout_s": 2.0})
    async with live_daemon(config) as d, aiohttp.ClientSession() as s:
        server = await asyncio.start_server(stalls, "127.0.0.1", 0)
        params = {"do_remote_prefill": True, "remote_host": "127.0.0.1",
                  "remote_port": server.sockets[0].getsockname()[1],
                  "remote_request_id": "h"}  # fmt: skip
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": params}

        async def one() -> int:
            async with s.post(f"{d.url}/v1/completions", json=body) as r:
                return r.status

        async with server:
            statuses = await asyncio.gather(*(one() for _ in range(3)))
        assert statuses == [200] * 3
        assert pulls == 1, f"{pulls} pulls of one handle from one decode pod"
        assert await _metric(d.url, "pagefleet:kv_transfer_pulls_failed_total", reason="busy") == 2
        assert d.daemon.pd._importing == set()
        await d.daemon.engine_loop.invoke("check_integrity")
