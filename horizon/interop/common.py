"""Pieces the family importers share: reading a foreign folder's tensors and the MLA / MoE / norm renames.

`Source` presents a folder's tensors under their logical names, whatever the storage:

    X                             a plain tensor
    X  +  X_scale_inv             FP8 (e4m3) with one fp32 scale per 128 x 128 block, DeepSeek-V3's release
                                  (`X` ends in `.weight`; the scale is `<module>.weight_scale_inv`)
    X.blocks + X.scales           MXFP4, as in the original gpt-oss release
    X_blocks + X_scales           MXFP4, as transformers writes it

and dequantises at read time. It remembers which tensors were read, so that after a conversion every
tensor the importer did not use is either a known leftover (skipped with a logged note) or an error:
an unread tensor usually means a feature of the checkpoint that Horizon would silently drop.

The tensor names of both families follow DeepSeek's Hugging Face layout; `mla`, `mlp` and `norms`
map the parts they share (see the tables in kimi_linear.py and deepseek_v32.py).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from typing import Any

import torch

from horizon.config import DTYPES, ModelConfig

log = logging.getLogger("horizon.interop")

Triple = tuple[str, torch.Tensor, str]  # (Horizon name, tensor, source file)
FP8_BLOCK = (128, 128)  # DeepSeek-V3's weight_block_size when the config does not say
QUANT_METHODS = ("fp8", "mxfp4")  # quantization_config.quant_method values Source reads


# --- reading the config ----------------------------------------------------------------------------
class RawConfig:
    """A foreign config.json with ValueErrors that name the family, the field and what was expected.

    `defaults` are the family's transformers defaults for fields that are not sizes (eps, routing
    constants): a config that omits one means what it means to transformers. Sizes have no default:
    a config without them is refused, naming the field.
    """

    def __init__(self, raw: dict, family: str, defaults: dict[str, Any]):
        if not isinstance(raw, dict):
            raise ValueError(f"{family} config.json: expected a JSON object, got {type(raw).__name__}")
        self.raw, self.family, self.defaults = raw, family, defaults

    def where(self, field: str) -> str:
        return f"{self.family} config.json field {field!r}"

    def has(self, *fields: str) -> bool:
        return any(self.raw.get(f) is not None for f in fields)

    def get(self, *fields: str, default: Any = None, required: bool = False) -> Any:
        """The first of `fields` present (aliases: the release's name and transformers' name)."""
        for f in fields:
            if self.raw.get(f) is not None:
                return self.raw[f]
        for f in fields:
            if f in self.defaults:
                return self.defaults[f]
        if required:
            names = " / ".join(repr(f) for f in fields)
            raise ValueError(f"{self.family} config.json: required field {names} is missing")
        return default

    def integer(self, *fields: str, default: Any = None) -> int:
        """An integer field; required unless it has a default."""
        value = self.get(*fields, default=default, required=default is None)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{self.where(fields[0])} must be an integer, found {value!r}")
        return value

    def expect(self, field: str, allowed: tuple, default: Any = None) -> Any:
        """A field that must hold one of the values Horizon implements (absent: `default`)."""
        value = self.raw.get(field, default)
        if value not in allowed:
            raise ValueError(f"{self.where(field)}={value!r} is not supported by Horizon; "
                             f"supported: {', '.join(repr(a) for a in allowed)}")
        return value

    def dtype(self) -> str:
        value = self.get("dtype", "torch_dtype", default="float32")
        return value if value in DTYPES else "float32"


def build_config(raw: RawConfig, **fields: Any) -> ModelConfig:
    """ModelConfig(**fields), its ValueError prefixed with where the values came from."""
    try:
        return ModelConfig(**fields)
    except ValueError as e:
        raise ValueError(f"{raw.family} config.json translates to an invalid Horizon config: {e}") from None


def mlp_pattern(raw: RawConfig, num_layers: int) -> dict[str, Any]:
    """first_k_dense / dense_layers from `mlp_layer_types` ("dense" | "sparse") or `first_k_dense_replace`."""
    types = raw.get("mlp_layer_types")
    if types is None:
        k = raw.integer("first_k_dense_replace")
        freq = raw.get("moe_layer_freq", default=1)
        if freq != 1:
            raise ValueError(f"{raw.where('moe_layer_freq')}={freq!r} is not supported (only 1)")
        return {"first_k_dense": min(k, num_layers)}
    if not isinstance(types, list) or len(types) != num_layers or not set(types) <= {"dense", "sparse"}:
        raise ValueError(f"{raw.where('mlp_layer_types')} must list 'dense' or 'sparse' for each of the "
                         f"{num_layers} layers, found {types!r}")
    dense = [i for i, t in enumerate(types) if t == "dense"]
    if dense == list(range(len(dense))):
        return {"first_k_dense": len(dense)}
    return {"first_k_dense": 0, "dense_layers": dense}


def moe_fields(raw: RawConfig) -> dict[str, Any]:
    """The DeepSeek-V3 router and expert sizes (sigmoid scores, bias-corrected top-k, groups)."""
    raw.expect("scoring_func", ("sigmoid",), default="sigmoid")
    raw.expect("moe_router_activation_func", ("sigmoid",), default="sigmoid")
    raw.expect("topk_method", ("noaux_tc",), default="noaux_tc")
    raw.expect("mlp_bias", (False,), default=False)
    return dict(
        n_routed_experts=raw.integer("n_routed_experts", "num_experts", "num_local_experts"),
        num_experts_per_tok=raw.integer("num_experts_per_tok", "num_experts_per_token"),
        moe_intermediate_size=raw.integer("moe_intermediate_size"),
        n_shared_experts=raw.integer("n_shared_experts", "num_shared_experts"),
        n_group=raw.integer("n_group", "num_expert_group"),
        topk_group=raw.integer("topk_group"),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", required=True)),
        norm_topk_prob=bool(raw.get("norm_topk_prob", "moe_renormalize", required=True)),
    )


def mla_fields(raw: RawConfig) -> dict[str, Any]:
    """MLA sizes; the latent norms always use eps 1e-6 (the RMSNorm default both families build them with)."""
    heads = raw.integer("num_attention_heads")
    kv_heads = raw.integer("num_key_value_heads", default=heads)
    if kv_heads != heads:
        raise ValueError(f"{raw.where('num_key_value_heads')}={kv_heads} differs from num_attention_heads={heads}: "
                         f"MLA expands the latent to every head, grouped heads are not supported")
    return dict(
        num_heads=heads,
        q_lora_rank=raw.get("q_lora_rank", default=0),
        kv_lora_rank=raw.integer("kv_lora_rank"),
        qk_nope_head_dim=raw.integer("qk_nope_head_dim"),
        qk_rope_head_dim=raw.integer("qk_rope_head_dim"),
        v_head_dim=raw.integer("v_head_dim"),
        attention_bias=bool(raw.get("attention_bias", default=False)),
        mla_norm_eps=1e-6,
    )


def stack_fields(raw: RawConfig) -> dict[str, Any]:
    raw.expect("hidden_act", ("silu",), default="silu")
    quant = raw.get("quantization_config", default={})
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if method not in (None, *QUANT_METHODS):  # others store tensors Source cannot dequantise
        raise ValueError(f"{raw.where('quantization_config')}: quant_method={method!r} is not supported; "
                         f"supported: {', '.join(QUANT_METHODS)}")
    return dict(
        vocab_size=raw.integer("vocab_size"),
        hidden_size=raw.integer("hidden_size"),
        num_layers=raw.integer("num_hidden_layers"),
        intermediate_size=raw.integer("intermediate_size"),
        rms_norm_eps=float(raw.get("rms_norm_eps", required=True)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", default=False)),
        initializer_range=float(raw.get("initializer_range", default=0.02)),
        dtype=raw.dtype(),
    )


# --- reading the tensors -----------------------------------------------------------------------------
def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight [out, in] (fp8) * scale_inv [ceil(out/b0), ceil(in/b1)] per block; edge blocks are partial."""
    b0, b1 = block
    out, inp = weight.shape
    scale = scale_inv.float().repeat_interleave(b0, 0)[:out].repeat_interleave(b1, 1)[:, :inp]
    return (weight.float() * scale).to(dtype)


