"""The compiled CPU attention backend: one C++ call per layer attends every query row of
the step (decodes and prefill/extend chunks) over its sequence's blocks, read in place.

The torch backend calls SDPA once per decode row and gathers each non-consecutive context
first; this one reads the pool through the block table directly, with OpenMP over
(sequence, KV head, query tile) work items and online softmax over blocks
(``csrc/paged_attention_cpu.cpp``). K/V are stored with the torch backend's ``store_kv``.
A shape or dtype the kernel does not cover (fp16 caches, blocks over 64 tokens, head_dim
over 256, a non-CPU tensor) goes to the torch path for that call, so results never depend
on what the kernel covers, only their rounding.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from pagefleet.kernels import mkl_packed
from pagefleet.kernels.metadata import AttentionMetadata
from pagefleet.kernels.torch_ref import (
    TorchAttentionBackend,
    paged_attention,
    prefill_rows,
    rms_norm,
    rotate_half,
    silu_mul,
    store_kv,
)

LIBRARY = "paged_attention_cpu"
# RMSNorm (+ residual add) and SiLU x up, fused (csrc/layer_ops_cpu.cpp).
LAYER_OPS_LIBRARY = "layer_ops_cpu"
# Chunks longer than this go to torch's SDPA (gathered context, one call per sequence).
# Chunks of more than 8 rows take the kernel's chunk path: MKL's GEMM per tile where torch
# has MKL (session 11), else loops that score each key against 16 query vectors in one
# vector multiply-add (the session-5 kernel, one dot product per vector and key, was 1.6x
# slower than SDPA at 64 rows; see docs/benchmarks.md, session 6).
MAX_KERNEL_QUERY_LEN = 1024
_KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_c_ptr, _c_int, _c_i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the C signatures of ``lib`` (ctypes then converts ints/floats correctly)."""
    fn = lib.pf_paged_attention
    fn.restype = _c_int
    fn.argtypes = [
        _c_ptr, _c_i64, _c_ptr, _c_ptr, _c_int, _c_ptr, _c_int, _c_ptr, _c_ptr, _c_int,
        _c_ptr, _c_i64, _c_int, _c_int, _c_int, _c_int, ctypes.c_float, _c_int, _c_int,
    ]  # fmt: skip
    lib.pf_rope_neox.restype = None
    lib.pf_rope_neox.argtypes = [_c_ptr, _c_i64, _c_i64, _c_int, _c_int, _c_ptr, _c_ptr]
    lib.pf_store_kv.restype = None
    lib.pf_store_kv.argtypes = [
        _c_ptr, _c_i64, _c_ptr, _c_i64, _c_ptr, _c_i64, _c_i64, _c_int, _c_ptr, _c_ptr,
    ]  # fmt: skip
    lib.pf_rope_store.restype = None
    lib.pf_rope_store.argtypes = [
        _c_ptr, _c_i64, _c_i64, _c_int, _c_int, _c_int, _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_ptr,
    ]  # fmt: skip
    lib.pf_set_blas.restype = None
    lib.pf_set_blas.argtypes = [_c_ptr, _c_ptr]
    lib.pf_scratch_bytes.restype = _c_i64
    lib.pf_scratch_bytes.argtypes = []
    for name in ("pf_max_block_size", "pf_max_group", "pf_max_head_dim"):
        getattr(lib, name).restype = _c_int
        getattr(lib, name).argtypes = []
    return lib


