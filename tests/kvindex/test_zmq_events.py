"""KV events in vLLM's ZeroMQ format (kvindex/zmq_events.py): a real pyzmq subscriber
decodes what a real daemon (tiny model, in-process) publishes with --kv-events-zmq.

The subscriber reads the frames the way vLLM's documented subscriber does: topic, an
8-byte big-endian sequence, a msgpack ``[ts, events]`` whose events are arrays tagged by
their type's name. Every wait is for the message itself (bounded), never a fixed sleep:
a SUB socket's subscription reaches the publisher some time after it connects, so the
live check first waits for any event to arrive (probe requests until one does).
"""

from __future__ import annotations

import time

import aiohttp
import msgpack
import zmq
import zmq.asyncio
from aiohttp import web

from pagefleet.daemon.app import Daemon
from pagefleet.daemon.config import DaemonConfig
from pagefleet.dev.process import free_port
from pagefleet.kvindex.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from pagefleet.kvindex.hashing import block_hashes, root_hash
from pagefleet.kvindex.zmq_events import encode_batch

NS = "zmq-test"
BS = 4


def test_payload_is_vllms_array_layout() -> None:
    batch = KVEventBatch(
        12.5,
        7,
        [
            BlockStored([1, 2**64 - 1], None, list(range(8)), 4),
            BlockStored([3], 2, [9, 9, 9, 9], 4, lora_id="adapter-a"),
            BlockRemoved([1]),
            AllBlocksCleared(),
        ],
    )
    ts, events = msgpack.unpackb(encode_batch(batch))
    assert ts == 12.5
    assert events[0] == ["BlockStored", [1, 2**64 - 1], None, list(range(8)), 4, None, None]
    assert events[1][:5] == ["BlockStored", [3], 2, [9, 9, 9, 9], 4]
    assert isinstance(events[1][5], int) and 0 <= events[1][5] < 2**63  # vLLM's lora_id: int
    assert events[2] == ["BlockRemoved", [1], None]
    assert events[3] == ["AllBlocksCleared"]


async def _complete(url: str, tokens: list[int]) -> None:
    async with aiohttp.ClientSession() as s:
        body = {"prompt": tokens, "max_tokens": 2, "temperature": 0}
        async with s.post(f"{url}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()


async def _recv(sock: zmq.asyncio.Socket, timeout_s: float) -> list[bytes] | None:
    if await sock.poll(int(timeout_s * 1000)) == 0:
        return None
    return await sock.recv_multipart()


async def test_a_daemon_publishes_what_a_zmq_subscriber_decodes() -> None:
    pub, rep = free_port(), free_port()
    cfg = DaemonConfig(
        model="tiny", served_model_name="tiny-zmq", port=free_port(), kv_namespace=NS,
        block_size=BS, num_gpu_blocks=128, max_model_len=256,
        kv_events_zmq=f"tcp://127.0.0.1:{pub}", kv_events_zmq_replay=f"tcp://127.0.0.1:{rep}",
    )  # fmt: skip
    daemon = Daemon(cfg)
    runner = web.AppRunner(daemon.app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", cfg.port).start()
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        await daemon.start()
        url = f"http://127.0.0.1:{cfg.port}"
        sub.connect(f"tcp://127.0.0.1:{pub}")
        # The subscription is live once any event arrives: probe with distinct prompts.
        first: list[bytes] | None = None
        deadline = time.monotonic() + 60
        probe = 0
        while first is None:
            assert time.monotonic() < deadline, "no KV event reached the subscriber in 60 s"
            await _complete(url, [500 + probe] * (2 * BS))
            probe += 1
            first = await _recv(sub, 0.5)
        while await _recv(sub, 0.0) is not None:  # drain the probes' other events
            pass

        tokens = list(range(100, 100 + 5 * BS + 2))  # 5 full blocks and a partial one
        expected = block_hashes(tokens, BS, NS)
        await _complete(url, tokens)
        stored: list[list] = []
        seqs: list[int] = []
        deadline = time.monotonic() + 30
        while not {h for e in stored for h in e[1]} >= set(expected):
            assert time.monotonic() < deadline, f"the prompt's blocks never arrived: {stored}"
            msg = await _recv(sub, 5.0)
            assert msg is not None, "no event for the prompt within 5 s"
            topic, seq, payload = msg
            assert topic == b"" and len(seq) == 8
            seqs.append(int.from_bytes(seq, "big"))
            ts, events = msgpack.unpackb(payload)
            assert isinstance(ts, float) and abs(ts - time.time()) < 60
            stored += [e for e in events if e[0] == "BlockStored"]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # consecutive, in order
        run = next(e for e in stored if expected[0] in e[1])
        _, hashes, parent, token_ids, block_size, lora_id, medium = run
        i = hashes.index(expected[0])
        assert hashes[i : i + 5] == expected and block_size == BS
        assert token_ids[i * BS : (i + 5) * BS] == tokens[: 5 * BS]
        assert i == 0 and parent in (None, root_hash(NS))  # the chain's first block
        assert lora_id is None and medium is None

        # Replay: from sequence 0, every message published so far, then the end marker.
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{rep}")
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed: list[int] = []
        while True:
            msg = await _recv(dealer, 10.0)
            assert msg is not None, "the replay socket did not answer within 10 s"
            _, seq, payload = msg
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            replayed.append(int.from_bytes(seq, "big"))
        dealer.close(0)
        # (the decode steps after the live check may have published more since)
        assert replayed == list(range(len(replayed))) and replayed[-1] >= seqs[-1]
    finally:
        sub.close(0)
        ctx.term()
        await daemon.drain(grace_s=2.0)
        await daemon.stop()
        await runner.cleanup()
