"""The kernels compile for the H100/H200 (sm_90) on this GPU-less machine.

The interpreter does not enforce what the GPU compiler does (tile shapes, dot operand
types, shared memory), so the Llama-3-8B-shaped bf16 launches of every kernel are compiled
to cubins here, in a separate process because the interpreter flag is per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "pagefleet.dev.compile_check", "--arch", "90"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    # store, copy, decode (1 split and n splits), merge, prefill
    assert summary == {"arch": 90, "dtype": "bfloat16", "compiled": 6}
    assert "_prefill_kernel" in proc.stderr and "_decode_merge_kernel" in proc.stderr
