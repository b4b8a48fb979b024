"""Compile the Triton kernels for a GPU architecture on a machine without a GPU.

The interpreter checks numerics but not what only the GPU compiler checks (tile shapes,
``tl.dot`` operand types, shared-memory budget, register pressure). This module drives
the real launchers with ``meta`` tensors, records each launch's arguments instead of
running it, and compiles every recorded launch to a cubin with ``triton.compile`` for an
explicit target (default sm_90, the H100/H200), so a kernel that cannot build for the GPU
fails here, on CPU. Needs TRITON_INTERPRET unset (run it as its own process):

    python -m pagefleet.dev.compile_check --arch 90
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

_PTR_TYPES = {
    torch.float32: "*fp32",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.int32: "*i32",
    torch.int64: "*i64",
}
_LAUNCH_OPTIONS = ("num_warps", "num_stages")


@dataclass(slots=True)
class Launch:
    kernel: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


class _Recorder:
    """Stands in for a ``@triton.jit`` function: ``kernel[grid](...)`` records the call."""

    def __init__(self, name: str, launches: list[Launch]) -> None:
        self.name = name
        self.launches = launches

    def __getitem__(self, grid: Any):
        def record(*args: Any, **kwargs: Any) -> None:
            self.launches.append(Launch(self.name, args, kwargs))

        return record


def _record(cases: list[dict[str, Any]]) -> list[Launch]:
    """Run the launchers on meta tensors with the kernels swapped for recorders."""
    from pagefleet.kernels import triton_attention as ta

    names = [
        "_store_kv_kernel",
        "_copy_blocks_kernel",
        "_decode_split_kernel",
        "_decode_merge_kernel",
        "_prefill_kernel",
    ]
    launches: list[Launch] = []
    saved = {n: getattr(ta, n) for n in names}
    saved_compute = ta._compute_dtype
    try:
        for n in names:
            setattr(ta, n, _Recorder(n, launches))
        # Meta tensors stand for CUDA ones: pick the dtype the GPU path would pick.
        ta._compute_dtype = lambda dtype, device: saved_compute(dtype, torch.device("cuda"))
        for case in cases:
            _launch_case(ta, **case)
    finally:
        for n, fn in saved.items():
            setattr(ta, n, fn)
        ta._compute_dtype = saved_compute
    return launches


def _launch_case(ta: Any, dtype: torch.dtype, hq: int, hkv: int, d: int, block_size: int) -> None:
    meta = torch.device("meta")
    t, nb, b = 64, 256, 4
    q = torch.empty((t, hq, d), dtype=dtype, device=meta)
    k = torch.empty((t, hkv, d), dtype=dtype, device=meta)
    cache = torch.empty((nb, block_size, hkv, d), dtype=dtype, device=meta)
    i32 = {"dtype": torch.int32, "device": meta}
    slots = torch.empty(t, dtype=torch.int64, device=meta)
    tables = torch.empty((b, 16), **i32)
    seq_lens = torch.empty(b, **i32)
    qsl = torch.empty(b + 1, **i32)
    pairs = torch.empty(3, dtype=torch.int64, device=meta)
    ta.store_kv(k, k, cache, cache, slots)
    ta.copy_blocks([cache], [cache], pairs, pairs)
    for splits in (1, 4):
        ta.paged_decode(
            q[:b], cache, cache, tables, seq_lens, 256, 0.1,
            config=ta.DecodeConfig(num_kv_splits=splits),
        )  # fmt: skip
    ta.paged_prefill(q, cache, cache, tables, seq_lens, qsl, 32, 0.1)


def _signature(fn: Any, launch: Launch) -> tuple[dict[str, str], dict[str, Any], dict[str, int]]:
    import triton.language as tl

    bound = dict(zip(fn.arg_names, launch.args, strict=False))
    constexprs = {k: v for k, v in launch.kwargs.items() if k not in _LAUNCH_OPTIONS}
    options = {k: v for k, v in launch.kwargs.items() if k in _LAUNCH_OPTIONS}
    signature: dict[str, str] = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        value = bound[name]
        if isinstance(value, torch.Tensor):
            signature[name] = _PTR_TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i64" if abs(value) >= 2**31 else "i32"
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif isinstance(value, tl.dtype):
            signature[name] = "constexpr"
            constexprs[name] = value
        else:
            raise TypeError(f"{launch.kernel}: cannot type argument {name}={value!r}")
    return signature, constexprs, options


def compile_for_gpu(cases: list[dict[str, Any]], arch: int = 90) -> list[dict[str, Any]]:
    """Compile every kernel launch the ``cases`` make, for ``sm_<arch>``; one row each.

    Raises RuntimeError when run in interpreter mode (nothing would be compiled).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter compiles nothing")
    from pagefleet.kernels import triton_attention as ta

    target = GPUTarget("cuda", arch, 32)
    rows = []
    seen: set[str] = set()
    for launch in _record(cases):
        fn = getattr(ta, launch.kernel)
        signature, constexprs, options = _signature(fn, launch)
        key = f"{launch.kernel}:{sorted(signature.items())}:{constexprs}:{options}"
        if key in seen:
            continue
        seen.add(key)
        t0 = time.perf_counter()
        compiled = triton.compile(ASTSource(fn, signature, constexprs), target, options)
        rows.append(
            {
                "kernel": launch.kernel,
                "constexprs": {k: str(v) for k, v in constexprs.items()},
                "shared_bytes": compiled.metadata.shared,
                "cubin_bytes": len(compiled.asm["cubin"]),
                "seconds": round(time.perf_counter() - t0, 2),
            }
        )
    return rows


LLAMA3_8B = {"hq": 32, "hkv": 8, "d": 128, "block_size": 16}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="SM version, e.g. 80, 90")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--all-shapes", action="store_true", help="also GQA 1/7/8, head dim 64")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    cases = [{"dtype": dtype, **LLAMA3_8B}]
    if args.all_shapes:
        cases += [
            {"dtype": dtype, "hq": 8, "hkv": 8, "d": 64, "block_size": 32},
            {"dtype": dtype, "hq": 28, "hkv": 4, "d": 128, "block_size": 16},
            {"dtype": dtype, "hq": 64, "hkv": 8, "d": 128, "block_size": 16},
        ]
    rows = compile_for_gpu(cases, args.arch)
    for row in rows:
        print(row, file=sys.stderr)
    print(json.dumps({"arch": args.arch, "dtype": args.dtype, "compiled": len(rows)}))


if __name__ == "__main__":
    main()
