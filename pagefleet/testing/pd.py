"""In-process prefill -> decode hand-over between two engines, for tests and benchmarks.

Does what a decode daemon does around a network pull (reserve, read the prefill side's
pinned blocks, verify the header as ``pagefleet.daemon.kv_transfer.check_header`` does,
commit), without the network, so engine tests exercise the real bookkeeping.
"""

from __future__ import annotations

import time
from typing import Any

from pagefleet.daemon.kv_transfer import KVPullError, check_header, expected_hashes, layout_dict
from pagefleet.engine.engine import LLMEngine
from pagefleet.engine.kv_export import ImportPlan
from pagefleet.engine.sampling_params import SamplingParams


def run_prefill(engine: LLMEngine, request_id: str, prompt: list[int], lora: str | None = None):
    """Prefill ``prompt`` on ``engine`` (max_tokens=1, KV exported); step until done.

    When unpulled handles fill the pool so that the prompt cannot start, time passes: the
    handles expire (as a prefill pod's would at their deadline)."""
    engine.add_request(
        request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0), lora_id=lora,
        kv_export=True,
    )  # fmt: skip
    steps = 0
    while request_id in engine._requests:
        engine.step()
        engine.check_integrity()
        steps += 1
        if steps % 50 == 0:
            engine.collect_transfers(float("inf"))


def read_blocks(prefill: LLMEngine, handle: str, plan: ImportPlan) -> tuple[dict, Any]:
    """What the prefill daemon's pull endpoint sends: (header, per-layer (K, V)).

    Raises KVPullError("not_found") for a dead handle. Marks the handle consumed."""
    entry = prefill.exports.acquire(handle, time.monotonic())
    if entry is None:
        raise KVPullError("not_found", f"no live handle {handle!r}")
    try:
        bs = prefill.config.block_size
        end = plan.num_blocks
        if end > len(entry.block_ids):
            raise KVPullError("bad_params", "range past the handle's blocks")
        n_full = len(entry.block_hashes)
        layout = prefill.runner.kv_layout()  # type: ignore[attr-defined]
        header = {
            "layout": layout_dict(layout),
            "layers": [0, layout.num_layers],
            "first_block": plan.first_block,
            "num_blocks": plan.num_pull_blocks,
            "block_hashes": [
                entry.block_hashes[i] if i < n_full else None for i in range(plan.first_block, end)
            ],
            "tail_hash": entry.tail_hash if end > n_full else None,
            "token_ids": entry.token_ids[plan.first_block * bs : end * bs],
        }
        if header["block_hashes"] != expected_hashes(plan):
            raise KVPullError("hash_mismatch", "keys differ")
        data = prefill.runner.read_kv_blocks(  # type: ignore[attr-defined]
            entry.block_ids[plan.first_block : end], range(layout.num_layers)
        )
    except BaseException:
        prefill.exports.release(handle, consumed=False)
        raise
    prefill.exports.release(handle, consumed=True)
    return header, data


def transfer(
    prefill: LLMEngine,
    decode: LLMEngine,
    handle: str,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    lora: str | None = None,
) -> str:
    """Hand ``handle`` over to ``decode`` as request ``request_id``; on any failure, admit
    it for local prefill instead. Returns "pulled", "local_hit" or the failure reason."""
    plan = decode.reserve_import(request_id, prompt, lora)
    if plan is None:
        decode.add_request(request_id, prompt, params, lora_id=lora)
        return "no_reservation"
    if plan.num_pull_blocks == 0:
        decode.commit_import(plan, None, params)
        return "local_hit"
    try:
        header, data = read_blocks(prefill, handle, plan)
        check_header(header, plan, decode.runner.kv_layout())  # type: ignore[attr-defined]
    except KVPullError as exc:
        decode.cancel_import(plan)
        decode.add_request(request_id, prompt, params, lora_id=lora)
        return exc.reason
    decode.commit_import(plan, data, params)
    return "pulled"


def drain(engine: LLMEngine) -> dict[str, list[list[int]]]:
    """Step ``engine`` until idle; every request's tokens per sample index."""
    out: dict[str, list[list[int]]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            seqs = out.setdefault(o.request_id, [])
            for d in o.deltas:
                while len(seqs) <= d.index:
                    seqs.append([])
                seqs[d.index].extend(d.new_token_ids)
        engine.check_integrity()
    return out
