"""HorizonForCausalLM: the decoder stack (docs/design.md §1).

    h = embed(tokens)
    for each block:  h += Attn(RMSNorm(h));  h += FFN(RMSNorm(h))
    logits = lm_head(RMSNorm(h))

Attn is KDA or Gated DSA by `config.layer_types`; FFN is a dense GLU MLP (SwiGLU, or Kimi K3's SiTU) for
the first `first_k_dense` blocks and an MoE after that. With attention residuals (Kimi K3,
`attn_res_block_size` > 0; horizon.model.attn_res) each sublayer's input is a learned mix over depth
of banked block states and the running partial sum instead of the plain residual h.

Two ways in:
- `model(input_ids [B, T], cache=None, lengths=None)`: a right-padded batch (`lengths[b]` real
  tokens in row b, default all T). With a cache, rows continue the sequences in cache slots 0..B-1
  from where they stopped, so prefill in chunks followed by decode one token at a time gives the
  logits of one full forward. Returns fp32 logits [B, T, V] (garbage at padded positions).
- `model.forward_batch(tokens [N], batch, cache)`: the varlen form the engine uses (horizon.model.batch).
Both take `options` (horizon.model.options.ForwardOptions; None: the defaults), the per-call attention
modes and probes, passed down to every mixer.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from horizon.config import ModelConfig
from horizon.model.attn_res import DepthMix
from horizon.model.batch import Batch
from horizon.model.cache import HorizonCache
from horizon.model.dsa import GatedDSA
from horizon.model.kda import KimiDeltaAttention
from horizon.model.layers import GLU, MLP, RMSNorm
from horizon.model.moe import MoE, Router
from horizon.model.options import ForwardOptions
from horizon.model.vision import VisionEncoder
from horizon.parallel.group import all_reduce


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        kind = cfg.layer_types[layer_idx]
        self.attn = KimiDeltaAttention(cfg, layer_idx) if kind == "kda" else GatedDSA(cfg, layer_idx)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = (MoE(cfg) if cfg.is_moe_layer(layer_idx)
                    else MLP(cfg.hidden_size, cfg.intermediate_size, GLU.of(cfg)))
        # attention residuals: the mixes that make the attention's and the MLP's inputs; a block of
        # `attn_res_block_size` layers begins here when block_start
        if cfg.attn_res_block_size:
            self.attn_res = DepthMix(cfg.hidden_size, cfg.rms_norm_eps)
            self.mlp_res = DepthMix(cfg.hidden_size, cfg.rms_norm_eps)
            self.block_start = layer_idx % cfg.attn_res_block_size == 0
        # set by horizon.parallel.shard: the mixer and the MLP then return this rank's partial sums, and
        # one all-reduce each completes them
        self.tp_reduce = False

    def forward(self, h: torch.Tensor, batch: Batch, cache: HorizonCache | None,
                options: ForwardOptions | None = None, bank: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The layer on h [N, d]. bank: the attention residuals' banked block states, None for the plain
        residual stream; then h is the partial sum and so is the result. At a block's start the caller has
        banked h already (bank[-1] is h; the layer never changes the list: FSDP and compiled graphs hand a
        module copies of its inputs), the attention reads the mix over the bank and the partial sum restarts."""
        if bank is None:
            h = h + self._attend(self.attn_norm(h), batch, cache, options)
            return h + self._ffn(self.mlp_norm(h))
        if self.block_start:
            partial = self._attend(self.attn_norm(self.attn_res(bank[:-1], h)), batch, cache, options)
        else:
            partial = h + self._attend(self.attn_norm(self.attn_res(bank, h)), batch, cache, options)
        return partial + self._ffn(self.mlp_norm(self.mlp_res(bank, partial)))

    def _ffn(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mlp(x)
        return all_reduce(y) if self.tp_reduce else y

    def _attend(self, x: torch.Tensor, batch: Batch, cache: HorizonCache | None,
                options: ForwardOptions | None) -> torch.Tensor:
        parts = batch.split_decode() if cache is not None else []  # only engine steps mix decode and prefill
        if len(parts) < 2:
            # options by keyword: forward pre-hooks (tests, tools) keep seeing (x, batch, cache)
            mixed = self.attn(x, batch, cache, options=options)
        else:  # decode rows and prompt chunks go through the mixer apart (Batch.split_decode)
            mixed = torch.empty_like(x)
            for sub, idx in parts:
                mixed[idx] = self.attn(x[idx], sub, cache, options=options)
        return all_reduce(mixed) if self.tp_reduce else mixed


class HorizonForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, init: bool = True):
        super().__init__()
        self.config = config
        # what decode caches are built from: a tensor-parallel rank's KDA states hold only its heads
        # (horizon.parallel.shard replaces it)
        self.cache_config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        # attention residuals: the last mix over depth, before the final norm
        self.output_res = DepthMix(config.hidden_size, config.rms_norm_eps) if config.attn_res_block_size else None
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        # built after the LM so a text-only model's random initialisation does not depend on it
        self.vision = VisionEncoder(config) if config.vision_layers else None
        if init and self.embed.weight.device.type != "meta":
            self.init_weights()
        self.to(config.torch_dtype)

    # --- weights -------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Random initialisation (normal(0, initializer_range); residual outputs scaled by 1/sqrt(2L))."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        std = self.config.initializer_range
        out_std = std / math.sqrt(2 * self.config.num_layers)

        def normal_(t: torch.Tensor, s: float) -> None:
            t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32) * s)

        def uniform_(t: torch.Tensor, lo: float, hi: float) -> None:
            t.copy_(torch.rand(t.shape, generator=gen, dtype=torch.float32) * (hi - lo) + lo)

        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                last = name.rsplit(".", 1)[-1]
                normal_(module.weight, out_std if last in ("o_proj", "wo", "down_proj") else std)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                normal_(module.weight, std)
            elif isinstance(module, (RMSNorm, nn.LayerNorm)):
                module.weight.fill_(1.0)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, Router):
                normal_(module.weight, std)
                module.e_score_correction_bias.zero_()
            elif isinstance(module, KimiDeltaAttention):
                kernel = module.conv_weight.shape[1]
                uniform_(module.conv_weight, -kernel**-0.5, kernel**-0.5)  # nn.Conv1d's default for depthwise
                uniform_(module.A_log, 1.0, 16.0)
                module.A_log.copy_(module.A_log.log())  # decay rates exp(A_log) in [1, 16]
                dt = torch.empty_like(module.dt_bias, dtype=torch.float32)
                uniform_(dt, math.log(1e-3), math.log(1e-1))
                dt = dt.exp()
                module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
                module.o_norm_weight.fill_(1.0)
        for module in self.modules():
            if hasattr(module, "gate_up_proj"):
                normal_(module.gate_up_proj, std)
                normal_(module.down_proj, out_std)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    def reset_runtime_state(self) -> None:
        """Zero the bookkeeping that is not a weight (MoE load counts); after to_empty() or a load."""
        for module in self.modules():
            if isinstance(module, MoE):
                module.load.zero_()

    def use_decode_layouts(self) -> None:
        """Re-lay weights where a compiled decode step reads them faster: same values, shapes and names, other
        strides (so checkpoints, state dicts and eager forwards are unchanged). Before compiling: a graph reads
        its weights at the strides it was compiled for."""
        for module in self.modules():
            if isinstance(module, KimiDeltaAttention):
                module.use_decode_layout()

    # --- caches --------------------------------------------------------------------------------
    def new_cache(self, num_slots: int, max_len: int) -> HorizonCache:
        """An empty decode cache for `num_slots` sequences of up to `max_len` tokens."""
        p = self.embed.weight
        return HorizonCache(self.cache_config, num_slots, max_len, dtype=p.dtype, device=p.device)

    # --- forward -------------------------------------------------------------------------------
    def encode_images(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        """RGB uint8 images [H, W, 3] -> one [tokens_i, hidden] embedding run each (see model/vision.py)."""
        if self.vision is None:
            raise ValueError("this model has no vision encoder (vision_layers=0): it takes text only")
        return [self.vision.encode(img) for img in images]

    def forward_batch(self, tokens: torch.Tensor, batch: Batch, cache: HorizonCache | None = None,
                      last_only: bool = False, image_embeds: torch.Tensor | None = None,
                      image_mask: torch.Tensor | None = None, options: ForwardOptions | None = None) -> torch.Tensor:
        """Varlen forward: tokens [N] laid out by `batch` -> fp32 logits [N, V] ([B, V] with last_only).

        image_mask [N] marks image placeholder positions; image_embeds [mask.sum(), hidden] replace their
        token embeddings, in order. options: the per-call attention modes and probes (None: the defaults).
        """
        if options is not None:
            options.validate()
        if cache is not None and not torch.compiler.is_compiling():  # the runner checks before a compiled step
            cache.check_capacity(batch)
        if batch.max_ctx > self.config.max_position_embeddings:
            raise ValueError(f"context of {batch.max_ctx} tokens exceeds the model's window "
                             f"max_position_embeddings={self.config.max_position_embeddings}")
        h = self.embed(tokens)
        if image_mask is not None:
            n = int(image_mask.sum())
            if image_embeds is None or image_embeds.shape != (n, h.shape[-1]):
                got = None if image_embeds is None else tuple(image_embeds.shape)
                raise ValueError(f"image_embeds must be [{n}, {h.shape[-1]}] for {n} image positions, got {got}")
            h = h.masked_scatter(image_mask[:, None], image_embeds.to(h.dtype))
        bank: list[torch.Tensor] | None = [] if self.output_res is not None else None
        for block in self.layers:
            if bank is not None and block.block_start:  # a block begins: its input is banked
                bank = [*bank, h]
            h = block(h, batch, cache, options, bank=bank)
        if cache is not None:
            cache.full_lens[batch.slots] += batch.lens
        if last_only:
            last = torch.cumsum(batch.lens, 0) - 1
            h = h[last]
            bank = None if bank is None else [b[last] for b in bank]
        if bank is not None:
            h = self.output_res(bank, h)
        return self.lm_head(self.norm(h)).float()

    def forward(self, input_ids: torch.Tensor, cache: HorizonCache | None = None,
                lengths: torch.Tensor | list[int] | None = None, image_embeds: torch.Tensor | None = None,
                image_mask: torch.Tensor | None = None, options: ForwardOptions | None = None) -> torch.Tensor:
        """input_ids [B, T] right-padded -> fp32 logits [B, T, V]; continues cache slots 0..B-1 if given.

        image_mask [B, T] marks image placeholders; image_embeds [mask.sum(), hidden] fill them in
        row-major order (e.g. torch.cat(model.encode_images(images)) for the images in prompt order).
        options: the per-call attention modes and probes (horizon.model.options; None: the defaults).
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        device = input_ids.device
        lens = torch.full((B,), T, dtype=torch.long) if lengths is None else torch.as_tensor(lengths).long().cpu()
        if lens.shape != (B,) or bool((lens < 0).any()) or bool((lens > T).any()):
            raise ValueError(f"lengths must hold {B} counts in [0, {T}], got {lens.tolist()}")
        if bool((input_ids < 0).any()) or bool((input_ids >= self.config.vocab_size).any()):
            raise ValueError(f"input_ids must be in [0, vocab_size={self.config.vocab_size})")
        if cache is not None:
            if B > cache.num_slots:
                raise ValueError(f"batch of {B} sequences but the cache has {cache.num_slots} slots")
            slots = torch.arange(B, device=cache.lens.device)
            batch = Batch.build(lens.to(device), start=cache.lens[slots].to(device), slots=slots.to(device))
        else:
            batch = Batch.build(lens.to(device))
        valid = torch.arange(T, device=device)[None, :] < batch.lens[:, None]
        if image_mask is not None and image_mask.shape != input_ids.shape:
            raise ValueError(f"image_mask must have input_ids' shape {tuple(input_ids.shape)}, "
                             f"got {tuple(image_mask.shape)}")
        mask = image_mask[valid] if image_mask is not None else None
        logits = self.forward_batch(input_ids[valid], batch, cache, image_embeds=image_embeds, image_mask=mask,
                                    options=options)
        return batch.pad(logits)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
