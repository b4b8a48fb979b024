"""The engine in its own process (engine_core.py, engine_client.py).

Here: the engine
really is another process, the wire carries errors back as the caller's 400, and a daemon
whose engine process is killed mid-stream ends the stream and exits non-zero within
seconds (Kubernetes restarts the pod) instead of hanging, with the cause in its
termination message.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import IO

import aiohttp
import pytest

from pagefleet.daemon import ipc
from pagefleet.daemon.config import DaemonConfig
from pagefleet.daemon.engine_client import EngineClient
from pagefleet.daemon.engine_loop import EngineLoop
from pagefleet.dev.process import free_port
from pagefleet.engine.outputs import (
    CompletionDelta,
    PromptLogprob,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)

from .conftest import live_daemon, wait_daemon_ready

PROMPT = "The quick brown fox jumps over the lazy dog and then"


def test_step_outputs_cross_the_pipe_whole():
    """Every field of a step's outputs survives packing (but the prompt, never read); a
    field added to the output dataclasses without packing it fails here."""
    for cls, names in ipc.PACKED_FIELDS.items():
        assert tuple(f.name for f in fields(cls)) == names, f"{cls.__name__} changed: pack it"
    out = RequestOutput(
        "r-0", [1, 2, 3],
        [CompletionDelta(0, [7, 8], "ab", [TokenLogprob(7, "a", -0.5, [(9, "z", -1.0)])]),
         CompletionDelta(1, [5], "c", None, "stop", "\n")],
        True, RequestMetrics(1.0, 2.0, 3.0, 4.0, 5.0, 16), 3,
        [None, PromptLogprob(2, "b", -2.5, 3, [(4, "d", -0.1)])],
    )  # fmt: skip
    (back,) = ipc.unpack_outputs(ipc.loads(ipc.dumps(ipc.pack_outputs([out]))))
    assert back == RequestOutput(
        out.request_id, [], out.deltas, out.finished, out.metrics, out.num_generated_tokens,
        out.prompt_logprobs,
    )  # fmt: skip


async def test_engine_runs_in_another_process_and_errors_cross_the_wire():
    cfg = DaemonConfig(model="tiny", served_model_name="m", port=free_port(), block_size=8,
                       num_gpu_blocks=64, max_model_len=128, max_num_seqs=4,
                       engine_process=True)  # fmt: skip
    async with live_daemon(cfg) as d:
        loop = d.daemon.engine_loop
        assert isinstance(loop, EngineClient)
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{d.url}/server_info") as r:
                pid = (await r.json())["engine_pid"]
            assert pid not in (None, os.getpid())
            body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0}
            async with s.post(f"{d.base_url}/completions", json=body) as r:
                assert r.status == 200, await r.text()
                out = await r.json()
            assert out["usage"]["completion_tokens"] == 5
            # A beam search's held and forked sequences stay inside the engine process.
            beams = {**body, "use_beam_search": True, "best_of": 3, "n": 2}
            async with s.post(f"{d.base_url}/completions", json=beams) as r:
                assert r.status == 200, await r.text()
                choices = (await r.json())["choices"]
            assert [c["index"] for c in choices] == [0, 1]
            assert choices[0]["text"] != choices[1]["text"]
            # The engine's own refusal (n above max_num_seqs) travels back as a 400.
            async with s.post(f"{d.base_url}/completions", json={**body, "n": 9}) as r:
                assert r.status == 400
                assert (await r.json())["error"]["param"] == "n"
        stats = await loop.stats()
        assert stats.num_free_blocks == stats.num_blocks
        assert stats.generation_tokens_total >= 5
        # Calls made in one event-loop turn cross the pipe as one message, answered in full.
        sent: list[tuple] = []
        real_send = loop._send
        loop._send = lambda msg: (sent.append(msg), real_send(msg))[1]  # type: ignore[method-assign]
        many = await asyncio.gather(*(loop.stats() for _ in range(8)))
        loop._send = real_send  # type: ignore[method-assign]
        assert [m[0] for m in sent] == ["calls"] and len(sent[0][1]) == 8
        assert all(m.num_blocks == stats.num_blocks for m in many)


async def test_engine_thread_and_engine_process_serve_alike():
    """One handle (engine_handle.py) over both transports: the engine on a thread
    (--no-engine-process) and in its own process give the same greedy text, plain and
    streamed, the engine's refusal as a 400, and the same named calls."""
    got: dict[bool, tuple[str, str]] = {}
    for in_process in (False, True):
        cfg = DaemonConfig(model="tiny", served_model_name="m", port=free_port(), block_size=8,
                           num_gpu_blocks=64, max_model_len=128, max_num_seqs=4,
                           engine_process=in_process)  # fmt: skip
        async with live_daemon(cfg) as d, aiohttp.ClientSession() as s:
            handle = d.daemon.engine_loop
            assert isinstance(handle, EngineClient if in_process else EngineLoop)
            assert (handle.pid != os.getpid()) == in_process
            body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            async with s.post(f"{d.base_url}/completions", json=body) as r:
                assert r.status == 200, await r.text()
                text = (await r.json())["choices"][0]["text"]
            streamed = ""
            async with s.post(f"{d.base_url}/completions", json={**body, "stream": True}) as r:
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        streamed += json.loads(line[6:])["choices"][0]["text"]
            async with s.post(f"{d.base_url}/completions", json={**body, "n": 9}) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "n"
            assert await handle.cached_block_hashes()  # the prompt's blocks are cached
            await handle.reset_prefix_cache()
            assert await handle.cached_block_hashes() == set()
            stats = await handle.stats()
            assert stats.generation_tokens_total == 24 and stats.num_running == 0
            got[in_process] = (text, streamed)
    assert got[False] == got[True] and got[True][0] == got[True][1] != ""


