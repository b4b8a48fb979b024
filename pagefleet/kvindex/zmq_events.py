"""KV events on the wire vLLM uses (ZeroMQ PUB + msgpack), beside the Redis index.

Routers that already read vLLM's KV events (vllm-router's ``kv_aware`` policy, llm-d's
precise prefix scorer) can then route on pagefleet daemons without pagefleet's Redis.

The format, as vLLM's publisher sends it (written from its documented subscriber, not
copied):
- every message is three frames: ``topic`` (bytes, default empty), the sequence number as
  8 bytes big-endian (0, 1, 2, ... per publisher), and the msgpack payload;
- the payload is an array ``[ts, events]``; each event an array whose first element is its
  type's name, then its fields in order: ``["BlockStored", block_hashes,
  parent_block_hash, token_ids, block_size, lora_id, medium]``, ``["BlockRemoved",
  block_hashes, medium]``, ``["AllBlocksCleared"]``;
- a replay socket (ROUTER), when configured, answers a request frame holding an 8-byte
  big-endian start sequence with ``[identity, b"", seq, payload]`` for every buffered
  message from that sequence on, then ``[identity, b"", (-1 as 8 bytes signed), b""]``.

Block hashes are pagefleet's 64-bit keys (kvindex/hashing.py), unsigned. ``lora_id`` is
an int in vLLM; pagefleet names adapters, so a named adapter is sent as the low 63 bits of
its namespace-free root hash (stable across processes) and no adapter as nil. ``medium``
is nil: these are the engine's own blocks.

Invariant: messages leave in the order the engine emitted the batches, with consecutive
sequence numbers; a subscriber that sees a gap can ask the replay socket for the missing
ones while they are in the buffer (``replay_buffer`` messages).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from typing import Any

import msgpack

from pagefleet.kvindex.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from pagefleet.kvindex.hashing import root_hash

logger = logging.getLogger(__name__)

_END = (-1).to_bytes(8, "big", signed=True)
_STOP = object()


def _lora(lora_id: str | None) -> int | None:
    return None if not lora_id else root_hash(lora_id) & 0x7FFF_FFFF_FFFF_FFFF


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload of one engine step's events, in vLLM's array layout."""
    events: list[list[Any]] = []
    for e in batch.events:
        if isinstance(e, BlockStored):
            events.append(
                [
                    "BlockStored",
                    list(e.block_hashes),
                    e.parent_block_hash,
                    list(e.token_ids),
                    e.block_size,
                    _lora(e.lora_id),
                    None,
                ]
            )
        elif isinstance(e, BlockRemoved):
            events.append(["BlockRemoved", list(e.block_hashes), None])
        elif isinstance(e, AllBlocksCleared):
            events.append(["AllBlocksCleared"])
    return msgpack.packb([batch.ts, events], use_bin_type=True)


class ZmqKVEventPublisher:
    """Publishes KV event batches on a ZeroMQ PUB socket from its own thread.

    ``sink`` may be called from any one thread (the engine's, or the event loop); it only
    queues. The thread owns the sockets (ZeroMQ sockets are not thread-safe), encodes,
    numbers and sends. ``endpoint`` is bound, e.g. ``tcp://*:5557``; ``replay_endpoint``
    (optional) is a ROUTER socket serving the last ``replay_buffer`` messages.
    """

    def __init__(
        self,
        endpoint: str,
        topic: str = "",
        replay_endpoint: str | None = None,
        replay_buffer: int = 10_000,
        max_queue: int = 100_000,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._topic = topic.encode("utf-8")
        self._buffer: deque[tuple[bytes, bytes]] = deque(maxlen=max(1, replay_buffer))
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_queue)
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.dropped = 0
        self.sent = 0

    def start(self) -> None:
        """Bind the sockets (in the publisher's thread) and wait until they are bound."""
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)
        self._thread.start()
        self._ready.wait(10.0)
        if self._error is not None:
            raise RuntimeError(
                f"cannot publish KV events on {self.endpoint!r}: {self._error}; "
                "check --kv-events-zmq (an address this pod may bind, e.g. tcp://*:5557)"
            ) from self._error

    def sink(self, batch: KVEventBatch) -> None:
        """Queue one batch; never blocks the engine (a full queue drops and counts it)."""
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:  # once: the engine thread must not log per step
                logger.warning(
                    "KV events on %s: the send queue is full, dropping batches (subscribers "
                    "will see a sequence gap; replay cannot cover dropped ones)",
                    self.endpoint,
                )

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, then close the sockets."""
        if self._thread is None:
            return
        self._queue.put(_STOP)
        self._thread.join(timeout_s)
        self._thread = None

    def _run(self) -> None:
        import zmq  # lazy: only a daemon that publishes this way needs pyzmq

        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        replay = None
        try:
            pub.setsockopt(zmq.LINGER, 1000)
            pub.bind(self.endpoint)
            if self.replay_endpoint:
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            self._error = exc
            self._ready.set()
            pub.close(0)
            ctx.term()
            return
        self._ready.set()
        seq = 0
        try:
            while True:
                if replay is not None:
                    self._serve_replays(zmq, replay)
                try:
                    item = self._queue.get(timeout=0.05 if replay is not None else None)
                except queue.Empty:
                    continue
                if item is _STOP:
                    break
                assert isinstance(item, KVEventBatch)
                payload = encode_batch(item)
                seq_bytes = seq.to_bytes(8, "big")
                pub.send_multipart((self._topic, seq_bytes, payload), copy=False)
                self._buffer.append((seq_bytes, payload))
                seq += 1
                self.sent += 1
        except Exception:
            logger.exception("KV event publishing on %s stopped", self.endpoint)
        finally:
            pub.close()
            if replay is not None:
                replay.close()
            ctx.term()

    def _serve_replays(self, zmq: Any, replay: Any) -> None:
        while True:
            try:
                frames = replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, start_frame = frames[0], frames[-1]
            start = int.from_bytes(start_frame, "big") if len(start_frame) == 8 else 0
            for seq_bytes, payload in list(self._buffer):
                if int.from_bytes(seq_bytes, "big") >= start:
                    replay.send_multipart((identity, b"", seq_bytes, payload))
            replay.send_multipart((identity, b"", _END, b""))