def bind_layer_ops(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the C signatures of the layer-ops library ``lib``."""
    lib.pf_rms_norm.restype = None
    lib.pf_rms_norm.argtypes = [
        _c_ptr, _c_i64, _c_ptr, _c_i64, _c_ptr, _c_ptr, _c_i64, _c_i64, _c_int,
        ctypes.c_float, _c_int,
    ]  # fmt: skip
    lib.pf_silu_mul.restype = None
    lib.pf_silu_mul.argtypes = [_c_ptr, _c_i64, _c_ptr, _c_i64, _c_i64, _c_int, _c_int]
    return lib


def _fp32_rows(x: torch.Tensor) -> bool:
    """A 2-D fp32 CPU tensor whose rows are contiguous (what the layer ops take)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1


@dataclass(slots=True, frozen=True)
class _StepArgs:
    """The step's metadata as int32 contiguous CPU tensors (kept alive for their pointers)."""

    tables: torch.Tensor
    qsl: torch.Tensor
    seq_lens: torch.Tensor
    long_seqs: tuple[int, ...]  # sequences whose chunk is left to torch's SDPA


def _step_args(meta: AttentionMetadata) -> _StepArgs:
    args = meta.scratch.get("cpu_attention_args")
    if args is None:
        args = _StepArgs(
            tables=meta.block_tables.to(torch.int32).contiguous(),
            qsl=meta.query_start_loc.to(torch.int32).contiguous(),
            seq_lens=meta.seq_lens.to(torch.int32).contiguous(),
            long_seqs=tuple(
                i for i, n in enumerate(meta.query_lens_cpu) if n > MAX_KERNEL_QUERY_LEN
            ),
        )
        meta.scratch["cpu_attention_args"] = args
    return args  # type: ignore[return-value]


class CpuAttentionBackend(TorchAttentionBackend):
    """Paged attention through the compiled kernel in ``lib`` (``cpu_build.load_library``);
    ``forward`` and ``copy_blocks`` are the torch backend's."""

    name = "cpu"

    def __init__(self, lib: ctypes.CDLL, layer_ops: ctypes.CDLL | None = None) -> None:
        self._lib = bind(lib)
        # None: RMSNorm and SiLU x up stay torch ops (the inherited methods).
        self._ops = None if layer_ops is None else bind_layer_ops(layer_ops)
        # Long prefill/extend chunks through MKL's GEMM (about 3x the kernel's own loops on
        # the bench model's prompts: docs/benchmarks.md, engine speed, session 11); without
        # MKL the kernel keeps its vector loops.
        blas = mkl_packed.blas_addresses()
        self._lib.pf_set_blas(*(blas or (None, None)))
        self._max_block = lib.pf_max_block_size()
        self._max_group = lib.pf_max_group()
        self._max_head_dim = lib.pf_max_head_dim()

    def covers(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """Whether the kernel handles these tensors (else the torch path runs)."""
        _, bs, hkv, d = k_cache.shape
        return (
            k_cache.device.type == "cpu"
            and q.device.type == "cpu"
            and k_cache.dtype in _KV_DTYPES
            and q.dtype in (torch.float32, torch.bfloat16)
            and k_cache.is_contiguous()
            and bs <= self._max_block
            and d <= self._max_head_dim
            and q.shape[1] % hkv == 0
            and q.shape[1] // hkv <= self._max_group
        )

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention of every packed row of q over the cached context (K/V already stored)."""
        if not self.covers(q, k_cache) or v_cache.dtype != k_cache.dtype:
            return paged_attention(q, k_cache, v_cache, meta, scale)
        _, bs, hkv, d = k_cache.shape
        t, hq = q.shape[0], q.shape[1]
        qf = q if q.dtype == torch.float32 else q.float()
        if qf.stride(2) != 1 or qf.stride(1) != d:
            qf = qf.contiguous()
        out = torch.empty((t, hq, d), dtype=torch.float32)
        if t == 0:
            return out.to(q.dtype)
        args = _step_args(meta)
        # Held in a local for the call: a temporary's storage (a non-contiguous pool's copy)
        # is freed as soon as data_ptr() returns, and the kernel would read freed memory.
        vc = v_cache.contiguous()
        rc = self._lib.pf_paged_attention(
            qf.data_ptr(),
            qf.stride(0),
            k_cache.data_ptr(),
            vc.data_ptr(),
            _KV_DTYPES[k_cache.dtype],
            args.tables.data_ptr(),
            args.tables.shape[1],
            args.qsl.data_ptr(),
            args.seq_lens.data_ptr(),
            meta.num_seqs,
            out.data_ptr(),
            out.stride(0),
            hq,
            hkv,
            bs,
            d,
            scale,
            MAX_KERNEL_QUERY_LEN,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(
                f"pf_paged_attention rejected its arguments (code {rc}) after covers() "
                "accepted them: a bug in pagefleet/kernels/cpu_attention.py"
            )
        if args.long_seqs:
            prefill_rows(q, k_cache, v_cache, meta, scale, out, args.long_seqs)
        return out if q.dtype == torch.float32 else out.to(q.dtype)

    def rotate_half(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE in place for fp32 CPU heads (bit-identical to ``torch_ref.rotate_half``: no
        fused multiply-add), else the torch ops. Replaces ~6 elementwise torch calls a layer."""
        t, h, d = x.shape
        if not (
            x.device.type == "cpu"
            and x.dtype == torch.float32 == cos.dtype == sin.dtype
            and x.stride(2) == 1
            and x.stride(1) == d
            and d % 2 == 0
            and cos.shape == sin.shape == (t, 1, d)
            and cos.is_contiguous()
            and sin.is_contiguous()
        ):
            return rotate_half(x, cos, sin)
        if t:
            self._lib.pf_rope_neox(
                x.data_ptr(), x.stride(0), t, h, d, cos.data_ptr(), sin.data_ptr()
            )
        return x

    def qkv_attention(
        self,
        qkv: torch.Tensor,
        heads: tuple[int, int, int],
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """RoPE and K/V store in one C pass over the fp32 rows (``pf_rope_store``: the same
        arithmetic as ``rotate_half`` + ``store``, bit for bit), then ``attend`` on q as a
        view of ``qkv``. Other dtypes and layouts take the inherited three calls."""
        t, width = qkv.shape
        hq, hkv, d = heads
        slots = meta.slot_mapping
        if not (
            qkv.device.type == "cpu"
            and qkv.dtype == torch.float32 == k_cache.dtype == v_cache.dtype == cos.dtype
            and sin.dtype == torch.float32
            and qkv.stride(1) == 1
            and width == (hq + 2 * hkv) * d
            and d % 2 == 0
            and cos.shape == sin.shape == (t, 1, d)
            and cos.is_contiguous()
            and sin.is_contiguous()
            and k_cache.device.type == "cpu"
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
            and k_cache.shape[2:] == v_cache.shape[2:] == (hkv, d)
            and slots.dtype == torch.int64
            and slots.device.type == "cpu"
            and slots.is_contiguous()
        ):
            return super().qkv_attention(qkv, heads, cos, sin, k_cache, v_cache, meta, scale)
        if t:
            self._lib.pf_rope_store(
                qkv.data_ptr(),
                qkv.stride(0),
                t,
                hq,
                hkv,
                d,
                cos.data_ptr(),
                sin.data_ptr(),
                slots.data_ptr(),
                k_cache.data_ptr(),
                v_cache.data_ptr(),
            )
        return self.attend(qkv[:, : hq * d].view(t, hq, d), k_cache, v_cache, meta, scale)

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``torch_ref.rms_norm`` as one C call for fp32 CPU rows (within an fp32 ulp: the
        sum of squares is accumulated in another order); the sum ``residual + x`` is
        written into ``residual`` in place. Replaces ~7 torch ops (and their temporaries)."""
        t = x.shape[0]
        if not (
            self._ops is not None
            and _fp32_rows(x)
            and weight.dtype == torch.float32
            and weight.device.type == "cpu"
            and weight.is_contiguous()
            and weight.shape == (x.shape[1],)
            and (residual is None or (_fp32_rows(residual) and residual.shape == x.shape))
        ):
            return rms_norm(x, weight, eps, residual)
        out = torch.empty(x.shape, dtype=torch.float32)
        if t:
            self._ops.pf_rms_norm(
                x.data_ptr(),
                x.stride(0),
                None if residual is None else residual.data_ptr(),
                0 if residual is None else residual.stride(0),
                weight.data_ptr(),
                out.data_ptr(),
                out.stride(0),
                t,
                x.shape[1],
                eps,
                torch.get_num_threads(),
            )
        return out, (x if residual is None else residual)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``torch_ref.silu_mul`` as one C call for fp32 CPU rows (a polynomial exp: within
        ~2e-7 relative of torch's); replaces 2 torch ops and a temporary."""
        if self._ops is None or not _fp32_rows(gate_up) or gate_up.shape[1] % 2:
            return silu_mul(gate_up)
        t, width = gate_up.shape
        out = torch.empty((t, width // 2), dtype=torch.float32)
        if t:
            self._ops.pf_silu_mul(
                gate_up.data_ptr(),
                gate_up.stride(0),
                out.data_ptr(),
                out.stride(0),
                t,
                width // 2,
                torch.get_num_threads(),
            )
        return out

    def store(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """``torch_ref.store_kv`` as one C call when the rows already have the pool's dtype."""
        t, hkv, d = k.shape
        if not (
            k_cache.device.type == "cpu"
            and k.dtype == v.dtype == k_cache.dtype == v_cache.dtype
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
            and k.stride(2) == v.stride(2) == 1
            and k.stride(1) == v.stride(1) == d
            and tuple(k_cache.shape[2:]) == (hkv, d)
            and slot_mapping.dtype == torch.int64
            and slot_mapping.is_contiguous()
            and slot_mapping.device.type == "cpu"
        ):
            store_kv(k, v, k_cache, v_cache, slot_mapping)
            return
        self._lib.pf_store_kv(
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            slot_mapping.data_ptr(),
            t,
            hkv * d,
            k.element_size(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
        )