@dataclass
class CliDaemon:
    """A `pagefleet daemon --engine-process` child process, ready, and its engine's pid."""

    proc: subprocess.Popen
    base: str
    engine_pid: int
    term: Path  # its --termination-log
    log: IO[bytes]  # its stdout and stderr

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode()[-3000:]

    async def exit_code(self, timeout: float = 15) -> int:
        return await asyncio.get_running_loop().run_in_executor(None, self.proc.wait, timeout)


@contextlib.asynccontextmanager
async def cli_daemon(
    s: aiohttp.ClientSession,
    tmp_path: Path,
    *args: str,
    cwd: Path | None = None,
    new_session: bool = False,
) -> AsyncIterator[CliDaemon]:
    """Start the tiny model's daemon as Kubernetes would (a process, a termination log)
    with ``args`` added, in ``cwd`` (``new_session``: its own process group, which a test
    may signal whole); kill whatever is left of it and its engine on the way out."""
    port = free_port()
    term = tmp_path / "termination-log"
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagefleet.cli", "daemon", "--model", "tiny",
             "--port", str(port), "--max-model-len", "256", "--block-size", "8",
             "--num-gpu-blocks", "64", "--engine-process", "--termination-log", str(term),
             *args],
            stdout=log, stderr=log, cwd=cwd, start_new_session=new_session,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        engine_pid = None
        try:
            base = f"http://127.0.0.1:{port}"
            await wait_daemon_ready(s, base, proc)
            async with s.get(f"{base}/server_info") as r:
                engine_pid = (await r.json())["engine_pid"]
            assert engine_pid not in (None, proc.pid)
            yield CliDaemon(proc, base, engine_pid, term, log)
        finally:
            if engine_pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(engine_pid, signal.SIGKILL)
            if new_session:  # the fork server too
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


async def stream_ends_unfinished(r: aiohttp.ClientResponse) -> None:
    """The rest of a stream arrives within seconds (an in-band error, or the connection
    closes): no hang, and no normal end either."""
    try:
        rest = await asyncio.wait_for(r.read(), 10)
    except aiohttp.ClientError:
        rest = b""
    assert b'"finish_reason":"length"' not in rest


STREAM = {"prompt": PROMPT, "max_tokens": 200, "stream": True, "ignore_eos": True}


