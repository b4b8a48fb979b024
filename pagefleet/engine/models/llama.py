"""One Llama-family decoder for Llama 2/3, Mistral, Qwen2/2.5 and Qwen3.

The batch is packed (no padding): ``input_ids[T]`` holds every scheduled sequence's new
tokens back to back, ``positions[T]`` their absolute positions, and attention goes through
an ``AttentionBackend`` that writes K/V into the paged cache and reads each sequence's
context from its block table. The variants differ only in flags on ``ModelConfig``: qkv bias
(Qwen2), per-head q/k RMSNorm (Qwen3), tied embeddings, explicit ``head_dim`` and RoPE
scaling. q/k/v and gate/up are fused into one matmul each; ``load_weights`` maps the
checkpoint's separate tensors into the fused parameters.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagefleet.engine.model_config import ModelConfig
from pagefleet.kernels.metadata import AttentionBackend, AttentionMetadata
from pagefleet.kernels.torch_ref import rms_norm


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back before the weight, as HF Llama does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)[0]


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are slowed by `factor`, short ones kept, and the
    # band in between interpolated smoothly.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def _yarn_inv_freq(
    scaling: dict, head_dim: int, base: float, max_pos: int
) -> tuple[torch.Tensor, float]:
    """YaRN's frequencies and the factor on cos/sin, computed with transformers' operations
    in its order (``1 / (factor * base**(i/d))`` is not ``inv_freq / factor`` to the bit)."""
    factor = float(scaling["factor"])
    old_ctx = int(scaling.get("original_max_position_embeddings") or max_pos)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        # DeepSeek-style configs give mscale / mscale_all_dim; the paper's default otherwise.
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, float(mscale)) / _yarn_mscale(
                factor, float(mscale_all_dim)
            )
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(n_rot: float) -> float:
        return (head_dim * math.log(old_ctx / (n_rot * 2 * math.pi))) / (2 * math.log(base))

    low = correction_dim(beta_fast)
    high = correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = (torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)
    extrapolation = 1 - ramp.clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    interpolated = 1.0 / (factor * pos_freqs)
    inv_freq = interpolated * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _rope_tables(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin ``[rope_positions, head_dim]`` with the config's scaling."""
    d = config.head_dim
    base = config.rope_theta
    with torch.device("cpu"):
        inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        attention_scaling = 1.0
        scaling = config.rope_scaling or {}
        rope_type = scaling.get("rope_type", "default")
        if rope_type == "linear":
            inv_freq = inv_freq / float(scaling["factor"])
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "yarn":
            inv_freq, attention_scaling = _yarn_inv_freq(
                scaling, d, base, config.max_position_embeddings
            )
        t = torch.arange(config.rope_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * attention_scaling, emb.sin() * attention_scaling


RopeTables = tuple[torch.Tensor, torch.Tensor]


class RotaryEmbedding(nn.Module):
    """RoPE (rotate-half / NeoX layout) with cos/sin precomputed for every position."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        cos, sin = _rope_tables(config)
        # Not parameters: rebuilt from the config, never loaded from the checkpoint.
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def reset_cache(self, device: torch.device) -> None:
        """Recompute the fp32 tables on ``device`` (after meta construction or a cast)."""
        cos, sin = _rope_tables(self.config)
        self.cos_cache = cos.to(device)
        self.sin_cache = sin.to(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """cos/sin rows ``[T, 1, D]`` for the tokens' positions, gathered once per forward
        and shared by every layer."""
        cos = self.cos_cache[positions].unsqueeze(1).to(dtype)
        sin = self.sin_cache[positions].unsqueeze(1).to(dtype)
        return cos, sin


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        # Qwen2 biases q/k/v only; Llama and Qwen3 put attention_bias on o_proj too.
        o_bias = config.attention_bias and config.architecture != "Qwen2ForCausalLM"
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        if config.qk_norm:
            self.q_norm: RMSNorm | None = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm: RMSNorm | None = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = None
            self.k_norm = None

    def forward(
        self,
        hidden: torch.Tensor,
        rope: RopeTables,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        t = hidden.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj.forward(hidden)  # .forward: no module-call overhead per step
        if self.q_norm is None or self.k_norm is None:
            # RoPE, K/V store and attention straight from the fused projection's rows (the
            # CPU backend rotates and stores in one C pass).
            out = backend.qkv_attention(qkv, (hq, hkv, d), *rope, *kv_cache, meta, self.scale)
            return self.o_proj.forward(out.reshape(t, self.q_size))
        q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        qk = torch.cat([self.q_norm(q.view(t, hq, d)), self.k_norm(k.view(t, hkv, d))], 1)
        # q and k heads rotate together, through the backend (the CPU one does it in place
        # in one C call; every backend matches torch_ref.rotate_half bit for bit).
        qk = backend.rotate_half(qk, *rope)
        q, k = qk.split([hq, hkv], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(t, hkv, d)
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj.forward(out.reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        bias = bool(config.raw.get("mlp_bias", False))
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        return self.down_proj.forward(backend.silu_mul(self.gate_up_proj.forward(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeTables,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual)``: the layer's output is their sum, which the next
        norm adds (fused with it; ``residual`` None: ``hidden`` is the embedding). The adds
        keep HF's operand order so fp32 results agree to rounding."""
        norm = self.input_layernorm
        x, residual = backend.rms_norm(hidden, norm.weight, norm.eps, residual)
        hidden = self.self_attn.forward(x, rope, kv_cache, meta, backend)
        norm = self.post_attention_layernorm
        x, residual = backend.rms_norm(hidden, norm.weight, norm.eps, residual)
        return self.mlp.forward(x, backend), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


# checkpoint suffix -> (our fused parameter suffix, shard index)
_STACKED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    """The causal LM: ``forward`` gives last-layer hidden states, ``compute_logits`` logits."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of the packed tokens; stores their K/V in the cache."""
        # The embedding's output is a fresh tensor: the backend may add into it in place.
        hidden = self.model.embed_tokens(input_ids)
        rope = self.model.rotary_emb(positions, hidden.dtype)
        residual: torch.Tensor | None = None
        # Submodules' forward is called directly: nn.Module.__call__ (hook dispatch, ~3 us
        # each) ran ~30 times a step here, and no hook is ever registered on them.
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden, residual = layer.forward(hidden, residual, rope, kv_cache, meta, backend)
        norm = self.model.norm
        return backend.rms_norm(hidden, norm.weight, norm.eps, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]`` for the rows of ``hidden`` (select rows first)."""
        if self.lm_head is None:
            return F.linear(hidden, self.model.embed_tokens.weight).float()
        return self.lm_head.forward(hidden).float()  # PackedLinear if large (cpu_layout.py)

    def _shard_slices(self, fused: str, shard: int) -> tuple[int, int]:
        c = self.config
        if fused.endswith("qkv_proj"):
            offsets = [0, c.q_size, c.q_size + c.kv_size, c.q_size + 2 * c.kv_size]
        else:
            offsets = [0, c.intermediate_size, 2 * c.intermediate_size]
        return offsets[shard], offsets[shard + 1]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names) into our parameters; fused ones by slice.

        Returns the set of our parameter slices filled (``name`` or ``name#shard``) so the
        loader can report what the checkpoint lacked. Raises ValueError on a shape mismatch.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding serves as the head
            target, shard = name, None
            for ckpt, (ours, idx) in _STACKED.items():
                if f".{ckpt}." in name:
                    target, shard = name.replace(ckpt, ours), idx
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {self.config.architecture} "
                    "with this config.json: is the config from a different model?"
                )
            if shard is None:
                dst = param.data
            else:
                lo, hi = self._shard_slices(target.rsplit(".", 1)[0], shard)
                dst = param.data[lo:hi]
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"shape mismatch for {name!r}: checkpoint has {tuple(tensor.shape)}, "
                    f"config.json implies {tuple(dst.shape)}; the config and weights disagree"
                )
            dst.copy_(tensor)
            loaded.add(target if shard is None else f"{target}#{shard}")
        return loaded

    def expected_weights(self) -> set[str]:
        """Every parameter slice ``load_weights`` must fill for a complete model."""
        out: set[str] = set()
        for name, _ in self.named_parameters():
            if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
                out.update(f"{name}#{i}" for i in range(3))
            elif name.endswith("gate_up_proj.weight") or name.endswith("gate_up_proj.bias"):
                out.update(f"{name}#{i}" for i in range(2))
            else:
                out.add(name)
        return out
