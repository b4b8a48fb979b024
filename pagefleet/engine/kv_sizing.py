"""How many bytes the paged KV pool may take on a GPU.

Pure arithmetic (no torch), so the rule is unit-tested on any machine: the daemon may fill
``utilization`` of the device's total memory; weights are already loaded when this runs
(they show up as used memory), a reserve covers the forward pass' transient activations,
and the KV pool gets the rest.
"""

from __future__ import annotations

# Bytes per element of the float32 logits (the sampler works in float32) and how many
# such buffers a step holds at once (logits, and the softmax/processed copy of them).
_LOGIT_BYTES = 4
_LOGIT_COPIES = 2


def activation_reserve_bytes(
    max_num_batched_tokens: int, max_num_seqs: int, vocab_size: int
) -> int:
    """Transient memory of one engine step beyond weights and KV: the logits of the rows a
    step samples (at most ``max_num_seqs``, not every batched token) plus hidden-state
    scratch for every batched token, rounded up generously (an estimate, never exact)."""
    logits = max_num_seqs * vocab_size * _LOGIT_BYTES * _LOGIT_COPIES
    scratch = max_num_batched_tokens * vocab_size  # ~ tokens x 4 x hidden x (few) for usual shapes
    return logits + scratch


def gpu_kv_pool_bytes(
    free_bytes: int, total_bytes: int, utilization: float, reserve_bytes: int
) -> int:
    """KV pool bytes such that, once the pool and the step's activations are allocated, the
    device's used memory stays at most ``utilization * total_bytes``.

    ``free_bytes``/``total_bytes`` as ``torch.cuda.mem_get_info`` reports them after the
    weights loaded (memory other processes hold counts as used, so two daemons sharing a
    GPU each keep to their share only if their fractions add up to <= 1). Raises
    ValueError naming the fix when nothing is left for the pool.
    """
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    if not 0 <= free_bytes <= total_bytes:
        raise ValueError(f"free GPU memory {free_bytes} is not within [0, total {total_bytes}]")
    used = total_bytes - free_bytes
    budget = int(total_bytes * utilization) - used - reserve_bytes
    if budget <= 0:
        gib = 1 << 30
        raise ValueError(
            f"gpu_memory_utilization={utilization:g} leaves no room for the KV pool: "
            f"{used / gib:.2f} GiB of {total_bytes / gib:.2f} GiB are in use after loading "
            f"the weights and a step needs ~{reserve_bytes / gib:.2f} GiB of activations; "
            "raise the fraction, lower max_num_seqs/max_num_batched_tokens, or use a "
            "smaller model"
        )
    return budget


def check_kv_holds_max_len(
    max_model_len: int | None, num_blocks: int, block_size: int, bytes_per_block: int
) -> None:
    """Raise ValueError when an explicitly asked ``max_model_len`` does not fit the KV pool:
    one request of that length could never run (a lone sequence must fit, or preemption
    cannot make progress). Without an explicit length the engine caps the model's own
    maximum at the pool, with a warning, so a default start still serves."""
    capacity = num_blocks * block_size
    if max_model_len is None or max_model_len <= capacity:
        return
    need_blocks = -(-max_model_len // block_size)
    need_mib = need_blocks * bytes_per_block / (1 << 20)
    raise ValueError(
        f"max_model_len {max_model_len} does not fit the KV pool: {num_blocks} blocks of "
        f"{block_size} tokens hold {capacity} tokens; one request of {max_model_len} tokens "
        f"needs {need_blocks} blocks (~{need_mib:.0f} MiB). Raise --kv-cache-memory-mb, "
        "--num-gpu-blocks or --gpu-memory-utilization, or lower --max-model-len"
    )
