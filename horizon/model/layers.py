"""Small building blocks shared by the layers: RMSNorm, the GLU activations (SwiGLU, SiTU) and the MLP,
rotary embedding, L2 norm."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back before the weight (the Llama / DeepSeek order)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * weight * sigmoid(gate), entirely in fp32 (KDA's output norm)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (x * weight.float() * torch.sigmoid(gate.float())).to(dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps): eps inside the root, as flash-linear-attention computes it."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """Kimi K3's SiTU-GLU: beta tanh(g / beta) sigmoid(g) * linear_beta tanh(u / linear_beta), in fp32.

    A SiLU whose gate saturates at +-beta and whose linear branch saturates at +-linear_beta, so no
    activation grows without bound (K3: beta 4, linear_beta 25); rounded to the inputs' dtype once."""
    g, u = gate.float(), up.float()
    return (beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))).to(gate.dtype)


@dataclass(frozen=True)
class GLU:
    """The activation joining a GLU's gate and up halves: "silu" (SwiGLU: silu(g) * u, in the inputs'
    dtype) or "situ" (`situ`). One value per model (ModelConfig.hidden_act), held by every MLP and expert set."""

    kind: str = "silu"
    beta: float = 4.0
    linear_beta: float = 25.0

    @classmethod
    def of(cls, cfg) -> GLU:
        return cls(cfg.hidden_act, float(cfg.situ_beta), float(cfg.situ_linear_beta))

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "silu":
            return F.silu(gate) * up
        return situ(gate, up, self.beta, self.linear_beta)


SWIGLU = GLU()


class MLP(nn.Module):
    """GLU feed-forward: down(act(gate(x), up(x))), act SwiGLU's silu(g) * u or K3's SiTU (`GLU`)."""

    def __init__(self, dim: int, hidden: int, act: GLU = SWIGLU):
        super().__init__()
        self.act = act
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature factor 0.1 * mscale * ln(scale) + 1 (1 when not extending)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(d: int, theta: float, scaling: dict | None = None,
                     device=None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [d/2] (fp32) and the factor on cos/sin, for plain RoPE or YaRN.

    YaRN (`scaling`, see ModelConfig.rope_scaling) as transformers computes it: dimensions that turn
    fewer than beta_slow times over the original context are interpolated (frequency / factor),
    those turning more than beta_fast times are kept, with a linear ramp between.
    """
    exponents = torch.arange(0, d, 2, device=device, dtype=torch.float32) / d
    if scaling is None:
        return theta ** (-exponents), 1.0
    pos_freqs = theta**exponents
    factor, orig = scaling["factor"], scaling["original_max_position_embeddings"]
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all
                            else yarn_mscale(factor))
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(d // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate (frequency / factor)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attention_factor)


def rope_softmax_factor(scaling: dict | None) -> float:
    """What YaRN multiplies the attention softmax scale by: mscale(factor, mscale_all_dim)^2 (else 1)."""
    if scaling is None or not scaling.get("mscale_all_dim"):
        return 1.0
    return yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float, interleaved: bool,
               scaling: dict | None = None) -> torch.Tensor:
    """Rotate the last dim of x ([N, ..., d], d even) by absolute positions [N].

    interleaved: pairs (x0, x1), (x2, x3), ... rotate together (DeepSeek's MLA slice);
    otherwise half-split: pairs (x_i, x_{i+d/2}) (DeepSeek-V3.2's indexer).
    scaling: YaRN parameters (ModelConfig.rope_scaling), or None for plain RoPE.
    """
    d = x.shape[-1]
    inv_freq, factor = rope_frequencies(d, theta, scaling, device=x.device)
    angles = positions.float()[:, None] * inv_freq[None, :]  # [N, d/2]
    shape = (angles.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
    cos, sin = angles.cos().view(shape), angles.sin().view(shape)
    if factor != 1.0:  # YaRN's attention factor scales cos and sin (the rotated slice)
        cos, sin = cos * factor, sin * factor
    xf = x.float()
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    else:
        a, b = xf[..., : d // 2], xf[..., d // 2 :]
        out = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return out.to(x.dtype)
