"""Which IPC the daemon's engine process should use: pipe + pickle vs pyzmq (+ msgspec).

The message that dominates is one engine step's outputs: with a full batch, one
``RequestOutput`` per running request, each with a one-token delta. For each transport the
parent sends such messages to a child that decodes each one, and ping-pongs a small call
(what an ``add_request`` costs in latency). Baseline: ``multiprocessing.Pipe`` with pickle
of the dataclasses, and of them packed as tuples of builtins (``ipc.pack_outputs``: what
pagefleet/daemon/ipc.py sends); pyzmq and msgspec are measured when installed
(``pip install pyzmq msgspec``), else reported as missing.

    python bench/engine_ipc.py            # batch 64, 3000 step messages
    python bench/engine_ipc.py --quick    # 1000 step messages, < 60 s
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import tempfile
import time
from typing import Any

from pagefleet.daemon.ipc import pack_outputs, unpack_outputs
from pagefleet.engine.outputs import CompletionDelta, RequestMetrics, RequestOutput


def step_message(batch: int) -> list[RequestOutput]:
    now = time.monotonic()
    return [
        RequestOutput(
            request_id=f"cmpl-{i:032x}-0",
            prompt_token_ids=[],  # the engine process strips them (the daemon never reads)
            deltas=[CompletionDelta(index=0, new_token_ids=[1000 + i], new_text=" word")],
            finished=False,
            metrics=RequestMetrics(
                arrival_time=now,
                first_scheduled_time=now,
                first_token_time=now,
                last_token_time=now,
            ),
            num_generated_tokens=7,
        )
        for i in range(batch)
    ]


# -- transports: each child decodes what it receives and acks at the end ---------------------


def _pipe_child(conn: Any, packed: bool = False) -> None:
    while True:
        msg = pickle.loads(conn.recv_bytes())
        if packed and isinstance(msg, list):
            msg = unpack_outputs(msg)
        if msg == "end":
            conn.send_bytes(b"ok")
            return
        if msg == "ping":
            conn.send_bytes(pickle.dumps("pong"))


def _zmq_child(addr: str, codec: str) -> None:
    import zmq

    enc, dec = _codec(codec)
    sock = zmq.Context().socket(zmq.PAIR)
    sock.connect(addr)
    while True:
        msg = dec(sock.recv(copy=False).buffer)
        if msg == "end":
            sock.send(b"ok")
            return
        if msg == "ping":
            sock.send(enc("pong"))


def _codec(name: str) -> tuple[Any, Any]:
    if name == "pickle":
        return (lambda m: pickle.dumps(m, protocol=5)), pickle.loads
    import msgspec

    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder(list[RequestOutput] | str)
    return enc.encode, dec.decode


def run_pipe(msg: Any, steps: int, pings: int, packed: bool = False) -> dict[str, float]:
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=True)
    p = ctx.Process(target=_pipe_child, args=(child, packed))
    p.start()
    t0 = time.perf_counter()
    for _ in range(steps):
        # packed: as the engine process does, each step's outputs become tuples first
        parent.send_bytes(pickle.dumps(pack_outputs(msg) if packed else msg, protocol=5))
    parent.send_bytes(pickle.dumps("end"))
    parent.recv_bytes()
    step_us = 1e6 * (time.perf_counter() - t0) / steps
    p.join()
    p = ctx.Process(target=_pipe_child, args=(child, packed))
    p.start()
    t0 = time.perf_counter()
    for _ in range(pings):
        parent.send_bytes(pickle.dumps("ping"))
        pickle.loads(parent.recv_bytes())
    rtt_us = 1e6 * (time.perf_counter() - t0) / pings
    parent.send_bytes(pickle.dumps("end"))
    parent.recv_bytes()
    p.join()
    return {"step_msg_us": step_us, "ping_rtt_us": rtt_us}


def run_zmq(msg: Any, steps: int, pings: int, codec: str) -> dict[str, float]:
    import zmq

    enc, dec = _codec(codec)
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as d:
        for phase in ("steps", "pings"):
            addr = f"ipc://{d}/{phase}.sock"
            sock = zmq.Context.instance().socket(zmq.PAIR)
            sock.bind(addr)
            p = mp.get_context("fork").Process(target=_zmq_child, args=(addr, codec))
            p.start()
            t0 = time.perf_counter()
            if phase == "steps":
                for _ in range(steps):
                    sock.send(enc(msg), copy=False)
            else:
                for _ in range(pings):
                    sock.send(enc("ping"))
                    dec(sock.recv())
            sock.send(enc("end"))
            sock.recv()
            n = steps if phase == "steps" else pings
            out["step_msg_us" if phase == "steps" else "ping_rtt_us"] = (
                1e6 * (time.perf_counter() - t0) / n
            )
            p.join()
            sock.close(0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1000 step messages (< 60 s)")
    ap.add_argument("--batch", type=int, default=64, help="requests per step message")
    args = ap.parse_args()
    steps, pings = (1000, 1000) if args.quick else (3000, 3000)
    msg = step_message(args.batch)
    results: dict[str, Any] = {
        "pipe+pickle": run_pipe(msg, steps, pings),
        # What the daemon sends: the same outputs as tuples of builtins (ipc.pack_outputs).
        "pipe+packed": run_pipe(msg, steps, pings, packed=True),
    }
    for name, codec in (("zmq+pickle", "pickle"), ("zmq+msgspec", "msgspec")):
        try:
            results[name] = run_zmq(msg, steps, pings, codec)
        except ImportError as exc:
            results[name] = {"missing": str(exc)}
    base = results["pipe+pickle"]
    for name, r in results.items():
        if "missing" in r:
            print(f"{name:<12} not measured: {r['missing']}")
            continue
        step, rtt = r["step_msg_us"], r["ping_rtt_us"]
        print(f"{name:<12} step message ({args.batch} outputs) {step:7.1f} us "
              f"({step / base['step_msg_us']:.2f}x pipe), ping-pong {rtt:6.1f} us "
              f"({rtt / base['ping_rtt_us']:.2f}x pipe)")  # fmt: skip
    summary = {"batch": args.batch, "steps": steps, "load_avg_1m": round(os.getloadavg()[0], 2)}
    for name, r in results.items():
        for k, v in r.items():
            summary[f"{name}:{k}"] = round(v, 1) if isinstance(v, float) else v
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
