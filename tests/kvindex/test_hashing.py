"""Block keys are the fleet-wide contract: same inputs, same keys, in every process."""

from __future__ import annotations

import hashlib
import json
import os
import random
import struct
import subprocess
import sys

import pytest

from pagefleet.kvindex.hashing import block_hashes, chain_hash, root_hash

CASES: list[dict[str, object]] = [
    {"namespace": "", "extra": None, "block_size": 16, "n": 100, "seed": 0},
    {"namespace": "llama-3-8b", "extra": None, "block_size": 16, "n": 77, "seed": 1},
    {"namespace": "llama-3-8b", "extra": "lora-sql", "block_size": 16, "n": 77, "seed": 1},
    {"namespace": "qwen/ünïcode ns", "extra": "ådapter", "block_size": 32, "n": 200, "seed": 2},
    {"namespace": "tiny", "extra": None, "block_size": 1, "n": 9, "seed": 3},
    {"namespace": "tiny", "extra": "", "block_size": 7, "n": 50, "seed": 4},
]

CHILD = """
import json, random, sys
from pagefleet.kvindex.hashing import block_hashes
out = []
for case in json.loads(sys.stdin.read()):
    rng = random.Random(case["seed"])
    tokens = [rng.randrange(0, 2**32) for _ in range(case["n"])]
    out.append(block_hashes(tokens, case["block_size"], case["namespace"], case["extra"]))
print(json.dumps(out))
"""


def local(case: dict[str, object]) -> list[int]:
    rng = random.Random(case["seed"])  # type: ignore[arg-type]
    tokens = [rng.randrange(0, 2**32) for _ in range(case["n"])]  # type: ignore[call-overload]
    return block_hashes(tokens, case["block_size"], case["namespace"], case["extra"])  # type: ignore[arg-type]


@pytest.mark.parametrize("hashseed", ["0", "12345"])
def test_keys_equal_across_processes(hashseed: str) -> None:
    # A different PYTHONHASHSEED in the child proves the keys never depend on hash().
    env = {**os.environ, "PYTHONHASHSEED": hashseed}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD],
        input=json.dumps(CASES),
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    theirs = json.loads(proc.stdout)
    ours = [local(c) for c in CASES]
    assert theirs == ours
    for case, keys in zip(CASES, ours, strict=True):
        assert len(keys) == int(case["n"]) // int(case["block_size"])  # type: ignore[call-overload]
        assert all(0 <= k < 2**64 for k in keys)
    # Namespace and extra both change every key.
    assert set(ours[1]).isdisjoint(ours[2])
    assert set(ours[0]).isdisjoint(ours[1])


def test_keys_follow_the_written_spec() -> None:
    """Recompute h_0 and h_1 from the spec in hashing.py's docstring, independently."""
    ns, toks = "spec-check", list(range(1000, 1016))
    h0 = int.from_bytes(
        hashlib.blake2b(b"pagefleet/ns\x00" + ns.encode(), digest_size=8).digest(), "little"
    )
    payload = h0.to_bytes(8, "little") + struct.pack("<16I", *toks) + b"\x00extra\x00" + b"A"
    h1 = int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")
    assert root_hash(ns) == h0
    assert block_hashes(toks, 16, ns, extra="A") == [h1]


def test_chain_extension_matches_full_computation() -> None:
    tokens = list(range(16 * 10 + 5))
    full = block_hashes(tokens, 16, "ns")
    tail = block_hashes(tokens, 16, "ns", parent=full[3], start_block=4)
    assert tail == full[4:]
    assert chain_hash(full[3], tokens[64:80]) == full[4]
    # Partial trailing block has no key; changing one token changes that key and all after.
    changed = list(tokens)
    changed[70] += 1
    other = block_hashes(changed, 16, "ns")
    assert other[:4] == full[:4]
    assert all(a != b for a, b in zip(other[4:], full[4:], strict=True))
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(tokens, 0)