async def test_killed_engine_process_ends_streams_and_the_daemon_exits_nonzero(tmp_path):
    async with aiohttp.ClientSession() as s, cli_daemon(s, tmp_path) as d:
        async with s.post(f"{d.base}/v1/completions", json=STREAM) as r:
            assert r.status == 200
            assert (await r.content.readline()).startswith(b"data: ")  # decoding
            os.kill(d.engine_pid, signal.SIGKILL)
            t0 = time.monotonic()
            await stream_ends_unfinished(r)
        rc = await d.exit_code()
        waited = time.monotonic() - t0
        assert rc != 0, d.output()
        assert waited < 10, f"the daemon took {waited:.1f}s to exit"
        assert "engine process died" in d.term.read_text()


async def test_sigterm_to_the_whole_group_under_load_drains_every_stream(tmp_path):
    """`pagefleet up` (and a container runtime killing a process group) sends SIGTERM to the
    daemon, its engine process and the fork server at once. Under load (16 streams, 8 run
    at a time in 40 blocks of 8 tokens: 8 x 58 tokens, 18 of prompt, do not fit, so some
    are preempted) every accepted stream still ends normally, new requests get 503, and the
    daemon exits 0 once they are done, its engine process with it."""
    async with (
        aiohttp.ClientSession() as s,
        cli_daemon(s, tmp_path, "--max-num-seqs", "8", "--num-gpu-blocks", "40",
                   "--drain-timeout", "60", new_session=True) as d,
    ):  # fmt: skip
        body = {"prompt": PROMPT, "max_tokens": 40, "stream": True, "ignore_eos": True}

        async def stream(started: asyncio.Event) -> bytes:
            async with s.post(f"{d.base}/v1/completions", json=body) as r:
                assert r.status == 200
                await r.content.readline()
                started.set()
                return await r.read()

        starts = [asyncio.Event() for _ in range(16)]
        streams = [asyncio.create_task(stream(e)) for e in starts]
        # Half have their first token; the rest wait in the engine's queue.
        while sum(e.is_set() for e in starts) < 8:
            await asyncio.sleep(0.01)
        os.killpg(d.proc.pid, signal.SIGTERM)
        t0 = time.monotonic()
        deadline = t0 + 15  # the signal lands asynchronously
        while time.monotonic() < deadline:
            async with s.get(f"{d.base}/ready") as r:
                if r.status == 503:
                    break
            await asyncio.sleep(0.01)
        async with s.post(f"{d.base}/v1/completions", json={"prompt": "x"}) as r:
            assert r.status == 503, "still admitting after SIGTERM"
        rests = await asyncio.wait_for(asyncio.gather(*streams), 60)
        for rest in rests:
            assert rest.count(b'"finish_reason":"length"') == 1, rest[-300:]
            assert rest.rstrip().endswith(b"data: [DONE]")
        rc = await d.exit_code(30)
        assert rc == 0, d.output()
        assert time.monotonic() - t0 < 30
        assert _gone_or_zombie(d.engine_pid)


def _gone_or_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