class Source:
    """The logical tensors of a foreign folder (plain, FP8 block-scaled or MXFP4), read and dequantised lazily."""

    def __init__(self, store, dtype: torch.dtype = torch.float32):
        self.store, self.dtype = store, dtype
        names = set(store.names())
        self.kind: dict[str, tuple] = {}  # logical name -> ("plain", n) | ("fp8", w, s) | ("mxfp4", b, s)
        parts: set[str] = set()
        for n in sorted(names):
            for sep in (".", "_"):
                if n.endswith(sep + "blocks"):
                    base, scales = n[: -len("blocks") - 1], n[: -len("blocks")] + "scales"
                    if scales not in names:
                        raise ValueError(f"{store.path_of(n)}: MXFP4 tensor {n} has no {scales} beside it")
                    self.kind[base] = ("mxfp4", n, scales)
                    parts.update((n, scales))
            if n.endswith("_scale_inv"):
                base = n[: -len("_scale_inv")]
                if base not in names:
                    raise ValueError(f"{store.path_of(n)}: FP8 scale {n} has no weight {base} beside it")
                self.kind[base] = ("fp8", base, n)
                parts.update((base, n))
        for n in names - parts:
            self.kind[n] = ("plain", n)
        self.used: set[str] = set()
        self.fp8_block = self._fp8_block()
        # "model.layers.i.<module>." of every tensor, to find which MLP naming a layer uses in O(1)
        self.modules = {".".join(n.split(".")[:4]) + "." for n in self.kind if n.startswith("model.layers.")}

    def _fp8_block(self) -> tuple[int, int]:
        config = self.store.folder / "config.json"
        quant = json.loads(config.read_text()).get("quantization_config") if config.exists() else None
        block = quant.get("weight_block_size") if isinstance(quant, dict) else None
        if block is None:
            return FP8_BLOCK
        if (not isinstance(block, list) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ValueError(f"{config}: quantization_config.weight_block_size must be two positive integers, "
                             f"found {block!r}")
        return tuple(block)

    def has(self, name: str) -> bool:
        return name in self.kind

    def first(self, *names: str) -> str | None:
        return next((n for n in names if n in self.kind), None)

    def file(self, name: str) -> str:
        return str(self.store.path_of(self.kind[name][1]))

    def shape(self, name: str) -> tuple[int, ...]:
        kind = self.kind[name]
        if kind[0] == "mxfp4":
            blocks = self.store.shape(kind[1])
            return (*blocks[:-2], blocks[-2] * 2 * blocks[-1])
        return self.store.shape(kind[1])

    def check_shape(self, name: str, expected: tuple[int, ...]) -> None:
        found = self.shape(name)
        if tuple(found) != tuple(expected):
            raise ValueError(f"{self.file(name)}: tensor {name} has shape {list(found)}, expected {list(expected)} "
                             f"(from config.json)")

    def get(self, name: str, expected: tuple[int, ...] | None = None) -> torch.Tensor:
        """The tensor, dequantised to `self.dtype` if it was stored quantised; shape checked if given."""
        if name not in self.kind:
            raise ValueError(f"{self.store.folder}: tensor {name} is missing")
        if expected is not None:
            self.check_shape(name, expected)
        kind = self.kind[name]
        self.used.update(kind[1:])
        if kind[0] == "plain":
            tensor = self.store.get(name)
            if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                raise ValueError(f"{self.file(name)}: FP8 tensor {name} has no {name}_scale_inv beside it")
            return tensor
        if kind[0] == "fp8":
            return self._fp8(name, kind[1], kind[2])
        return self._mxfp4(name, kind[1], kind[2])

    def _fp8(self, name: str, weight_name: str, scale_name: str) -> torch.Tensor:
        weight, scale = self.store.get(weight_name), self.store.get(scale_name)
        b0, b1 = self.fp8_block
        want = (math.ceil(weight.shape[0] / b0), math.ceil(weight.shape[1] / b1)) if weight.dim() == 2 else None
        if want is None or tuple(scale.shape) != want:
            raise ValueError(f"{self.store.path_of(scale_name)}: FP8 scale {scale_name} has shape {list(scale.shape)}, "
                             f"expected {list(want) if want else '[ceil(out/b0), ceil(in/b1)]'} for weight "
                             f"{list(weight.shape)} in {b0}x{b1} blocks")
        return dequantize_fp8(weight, scale, self.fp8_block, self.dtype)

    def _mxfp4(self, name: str, blocks_name: str, scales_name: str) -> torch.Tensor:
        from horizon.quant.mxfp4 import dequantize  # lazily: only folders that hold MXFP4 need it

        blocks, scales = self.store.get(blocks_name), self.store.get(scales_name)
        if blocks.dim() < 2 or blocks.shape[-1] != 16 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
            raise ValueError(f"{self.store.path_of(blocks_name)}: MXFP4 tensor {name} has blocks "
                             f"{list(blocks.shape)} and scales {list(scales.shape)}, expected blocks [..., n, 16] "
                             f"and scales [..., n]")
        return dequantize(blocks, scales, self.dtype).reshape(self.shape(name))

    def unused(self) -> list[str]:
        """Stored tensors no read has touched."""
        return sorted(n for n in self.store.names() if n not in self.used)


def skip_reason(src: Source, name: str, cfg: ModelConfig) -> str | None:
    """Why an unread foreign tensor may be dropped without changing the logits (None: it may not)."""
    if math.prod(src.store.shape(name)) == 0:
        return "empty tensors (e.g. zero-width shared experts)"
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return "an output head tied to the embedding, as transformers ties it"
    i = layer_index(name)
    if i is not None and i >= cfg.num_layers:
        return "multi-token-prediction layers, unused for next-token logits"
    if name.endswith("rotary_emb.inv_freq"):
        return "rotary frequency buffers, recomputed"
    return None


def finish(src: Source, cfg: ModelConfig) -> None:
    """After a conversion: log the tensors that may be dropped, raise on any other unread tensor."""
    skipped: dict[str, list[str]] = {}
    for name in src.unused():
        reason = skip_reason(src, name, cfg)
        if reason is None:
            raise ValueError(f"{src.store.path_of(name)}: tensor {name} is not used by the conversion to Horizon "
                             f"(a feature Horizon does not implement, or a config.json that does not describe it)")
        skipped.setdefault(reason, []).append(name)
    for reason, names in skipped.items():
        log.info("skipped %d tensor(s) (%s), e.g. %s", len(names), reason, names[:3])


# --- the parts both families share ---------------------------------------------------------------------
def norms_and_embeddings(src: Source, cfg: ModelConfig) -> Iterator[Triple]:
    d = cfg.hidden_size
    yield "embed.weight", src.get("model.embed_tokens.weight", (cfg.vocab_size, d)), src.file(
        "model.embed_tokens.weight")
    yield "norm.weight", src.get("model.norm.weight", (d,)), src.file("model.norm.weight")
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", src.get("lm_head.weight", (cfg.vocab_size, d)), src.file("lm_head.weight")
    for i in range(cfg.num_layers):
        for theirs, ours in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "mlp_norm")):
            name = f"model.layers.{i}.{theirs}.weight"
            yield f"layers.{i}.{ours}.weight", src.get(name, (d,)), src.file(name)


