"""The real model (smollm2-135m: SmolLM2-135M-Instruct, Q4_1 GGUF) end to end.

Greedy output of the engine equals transformers' (which reads the same GGUF file with its
own code, dequantized to fp32) token for token, on plain and chat-templated prompts, run
as one batch with chunked prefill, then again from the prefix cache; the answers are
sensible; a streamed chat completion through the real daemon, driven by the official
openai client, says Paris; and the gateway resolves the preset's tokenizer without torch.

The model loads once per module (ours and transformers'); outputs are kept short because
30 layers on a shared 2-core machine are slow.
"""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest
import pytest_asyncio
import torch

from pagefleet.daemon.config import DaemonConfig
from pagefleet.dev.process import free_port
from pagefleet.engine.config import EngineConfig
from pagefleet.engine.engine import LLMEngine
from pagefleet.engine.loader import load_model, resolve_model
from pagefleet.engine.parts import load_parts
from pagefleet.engine.sampling_params import SamplingParams

from .conftest import LiveDaemon, live_daemon

PRESET = "smollm2-135m"
MAX_TOKENS = 10
PLAIN = [
    "The capital of France is",
    "The largest ocean on Earth is the",
    "def add(a, b):\n    return",
    "Monday, Tuesday, Wednesday,",
]
CHAT = [
    "What is the capital of France?",
    "What is the capital of Japan?",
    "What color is the sky on a clear day?",
    "Name the largest planet in the solar system.",
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # On a shared 2-core machine torch's thread pool under contention is many times slower
    # than one thread (the daemons of `pagefleet up` run with OMP_NUM_THREADS=1 too).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def loaded(one_thread):
    return load_model(resolve_model(PRESET))


@pytest.fixture(scope="module")
def prompts(loaded) -> list[list[int]]:
    tok = loaded[2]
    plain = [tok.encode(p) for p in PLAIN]
    chat = [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False
        )
        for q in CHAT
    ]
    return plain + chat


@pytest.fixture(scope="module")
def reference(prompts) -> list[list[int]]:
    """transformers' greedy continuations, reading the GGUF file with its own loader."""
    import transformers

    path = resolve_model(PRESET)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            gen = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=2,
                pad_token_id=2,
            )
            out.append(gen[0, len(ids) :].tolist())
    return out


def test_greedy_matches_transformers_batched_chunked_and_cached(loaded, prompts, reference) -> None:
    config, tok = loaded[1], loaded[2]
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert config.tie_word_embeddings
    # A 24-token budget chunks every chat prompt (~40 tokens) and mixes chunks with decodes.
    cfg = EngineConfig(model=PRESET, max_num_batched_tokens=24, block_size=16)
    engine = LLMEngine(cfg, parts=load_parts(cfg, loaded=loaded))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    first = [r.outputs[0].token_ids for r in engine.generate(prompts, params)]
    hits_before = engine.stats().prefix_hits_tokens
    second = [r.outputs[0].token_ids for r in engine.generate(prompts, params)]
    for i, ids in enumerate(prompts):
        assert first[i] == reference[i], f"prompt {i}: {tok.decode(ids)!r}"
        assert second[i] == reference[i], f"prompt {i} from the prefix cache"
    # The chat prompts share the template's system prompt (hits in the first pass); the
    # second pass finds every full block cached.
    assert hits_before >= 16 * 3
    cached = sum((len(p) - 1) // 16 * 16 for p in prompts)
    assert engine.stats().prefix_hits_tokens - hits_before >= cached
    # A 135M model is no oracle of facts, but these it gets right.
    answers = [tok.decode(t) for t in first]
    assert "Paris" in answers[0] and "Paris" in answers[len(PLAIN)]
    assert "Pacific" in answers[1]
    assert "a + b" in answers[2]
    assert "Tokyo" in answers[len(PLAIN) + 1]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def live(loaded):
    cfg = DaemonConfig(
        model=PRESET, served_model_name="smollm2", port=free_port(), pod_name="pod-real",
        block_size=16, num_gpu_blocks=64, max_model_len=512, max_num_seqs=4,
    )  # fmt: skip

    def factory(config: DaemonConfig, sink):
        cfg = config.engine_config()
        return LLMEngine(cfg, event_sink=sink, parts=load_parts(cfg, loaded=loaded))

    async with live_daemon(cfg, engine_factory=factory) as d:
        yield d


@pytest.mark.asyncio(loop_scope="module")
async def test_streamed_chat_through_the_daemon_says_paris(live: LiveDaemon) -> None:
    client = openai.AsyncOpenAI(base_url=live.base_url, api_key="none", max_retries=0)
    try:
        stream = await client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0,
            stream=True,
        )
        pieces, finish = [], None
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
    finally:
        await client.close()
    text = "".join(pieces)
    assert "Paris" in text, text
    assert finish == "stop"  # the model ended its answer with <|im_end|>
    assert len([p for p in pieces if p]) > 3  # streamed, not one blob


def test_gateway_builds_the_preset_tokenizer_without_torch(loaded) -> None:
    code = (
        "import json, sys\n"
        "from pagefleet.gateway.cli import GatewayConfig, build_gateway\n"
        f"gw = build_gateway(GatewayConfig(model={PRESET!r}, endpoints=['127.0.0.1:1']))\n"
        "t = gw.tokenizer.tokenizer\n"
        "msgs = [{'role': 'user', 'content': 'hi'}]\n"
        "ids = t.encode(t.apply_chat_template(msgs), add_special_tokens=False)\n"
        "heavy = [m for m in sys.modules if m == 'torch' or m.startswith('pagefleet.engine')]\n"
        "print(json.dumps({'torch': heavy, 'ids': ids}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["torch"] == []
    tok = loaded[2]
    msgs = [{"role": "user", "content": "hi"}]
    assert got["ids"] == tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False)
