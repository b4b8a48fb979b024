"""The GPU KV pool budget: pure arithmetic, checked without a GPU."""

from __future__ import annotations

import pytest

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.kv_sizing import activation_reserve_bytes, gpu_kv_pool_bytes

GIB = 1 << 30


def test_pool_fills_the_share_left_after_weights_and_activations():
    # 80 GiB GPU, 16 GiB of weights loaded (64 free), 0.9 share, 2 GiB activations:
    # 72 GiB allowed - 16 used - 2 reserve = 54 GiB for KV.
    assert gpu_kv_pool_bytes(64 * GIB, 80 * GIB, 0.9, 2 * GIB) == 54 * GIB


def test_memory_held_by_another_process_counts_against_the_share():
    # The same GPU with a neighbour holding 30 GiB more: 24 GiB less for the pool.
    assert gpu_kv_pool_bytes(34 * GIB, 80 * GIB, 0.9, 2 * GIB) == 24 * GIB


def test_no_room_is_an_error_naming_the_fix():
    with pytest.raises(ValueError, match="raise the fraction"):
        gpu_kv_pool_bytes(8 * GIB, 80 * GIB, 0.5, GIB)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        gpu_kv_pool_bytes(8 * GIB, 80 * GIB, 1.5, GIB)


def test_activation_reserve_grows_with_batch_and_vocab():
    small = activation_reserve_bytes(2048, 64, 32_000)
    assert activation_reserve_bytes(4096, 64, 32_000) > small
    assert activation_reserve_bytes(2048, 256, 32_000) > small
    # Llama-3 vocab, default budgets: well under a GiB, well over the logits alone.
    big = activation_reserve_bytes(2048, 64, 128_256)
    assert 64 * 128_256 * 4 < big < GIB


def test_engine_config_checks_the_fraction():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=0.0)
    assert EngineConfig(gpu_memory_utilization=1.0).gpu_memory_utilization == 1.0


def test_the_fraction_on_a_cpu_engine_is_refused_before_sizing():
    from pagefleet.engine.parts import load_parts

    with pytest.raises(ValueError, match="CUDA only"):
        load_parts(EngineConfig(model="tiny", gpu_memory_utilization=0.9))


def test_the_daemon_flag_reaches_the_engine_config():
    from pagefleet.daemon.config import DaemonConfig

    config = DaemonConfig(device="cuda", gpu_memory_utilization=0.8).engine_config()
    assert config.device == "cuda" and config.gpu_memory_utilization == 0.8
