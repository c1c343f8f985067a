"""The vision encoder: images become runs of embeddings in the language model's hidden size.

A ViT over the image's patches, then a projector into the LM:

    pixels [3, rows*u, cols*u]  (u = patch * merge; the image scaled to fit `vision_max_tokens`)
      -> patches [gh*gw, 3*p*p] -> Linear -> + row and column position embeddings   (gh = rows*merge)
      -> vision_layers x (LayerNorm -> bidirectional MHA -> + ; LayerNorm -> GELU MLP -> +) -> LayerNorm
      -> merge each merge x merge group of patches into one token [rows*cols, merge^2 * D_v]
      -> projector LayerNorm -> Linear -> GELU -> Linear -> [rows*cols, hidden]

The token count is set by the image's size (about one token per `u` x `u` pixels, aspect ratio
kept) and bounded by `vision_max_tokens`: a larger image is scaled down. `image_grid` gives
(rows, cols) from the pixel size alone, so the chat template can lay out the placeholders before
anything is encoded, and the engine knows how many embeddings each image yields.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from horizon.config import ModelConfig


def image_grid(cfg: ModelConfig, height: int, width: int) -> tuple[int, int]:
    """(rows, cols) of image tokens for an image of this many pixels: one token per u x u pixels
    (u = patch * merge, aspect ratio kept), scaled down to at most vision_max_tokens."""
    if height < 1 or width < 1:
        raise ValueError(f"an image needs at least one pixel each way, got {width}x{height}")
    unit = cfg.vision_patch_size * cfg.vision_merge
    rows, cols = max(1, round(height / unit)), max(1, round(width / unit))
    limit = cfg.vision_max_tokens
    if rows * cols > limit:
        scale = math.sqrt(limit / (rows * cols))
        rows, cols = max(1, math.floor(rows * scale)), max(1, math.floor(cols * scale))
        while rows * cols > limit:  # a 1-wide image can still be too long after flooring
            if rows >= cols:
                rows -= 1
            else:
                cols -= 1
    return rows, cols


def num_image_tokens(cfg: ModelConfig, height: int, width: int) -> int:
    rows, cols = image_grid(cfg, height, width)
    return rows * cols


def preprocess(cfg: ModelConfig, image: torch.Tensor) -> torch.Tensor:
    """RGB uint8 [H, W, 3] -> float [3, rows*u, cols*u] in [-1, 1], resized (bilinear, antialiased)."""
    if image.dim() != 3 or image.shape[-1] != 3 or image.dtype != torch.uint8:
        raise ValueError(f"an image must be an RGB uint8 tensor [H, W, 3], got {image.dtype} {tuple(image.shape)}")
    rows, cols = image_grid(cfg, image.shape[0], image.shape[1])
    unit = cfg.vision_patch_size * cfg.vision_merge
    x = image.permute(2, 0, 1)[None].float() / 255.0
    size = (rows * unit, cols * unit)
    if tuple(x.shape[-2:]) != size:
        x = F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False).clamp_(0, 1)
    return (x[0] - 0.5) / 0.5


class VisionBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        D = cfg.vision_hidden_size
        self.num_heads = cfg.vision_num_heads
        self.norm1 = nn.LayerNorm(D, eps=1e-6)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.norm2 = nn.LayerNorm(D, eps=1e-6)
        self.fc1 = nn.Linear(D, cfg.vision_intermediate_size)
        self.fc2 = nn.Linear(cfg.vision_intermediate_size, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, D] (one image's patches) -> [n, D]; every patch sees every other (no mask)."""
        n, D = x.shape
        H = self.num_heads
        q, k, v = self.qkv(self.norm1(x)).view(n, 3, H, D // H).permute(1, 2, 0, 3)  # 3 x [H, n, D/H]
        a = F.scaled_dot_product_attention(q, k, v)  # [H, n, D/H]
        x = x + self.proj(a.transpose(0, 1).reshape(n, D))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


class VisionEncoder(nn.Module):
    """Pixels of one image -> [rows*cols, hidden] embeddings for its placeholder tokens."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        D, p, m = cfg.vision_hidden_size, cfg.vision_patch_size, cfg.vision_merge
        self.patch_embed = nn.Linear(3 * p * p, D)
        max_side = cfg.vision_max_tokens * m  # patches along the long side of the most elongated image
        self.row_embed = nn.Embedding(max_side, D)
        self.col_embed = nn.Embedding(max_side, D)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.vision_layers))
        self.norm = nn.LayerNorm(D, eps=1e-6)
        self.merge_norm = nn.LayerNorm(D * m * m, eps=1e-6)
        self.proj1 = nn.Linear(D * m * m, cfg.hidden_size)
        self.proj2 = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [3, rows*u, cols*u] (from `preprocess`) -> [rows*cols, hidden], tokens in row-major order."""
        p, m = self.cfg.vision_patch_size, self.cfg.vision_merge
        _, Hp, Wp = pixels.shape
        gh, gw = Hp // p, Wp // p
        dtype = self.patch_embed.weight.dtype
        # [3, gh, p, gw, p] -> [gh, gw, 3*p*p]: one flattened patch per grid cell
        patches = pixels.view(3, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(gh, gw, 3 * p * p)
        x = self.patch_embed(patches.to(dtype))
        rows = torch.arange(gh, device=pixels.device)
        cols = torch.arange(gw, device=pixels.device)
        x = (x + self.row_embed(rows)[:, None] + self.col_embed(cols)[None, :]).reshape(gh * gw, -1)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        # each m x m group of neighbouring patches -> one token: [gh/m, m, gw/m, m, D] -> [rows*cols, m*m*D]
        D = x.shape[-1]
        x = x.view(gh // m, m, gw // m, m, D).permute(0, 2, 1, 3, 4).reshape((gh // m) * (gw // m), m * m * D)
        return self.proj2(F.gelu(self.proj1(self.merge_norm(x))))

    def encode(self, image: torch.Tensor) -> torch.Tensor:
        """RGB uint8 [H, W, 3] -> [tokens, hidden] (tokens = num_image_tokens(cfg, H, W))."""
        return self(preprocess(self.cfg, image).to(self.patch_embed.weight.device))