def renamed(src: Source, pairs: list[tuple[str, str, tuple[int, ...]]]) -> Iterator[Triple]:
    """(their name, our name, expected shape) -> triples."""
    for theirs, ours, shape in pairs:
        yield ours, src.get(theirs, shape), src.file(theirs)


def mla(src: Source, cfg: ModelConfig, i: int) -> Iterator[Triple]:
    """MLA projections of layer i (DeepSeek's names) -> GatedDSA's."""
    p, q = f"model.layers.{i}.self_attn.", f"layers.{i}.attn."
    d, H = cfg.hidden_size, cfg.num_heads
    pairs = []
    if cfg.q_lora_rank:
        pairs += [(p + "q_a_proj.weight", q + "wq_a.weight", (cfg.q_lora_rank, d)),
                  (p + "q_a_layernorm.weight", q + "q_norm.weight", (cfg.q_lora_rank,)),
                  (p + "q_b_proj.weight", q + "wq_b.weight", (H * cfg.qk_head_dim, cfg.q_lora_rank))]
    else:
        pairs.append((p + "q_proj.weight", q + "wq.weight", (H * cfg.qk_head_dim, d)))
    pairs += [(p + "kv_a_proj_with_mqa.weight", q + "wkv_a.weight", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, d)),
              (p + "kv_a_layernorm.weight", q + "kv_norm.weight", (cfg.kv_lora_rank,)),
              (p + "kv_b_proj.weight", q + "wkv_b.weight",
               (H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)),
              (p + "o_proj.weight", q + "wo.weight", (d, H * cfg.v_head_dim))]
    if cfg.attention_bias:
        if cfg.q_lora_rank:
            pairs.append((p + "q_a_proj.bias", q + "wq_a.bias", (cfg.q_lora_rank,)))
        pairs += [(p + "kv_a_proj_with_mqa.bias", q + "wkv_a.bias", (cfg.kv_lora_rank + cfg.qk_rope_head_dim,)),
                  (p + "o_proj.bias", q + "wo.bias", (d,))]
    yield from renamed(src, pairs)