async def test_a_stray_module_in_the_working_directory_shadows_nothing_in_the_engine(
    tmp_path,
):
    """`python -m` puts the working directory first on sys.path, and the engine process
    and its fork server inherited it: a local torch.py would have replaced torch there."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    # Importable: the fork server would keep it in sys.modules for every engine process.
    (cwd / "torch.py").write_text("STRAY = True\n")
    async with aiohttp.ClientSession() as s, cli_daemon(s, tmp_path, cwd=cwd) as d:
        body = {"prompt": PROMPT, "max_tokens": 3}
        async with s.post(f"{d.base}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
        assert "Traceback" not in d.output()


def test_silence_clock_counts_only_busy_spells():
    """Quiet while idle is not a hang; the clock restarts when work arrives after idling."""
    from pagefleet.daemon.liveness import SilenceClock, check_period

    c = SilenceClock(last_heard=0.0, busy_since=0.0)
    assert c.silent_for(100.0, busy=False) == 0.0
    c.work_started(100.0)  # idle for 100 s, then a request: not silent yet
    assert c.silent_for(101.0, busy=True) == 1.0
    c.heard(105.0)
    assert c.silent_for(107.5, busy=True) == 2.5
    assert check_period(60.0) == 1.0 and check_period(2.0) == 0.5


async def test_hung_engine_process_fails_health_and_the_daemon_exits_nonzero(tmp_path):
    """A stopped (SIGSTOP), not dead, engine process: harmless while idle; with a request
    in flight, past --engine-hang-timeout it is killed, /health fails and the daemon exits
    non-zero saying it hung."""
    timeout = 1.5
    async with (
        aiohttp.ClientSession() as s,
        cli_daemon(s, tmp_path, "--engine-hang-timeout", str(timeout)) as d,
    ):
        # The HTTP process serves without torch (1.4 s and ~500 MB it does not need):
        # nothing it imports or unpickles from the engine process loads it.
        with open(f"/proc/{d.proc.pid}/maps") as maps:
            assert "libtorch" not in maps.read()
        # Idle and stopped for longer than the timeout: nothing is owed, no hang.
        os.kill(d.engine_pid, signal.SIGSTOP)
        await asyncio.sleep(2 * timeout)
        async with s.get(f"{d.base}/health") as r:
            assert r.status == 200, await r.text()
        os.kill(d.engine_pid, signal.SIGCONT)
        async with s.post(f"{d.base}/v1/completions", json=STREAM) as r:
            assert r.status == 200
            assert (await r.content.readline()).startswith(b"data: ")  # decoding
            os.kill(d.engine_pid, signal.SIGSTOP)
            t0 = time.monotonic()
            health = None
            while d.proc.poll() is None and time.monotonic() - t0 < 15:
                try:
                    async with s.get(f"{d.base}/health") as h:
                        if h.status == 503:
                            health = time.monotonic() - t0
                            break
                except aiohttp.ClientError:
                    break  # the daemon already exited
                await asyncio.sleep(0.1)
            await stream_ends_unfinished(r)
        rc = await d.exit_code()
        waited = time.monotonic() - t0
        assert rc != 0, d.output()
        assert timeout < waited < timeout + 8, f"the daemon exited {waited:.1f}s after"
        assert health is None or health > timeout
        assert "engine process hung" in d.term.read_text(), d.term.read_text()


async def test_a_stopped_engine_behind_megabytes_of_calls_is_still_killed(tmp_path):
    """Calls written on the event loop blocked it once the pipe's buffer filled toward a
    stopped engine: the watchdog (on that loop) never ran, /health never answered, SIGTERM
    was never handled, and the daemon hung for good. Writes go through a thread now."""
    timeout = 1.5
    args = ("--engine-hang-timeout", str(timeout), "--max-model-len", "4000",
            "--num-gpu-blocks", "520")  # fmt: skip
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s, cli_daemon(s, tmp_path, *args) as d:
        os.kill(d.engine_pid, signal.SIGSTOP)
        # 200 prompts of 3000 ids: ~1.8 MB pickled toward a pipe nobody reads.
        posts = [
            asyncio.ensure_future(s.post(f"{d.base}/v1/completions", json={
                "prompt": [300 + (j * 7 + i) % 700 for j in range(3000)], "max_tokens": 4}))
            for i in range(200)
        ]  # fmt: skip
        t0 = time.monotonic()
        rc = await d.exit_code()
        waited = time.monotonic() - t0
        for p in posts:
            p.cancel()
        await asyncio.gather(*posts, return_exceptions=True)
        assert rc != 0, d.output()
        assert waited < timeout + 10, f"the daemon exited {waited:.1f}s after"
        assert "engine process hung" in d.term.read_text(), d.term.read_text()


async def test_an_engine_that_dies_during_the_drain_is_a_nonzero_exit(tmp_path):
    """SIGTERM, then the engine process is killed mid-drain: the pod must report the crash
    (exit status, termination message), not a clean exit 0."""
    args = ("--max-model-len", "4000", "--num-gpu-blocks", "520")
    long_stream = {**STREAM, "max_tokens": 3500}  # still decoding when the engine dies
    async with aiohttp.ClientSession() as s, cli_daemon(s, tmp_path, *args) as d:
        async with s.post(f"{d.base}/v1/completions", json=long_stream) as r:
            assert (await r.content.readline()).startswith(b"data: ")
            d.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            os.kill(d.engine_pid, signal.SIGKILL)
            await stream_ends_unfinished(r)
        rc = await d.exit_code()
        assert rc != 0, d.output()
        assert "during the drain" in d.term.read_text(), d.term.read_text()


async def test_text_made_in_the_http_process_matches_the_engines_own(monkeypatch):
    """With the engine in its own process, requests without stop strings are decoded in the
    HTTP process (text_outputs.py): the text must equal the engine's own detokenizer's, for
    greedy and seeded sampling, n > 1, EOS and stop-token-id endings, special tokens kept,
    streamed or not; stop strings still end in the engine."""
    from pagefleet.engine.engine import LLMEngine
    from pagefleet.engine.sampling_params import SamplingParams

    cfg = DaemonConfig(model="tiny", served_model_name="m", port=free_port(), block_size=8,
                       num_gpu_blocks=256, max_model_len=256, max_num_seqs=8,
                       engine_process=True)  # fmt: skip
    from pagefleet.daemon import text_outputs

    engine = LLMEngine(cfg.engine_config())
    prompt = engine.tokenizer.encode(PROMPT)
    filled = {"requests": 0}
    real_init = text_outputs.RequestText.__init__

    def counting_init(self, *args):  # type: ignore[no-untyped-def]
        filled["requests"] += 1
        real_init(self, *args)

    monkeypatch.setattr(text_outputs.RequestText, "__init__", counting_init)
    cases = [
        {"max_tokens": 40, "temperature": 0, "ignore_eos": True},
        {"max_tokens": 40, "temperature": 1.0, "seed": 7, "n": 2},
        {"max_tokens": 60, "temperature": 1.2, "seed": 3, "skip_special_tokens": False},
        {"max_tokens": 40, "temperature": 1.0, "seed": 11, "stop_token_ids": []},
        {"max_tokens": 40, "temperature": 0, "ignore_eos": True, "stop": ["e"]},
    ]
    # A stop token id the greedy run really meets, so one case ends on it.
    greedy = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0,
                                                      ignore_eos=True))[0]  # fmt: skip
    cases[3]["stop_token_ids"] = [greedy.outputs[0].token_ids[5]]
    cases[3]["temperature"] = 0
    async with live_daemon(cfg) as d:
        assert isinstance(d.daemon.engine_loop, EngineClient)
        async with aiohttp.ClientSession() as s:
            for case in cases:
                (want,) = engine.generate([prompt], SamplingParams(**case))
                want_texts = [o.text for o in want.outputs]
                want_reasons = [o.finish_reason for o in want.outputs]
                body = {"prompt": prompt, **case}
                async with s.post(f"{d.base_url}/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    got = sorted((await r.json())["choices"], key=lambda c: c["index"])
                assert [c["text"] for c in got] == want_texts, case
                assert [c["finish_reason"] for c in got] == want_reasons, case
                streamed = [""] * len(want_texts)
                async with s.post(f"{d.base_url}/completions", json={**body, "stream": True}) as r:
                    async for line in r.content:
                        if line.startswith(b"data: {"):
                            for c in json.loads(line[6:])["choices"]:
                                streamed[c["index"]] += c["text"]
                assert streamed == want_texts, case
                if case.get("stop_token_ids"):
                    assert want_reasons == ["stop"]  # the case really ends on its token
    # Every case but the stop-string one was decoded here, not in the engine.
    assert filled["requests"] >= 2 * (len(cases) - 1)


async def test_a_message_the_http_process_cannot_read_ends_the_engine_not_the_wait():
    """The engine process sends what this process cannot unpickle (code skew): the reader
    stops the engine and loading fails with the cause, instead of waiting forever."""
    from pagefleet.testing.engine_factories import unreadable_engine_factory

    cfg = DaemonConfig(model="tiny", port=free_port(), num_gpu_blocks=32, max_model_len=128)
    client = EngineClient(cfg, asyncio.get_running_loop(), factory=unreadable_engine_factory)
    client.start()
    try:
        with pytest.raises(Exception, match="cannot read"):
            await asyncio.wait_for(client.wait_loaded(), 60)
        assert client.dead
        # The reader stops the engine process; its exit is not instant on a loaded machine.
        deadline = time.monotonic() + 15
        while client._proc.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not client._proc.is_alive()
    finally:
        await asyncio.get_running_loop().run_in_executor(None, client.stop, 5.0)
