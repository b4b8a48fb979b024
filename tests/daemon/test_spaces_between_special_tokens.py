"""vLLM's ``spaces_between_special_tokens`` through the real daemon and the openai client.

The flag only matters to a slow (Python) tokenizer, which puts a space around each added
token it decodes. This server loads fast tokenizers only (tokenizer.json), which write
added tokens where they are, as vLLM's fast detokenizer does: both values give the same
text. transformers' fast tokenizer on the same checkpoint is the oracle for that text.
"""

from __future__ import annotations

import openai
import pytest
from transformers import PreTrainedTokenizerFast

from pagefleet.daemon.config import DaemonConfig
from pagefleet.dev.process import free_port
from pagefleet.engine.tiny import ensure_tiny_checkpoint
from pagefleet.tokenizer import Tokenizer

from .conftest import live_daemon


@pytest.mark.parametrize("skip_special_tokens", [False, True])
async def test_spaces_between_special_tokens_is_accepted_and_changes_nothing(
    skip_special_tokens: bool,
) -> None:
    """``spaces_between_special_tokens: false`` was a 400 ("not supported"). Made to emit
    special tokens back to back (a slow tokenizer would put spaces between them), the
    output is the same for both values and is what transformers' fast tokenizer decodes
    the same ids to, with either value."""
    path = ensure_tiny_checkpoint("tiny")
    ours = Tokenizer.from_dir(path)
    oracle = PreTrainedTokenizerFast.from_pretrained(str(path))
    special = ours.token_to_id("<|im_start|>")
    assert special is not None and special in ours.all_special_ids
    assert special not in ours.eos_token_ids
    cfg = DaemonConfig(model="tiny", served_model_name="tiny-sp", port=free_port(),
                       pod_name="pod-sp", block_size=8, num_gpu_blocks=64, max_model_len=128,
                       max_num_seqs=4, max_queue=8)  # fmt: skip
    texts = {}
    async with live_daemon(cfg) as d:
        client = openai.AsyncOpenAI(base_url=d.base_url, api_key="none", max_retries=0)
        try:
            for spaces in (True, False):
                resp = await client.completions.create(
                    model="tiny-sp", prompt="Say:", max_tokens=3, temperature=0.0,
                    logprobs=0, logit_bias={str(special): 100},
                    extra_body={
                        "spaces_between_special_tokens": spaces,
                        "skip_special_tokens": skip_special_tokens,
                    },
                )  # fmt: skip
                choice = resp.choices[0]
                assert choice.logprobs.tokens == ["<|im_start|>"] * 3  # the ids ran
                texts[spaces] = choice.text
        finally:
            await client.close()
    ids = [special] * 3
    for spaces in (True, False):
        want = oracle.decode(
            ids, skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=spaces
        )
        assert texts[spaces] == want, (spaces, texts, want)
    assert texts[True] == texts[False]
    assert texts[False] == ("" if skip_special_tokens else "<|im_start|>" * 3)