def mlp(src: Source, cfg: ModelConfig, i: int, prefixes: tuple[str, ...] = ("mlp",)) -> Iterator[Triple]:
    """Layer i's dense MLP or MoE -> Horizon's; experts stacked or per expert (gate/up/down or w1/w3/w2)."""
    d, f = cfg.hidden_size, cfg.moe_intermediate_size
    base = f"model.layers.{i}."
    p = next((base + x + "." for x in prefixes if base + x + "." in src.modules), None)
    if p is None:
        raise ValueError(f"{src.store.folder}: layer {i} has no MLP tensors (looked for "
                         f"{', '.join(base + x + '.*' for x in prefixes)})")
    q = f"layers.{i}.mlp."
    if not cfg.is_moe_layer(i):
        w = cfg.intermediate_size
        yield from renamed(src, [(p + "gate_proj.weight", q + "gate_proj.weight", (w, d)),
                                 (p + "up_proj.weight", q + "up_proj.weight", (w, d)),
                                 (p + "down_proj.weight", q + "down_proj.weight", (d, w))])
        return
    E = cfg.n_routed_experts
    yield from renamed(src, [(p + "gate.weight", q + "gate.weight", (E, d)),
                             (p + "gate.e_score_correction_bias", q + "gate.e_score_correction_bias", (E,))])
    if src.has(p + "experts.gate_up_proj"):  # transformers' stacked layout, the same as ours
        yield from renamed(src, [(p + "experts.gate_up_proj", q + "experts.gate_up_proj", (E, 2 * f, d)),
                                 (p + "experts.down_proj", q + "experts.down_proj", (E, d, f))])
    else:
        yield from stacked_experts(src, p + "experts.", q + "experts.", E, d, f)
    if cfg.n_shared_experts:
        s = f * cfg.n_shared_experts
        yield from renamed(src, [(p + f"shared_experts.{n}.weight", q + f"shared_experts.{n}.weight", shape)
                                 for n, shape in (("gate_proj", (s, d)), ("up_proj", (s, d)),
                                                  ("down_proj", (d, s)))])


