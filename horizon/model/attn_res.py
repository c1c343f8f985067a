"""Attention residuals (Kimi K3, `attn_res_block_size` > 0): the residual stream becomes a softmax mix over depth.

Instead of `h += sublayer(norm(h))`, each sublayer reads a learned, per-token mix of earlier states:

    input = sum_s softmax_s( <v_s / rms(v_s), w> ) * v_s,      w = norm.weight * proj.weight   (fp32)

over the sources v_s: the *bank* (one state per finished block of `attn_res_block_size` layers, bank[0]
the embedding) and the current *partial sum* (the sublayer outputs added since the block began). The
logits use the normalised source, the mix the raw one. At a block's first layer the layer input is
banked and the partial sum restarts from that layer's attention output; a layer returns partial + mlp.
After the last layer a final mix (`output_res`) feeds the model's norm and LM head.

The mix is per token (over depth, not over positions), so decoding needs no cache for it: a step's
bank is rebuilt from that step's own tokens. K3: 93 layers in blocks of 12, so 8 banked sources plus
the partial sum. `attn_res_mix` is the plain PyTorch definition (the reference and the path used).
"""

from __future__ import annotations

import torch
from torch import nn

from horizon.model.layers import RMSNorm


def attn_res_mix(bank: list[torch.Tensor], partial: torch.Tensor, norm_weight: torch.Tensor,
                 proj_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The mix of bank [S x [N, d]] and partial [N, d] (partial itself when the bank is empty), in fp32,
    rounded to partial's dtype once. norm_weight, proj_weight [d]: the two vectors whose product scores
    each source."""
    if not bank:
        return partial
    w = norm_weight.float() * proj_weight.float()
    # source by source, not over one stacked [S + 1, N, d] tensor: compiled with the decode runner's inductor
    # options (decompose_mm_pass with a raised size limit) the stacked form gave wrong logits (0.2-0.4 off at
    # batch 1 on tiny's six layers, torch 2.13); this form compiles right and is the same arithmetic
    sources = [v.float() for v in (*bank, partial)]
    logits = torch.stack([(v * w).sum(-1) * torch.rsqrt(v.pow(2).mean(-1) + eps) for v in sources])  # [S + 1, N]
    p = torch.softmax(logits, dim=0)
    out = p[0, :, None] * sources[0]
    for i in range(1, len(sources)):
        out = out + p[i, :, None] * sources[i]
    return out.to(partial.dtype)


class DepthMix(nn.Module):
    """One learned mix over depth (a sublayer's input, or the model's output): `norm.weight` and
    `proj.weight` [1, d] are the released tensors `*_res_norm` and `*_res_proj`; only their product is used."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(dim, eps)
        self.proj = nn.Linear(dim, 1, bias=False)

    def forward(self, bank: list[torch.Tensor], partial: torch.Tensor) -> torch.Tensor:
        return attn_res_mix(bank, partial, self.norm.weight, self.proj.weight[0], self.norm.eps)