def stacked_experts(src: Source, p: str, q: str, E: int, d: int, f: int) -> Iterator[Triple]:
    """Per-expert experts.N.{gate,up,down}_proj (or w1 / w3 / w2) -> gate_up_proj [E, 2f, d], down_proj [E, d, f]."""
    names = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}
    gate_up = torch.empty(E, 2 * f, d, dtype=src.dtype)  # filled one expert at a time: no second copy
    down = torch.empty(E, d, f, dtype=src.dtype)
    source = ""
    for e in range(E):
        found = {}
        for role, options in names.items():
            found[role] = src.first(*(f"{p}{e}.{o}.weight" for o in options))
            if found[role] is None:
                raise ValueError(f"{src.store.folder}: expert {e} has no {role} projection "
                                 f"(looked for {', '.join(f'{p}{e}.{o}.weight' for o in options)})")
        gate_up[e, :f] = src.get(found["gate"], (f, d))
        gate_up[e, f:] = src.get(found["up"], (f, d))
        down[e] = src.get(found["down"], (d, f))
        source = source or src.file(found["gate"])
    yield q + "gate_up_proj", gate_up, source
    yield q + "down_proj", down, source


def layer_index(name: str) -> int | None:
    """i for a name under model.layers.i."""
    if not name.startswith("model.layers."):
        return None
    head = name[len("model.layers."):].split(".", 1)[0]
    return int(head) if head.isdigit() else None
