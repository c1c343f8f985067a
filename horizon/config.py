"""ModelConfig: the one configuration dataclass for every Horizon model.

A config fixes the architecture (docs/design.md §1): the layer schedule of Kimi Delta Attention
(KDA) and Gated DSA layers, their dimensions, the Mixture-of-Experts sizes, the vocabulary and the
context window. It round-trips through an HF-style ``config.json`` (``model_type: "horizon"``) and
rejects invalid values with a ``ValueError`` that names the field, the value and what is allowed.
Loading a Horizon ``config.json`` needs every field (``save`` writes them all): a missing key is an
error naming it and what it should hold, never a silent default, and so is a value of the wrong JSON
type (``"64"``, ``true`` or ``64.0`` where an integer belongs).

    cfg = ModelConfig.preset("tiny")
    cfg.save("ckpt/config.json"); ModelConfig.load("ckpt/config.json") == cfg
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

LAYER_TYPES = ("kda", "dsa")
ACTIVATIONS = ("silu", "situ")  # the GLU activation of every MLP and expert (horizon.model.layers.glu)
DTYPES = ("float32", "bfloat16", "float16")  # torch dtype names; torch is imported only when needed
MLA_ROPE = ("none", "interleaved", "half")
# Keys of `rope_scaling` (YaRN, as DeepSeek-V3.2 and transformers' `rope_parameters` spell them).
YARN_KEYS = {"type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "attention_factor", "truncate"}
# Keys other tools put in config.json that carry no architecture; accepted and ignored on load.
# Any other key that is not a field is refused (a typo such as "hiden_size" must not load silently).
_METADATA_KEYS = {"model_type", "architectures", "transformers_version", "torch_dtype", "horizon_version"}
# Fields a Horizon config.json may lack, taking the dataclass default. None today: `save` writes every
# field and the bundled horizon-tiny lists them all. A field added later that changes nothing for
# older checkpoints goes here (with a comment saying since when), so that those still load.
# Since 2026-12-08 (Kimi K3's pieces): the fields below default to the behaviour every older
# checkpoint was trained with (SwiGLU, plain residual, softplus KDA decay, low-rank gates, full-width experts).
_DEFAULTED_ON_LOAD: frozenset[str] = frozenset({
    "hidden_act", "situ_beta", "situ_linear_beta", "attn_res_block_size", "kda_gate_lower_bound",
    "kda_gate_full_rank", "dsa_gate_full_rank", "moe_latent_size", "moe_latent_norm"})
# The value ranges `validate` enforces, shared with the messages of `from_dict` (missing or mistyped keys).
_INTS_GE_1 = ("vocab_size", "hidden_size", "num_layers", "intermediate_size", "max_position_embeddings",
              "kda_num_heads", "kda_head_dim", "kda_conv_size", "kda_chunk_size", "num_heads", "kv_lora_rank",
              "v_head_dim", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group",
              "topk_group")
_INTS_GE_0 = ("q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "dsa_gate_rank", "index_n_heads",
              "index_head_dim", "index_topk", "index_rope_dim", "first_k_dense", "n_shared_experts", "vision_layers",
              "attn_res_block_size", "moe_latent_size")
_NUMBERS_GT_0 = ("rms_norm_eps", "rope_theta", "routed_scaling_factor", "initializer_range", "situ_beta",
                 "situ_linear_beta")
_VISION_INTS_GE_1 = ("vision_hidden_size", "vision_num_heads", "vision_intermediate_size", "vision_patch_size",
                     "vision_merge", "vision_max_tokens")


def default_layer_types(num_layers: int, dsa_every: int = 4) -> list[str]:
    """Every `dsa_every`-th layer (1-based: 4, 8, ...) and the last layer are Gated DSA, the rest KDA."""
    return ["dsa" if (i + 1) % dsa_every == 0 or i == num_layers - 1 else "kda" for i in range(num_layers)]


@dataclass
class ModelConfig:
    # --- stack ----------------------------------------------------------------------------------
    vocab_size: int = 4096
    hidden_size: int = 64
    num_layers: int = 6
    # "kda" or "dsa" per layer. Explicit in config.json so the schedule lives in exactly one place;
    # None at construction means default_layer_types(num_layers).
    layer_types: list[str] | None = None
    first_k_dense: int = 1  # the first k layers use a dense SwiGLU MLP, the rest MoE
    # Explicit dense-MLP layers (0-based) for imported models whose dense layers are not a prefix;
    # None: the first `first_k_dense`. When set, first_k_dense must be 0.
    dense_layers: list[int] | None = None
    intermediate_size: int = 128  # dense MLP width
    max_position_embeddings: int = 4096  # the context window
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    dtype: str = "float32"  # parameter dtype: float32 | bfloat16 | float16
    initializer_range: float = 0.02
    # The GLU activation of the dense MLP, the shared and the routed experts: "silu" (SwiGLU) or "situ"
    # (Kimi K3: beta * tanh(g / beta) * sigmoid(g) * linear_beta * tanh(u / linear_beta), in fp32).
    hidden_act: str = "silu"
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    # Attention residuals (Kimi K3, horizon.model.attn_res): each sublayer's input is a softmax mix over
    # depth of banked block outputs and the running partial sum; a new block starts every
    # `attn_res_block_size` layers. 0: the plain pre-norm residual stream.
    attn_res_block_size: int = 0

    # --- Kimi Delta Attention -------------------------------------------------------------------
    kda_num_heads: int = 2
    kda_head_dim: int = 32  # d_k = d_v; also the rank of the low-rank decay and output gates
    kda_conv_size: int = 4  # causal depthwise short convolution on q, k, v
    kda_chunk_size: int = 64  # C of the chunkwise (prefill / training) form
    # None: log alpha = -exp(A_log) * softplus(f + dt_bias) (Kimi Linear). A number lb < 0 (Kimi K3: -5):
    # log alpha = lb * sigmoid(exp(A_log) * (f + dt_bias)), in (lb, 0); it replaces the softplus form.
    kda_gate_lower_bound: float | None = None
    kda_gate_full_rank: bool = False  # output gate sigmoid(g_proj x), one d x H*d_k matrix (K3), not g_b(g_a(x))

    # --- Gated DSA: MLA projections over a latent cache ----------------------------------------
    num_heads: int = 4
    q_lora_rank: int = 32  # 0: no query latent (q = W_q x, as in Kimi Linear)
    kv_lora_rank: int = 32  # width of the cached latent c_kv
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8  # decoupled key slice shared by all heads, cached beside c_kv (0: none)
    v_head_dim: int = 16
    # Whether rotary embedding is *applied* to the decoupled slice: Horizon rotates nothing (the KDA
    # layers carry position, as in Kimi Linear); DeepSeek-V3.2 rotates it interleaved.
    mla_rope: str = "none"
    rope_theta: float = 10000.0
    dsa_gate_rank: int = 16  # low-rank sigmoid output gate G; 0: no gate (plain MLA / DSA)
    dsa_gate_full_rank: bool = False  # a full-rank gate (one d x H*v matrix, Kimi K3's g_proj); dsa_gate_rank 0
    attention_bias: bool = False  # bias on the latent down-projections (some imported models)
    # eps of the MLA latent RMSNorms (c_q, c_kv); None: rms_norm_eps. Kimi Linear and DeepSeek-V3.2
    # use 1e-6 there whatever eps their block norms use.
    mla_norm_eps: float | None = None
    # YaRN context extension of every rotary embedding (DeepSeek-V3.2), None for plain RoPE:
    # {"type": "yarn", "factor": s, "original_max_position_embeddings": n, and optionally "beta_fast"
    # (32), "beta_slow" (1), "mscale", "mscale_all_dim", "attention_factor", "truncate" (true)}, read
    # as transformers reads them. It rescales the frequencies and the rotated slice, and multiplies
    # the MLA softmax scale by (0.1 * mscale_all_dim * ln s + 1)^2.
    rope_scaling: dict[str, Any] | None = None

    # --- Gated DSA: lightning indexer ------------------------------------------------------------
    index_n_heads: int = 8  # H_I; 0: no indexer (dense MLA, the "previous generation")
    index_head_dim: int = 16  # d_I
    index_topk: int = 16  # positions each query keeps
    index_rope_dim: int = 0  # half-split RoPE on the first dims of indexer q/k (0: none)

    # --- Mixture of Experts ----------------------------------------------------------------------
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    n_shared_experts: int = 1
    n_group: int = 2  # routing groups (1: no group limiting)
    topk_group: int = 1  # groups kept per token
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    # Latent MoE (Kimi K3): the routed experts run on z = W_down x of this width, their weighted sum is
    # RMS-normed (moe_latent_norm) and W_up maps it back; shared experts stay at full width. 0: no latent.
    moe_latent_size: int = 0
    moe_latent_norm: bool = False

    # --- vision encoder (horizon/model/vision.py); vision_layers=0: a text-only model ---
    vision_layers: int = 0
    vision_hidden_size: int = 64
    vision_num_heads: int = 4
    vision_intermediate_size: int = 128
    vision_patch_size: int = 8  # pixels per patch side
    vision_merge: int = 2  # merge x merge patches become one image token
    vision_max_tokens: int = 64  # image tokens per image at most (a larger image is scaled down)

    extra: dict[str, Any] = field(default_factory=dict)  # free-form notes kept in config.json

    model_type = "horizon"  # class constant, written to config.json

    def __post_init__(self) -> None:
        if self.layer_types is None:
            self.layer_types = default_layer_types(self.num_layers)
        else:
            self.layer_types = list(self.layer_types)
        if isinstance(self.dense_layers, tuple):
            self.dense_layers = list(self.dense_layers)
        self.validate()

    # --- validation ------------------------------------------------------------------------------
    def validate(self) -> None:
        def fail(name: str, allowed: str) -> None:
            raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r} is invalid: {allowed}")

        for name in _INTS_GE_1:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                fail(name, "must be an integer >= 1")
        for name in _INTS_GE_0:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                fail(name, "must be an integer >= 0" + (" (0: no vision encoder)" if name == "vision_layers" else ""))
        for name in _NUMBERS_GT_0:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                fail(name, "must be a number > 0")
        if self.dtype not in DTYPES:
            fail("dtype", f"allowed: {', '.join(DTYPES)}")
        if self.mla_rope not in MLA_ROPE:
            fail("mla_rope", f"allowed: {', '.join(MLA_ROPE)}")
        if self.hidden_act not in ACTIVATIONS:
            fail("hidden_act", f"allowed: {', '.join(ACTIVATIONS)}")
        lb = self.kda_gate_lower_bound
        if lb is not None and (not isinstance(lb, (int, float)) or isinstance(lb, bool) or not -1e4 < lb < 0):
            fail("kda_gate_lower_bound", "must be null (softplus decay) or a number < 0 (K3: -5.0)")
        if self.dsa_gate_full_rank and self.dsa_gate_rank:
            fail("dsa_gate_rank", "must be 0 with dsa_gate_full_rank (the gate is full rank, not low rank)")
        if len(self.layer_types) != self.num_layers:
            fail("layer_types", f"must list one type per layer (num_layers={self.num_layers}), "
                 f"got {len(self.layer_types)}")
        bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if bad:
            fail("layer_types", f"unknown type(s) {bad}; allowed: {', '.join(LAYER_TYPES)}")
        if self.first_k_dense > self.num_layers:
            fail("first_k_dense", f"must be <= num_layers ({self.num_layers})")
        if self.dense_layers is not None:
            if self.first_k_dense:
                fail("first_k_dense", "must be 0 when dense_layers lists the dense layers explicitly")
            if (not isinstance(self.dense_layers, list) or len(set(self.dense_layers)) != len(self.dense_layers)
                    or not all(isinstance(i, int) and 0 <= i < self.num_layers for i in self.dense_layers)):
                fail("dense_layers", f"must be a list of distinct layer indices in [0, {self.num_layers})")
        if self.mla_norm_eps is not None and (not isinstance(self.mla_norm_eps, (int, float))
                                              or isinstance(self.mla_norm_eps, bool) or not self.mla_norm_eps > 0):
            fail("mla_norm_eps", "must be null or a number > 0")
        if self.rope_scaling is not None:
            self._validate_rope_scaling(fail)
        if self.qk_nope_head_dim + self.qk_rope_head_dim < 1:
            fail("qk_nope_head_dim", "qk_nope_head_dim + qk_rope_head_dim must be >= 1")
        if self.mla_rope != "none" and (self.qk_rope_head_dim == 0 or self.qk_rope_head_dim % 2):
            fail("qk_rope_head_dim", f"must be even and > 0 when mla_rope={self.mla_rope!r}")
        if self.index_n_heads:
            if self.index_head_dim < 1:
                fail("index_head_dim", "must be >= 1 when the layer has an indexer (index_n_heads > 0)")
            if self.index_topk < 1:
                fail("index_topk", "must be >= 1 when the layer has an indexer (index_n_heads > 0)")
            if self.index_rope_dim > self.index_head_dim or self.index_rope_dim % 2:
                fail("index_rope_dim", f"must be even and <= index_head_dim ({self.index_head_dim})")
        if self.num_experts_per_tok > self.n_routed_experts:
            fail("num_experts_per_tok", f"must be <= n_routed_experts ({self.n_routed_experts})")
        if self.n_routed_experts % self.n_group:
            fail("n_group", f"must divide n_routed_experts ({self.n_routed_experts})")
        if self.topk_group > self.n_group:
            fail("topk_group", f"must be <= n_group ({self.n_group})")
        per_group = self.n_routed_experts // self.n_group
        if self.n_group > 1 and per_group < 2:
            fail("n_group", "group-limited routing ranks groups by their top-2 scores: each group needs "
                 f">= 2 experts (n_routed_experts={self.n_routed_experts})")
        if self.topk_group * per_group < self.num_experts_per_tok:
            fail("topk_group", f"the kept groups hold {self.topk_group * per_group} experts, fewer than "
                 f"num_experts_per_tok ({self.num_experts_per_tok})")
        if self.vision_layers:
            for name in _VISION_INTS_GE_1:
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    fail(name, "must be an integer >= 1")
            if self.vision_hidden_size % self.vision_num_heads:
                fail("vision_num_heads", f"must divide vision_hidden_size ({self.vision_hidden_size})")
        if not isinstance(self.extra, dict):
            fail("extra", "must be a JSON object")

    def _validate_rope_scaling(self, fail) -> None:
        rs = self.rope_scaling
        if not isinstance(rs, dict) or rs.get("type") != "yarn":
            fail("rope_scaling", 'must be null or an object with "type": "yarn" (the only scaling supported)')
        unknown = sorted(set(rs) - YARN_KEYS)
        if unknown:
            fail("rope_scaling", f"unknown key(s) {unknown}; allowed: {sorted(YARN_KEYS)}")
        for key in ("factor", "original_max_position_embeddings"):
            if key not in rs:
                fail("rope_scaling", f'needs "{key}"')
        for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor"):
            v = rs.get(key)
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0):
                fail("rope_scaling", f'"{key}" must be a number > 0')
        for key in ("mscale", "mscale_all_dim"):
            v = rs.get(key)
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0):
                fail("rope_scaling", f'"{key}" must be a number >= 0')

    # --- derived ---------------------------------------------------------------------------------
    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def dsa_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "dsa"]

    @property
    def kda_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "kda"]

    @property
    def mla_eps(self) -> float:
        return self.rms_norm_eps if self.mla_norm_eps is None else self.mla_norm_eps

    def is_moe_layer(self, layer: int) -> bool:
        if self.dense_layers is not None:
            return layer not in self.dense_layers
        return layer >= self.first_k_dense

    # --- serialisation ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model_type": self.model_type, "architectures": ["HorizonForCausalLM"]}
        out.update(dataclasses.asdict(self))
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """The config a Horizon config.json describes: every field present (see `_DEFAULTED_ON_LOAD`) and
        of its JSON type, else a ValueError naming the key(s) and what they should hold."""
        if not isinstance(data, dict):
            raise ValueError(f"a model config must be a JSON object, got {type(data).__name__}")
        model_type = data.get("model_type", cls.model_type)
        if model_type != cls.model_type:
            raise ValueError(f"config model_type={model_type!r} is not {cls.model_type!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names - _METADATA_KEYS)
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s) {unknown}; known fields: {sorted(names)}")
        # A default here would build a model of another shape (hidden_size) or silently change its
        # numerics (rms_norm_eps), only to fail later far from the cause, or not at all.
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in data and f.name not in _DEFAULTED_ON_LOAD]
        if missing:
            expected = "; ".join(f"{name}: {_expected(name)}" for name in missing)
            raise ValueError(f"missing key(s) {missing}: a Horizon config.json lists every ModelConfig field, "
                             f"as horizon.save writes it; expected {expected}")
        # Types before construction: __post_init__ computes with num_layers, and validate() does not
        # look at every field (a "false" string for a bool would simply be truthy).
        for name in sorted(names & set(data)):
            if not _FIELD_TYPES[name][0](data[name]):
                raise ValueError(f"ModelConfig.{name}={data[name]!r} is invalid: expected {_expected(name)}, "
                                 f"got {_json_type(data[name])}")
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def load(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again); layer_types follows num_layers if unset."""
        if "num_layers" in changes and "layer_types" not in changes:
            changes["layer_types"] = None
        return dataclasses.replace(self, **changes)

    # --- presets ---------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        from horizon.presets import PRESETS

        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; allowed: {', '.join(PRESETS)}")
        return cls(**PRESETS[name])


# --- the JSON type of each field, for from_dict --------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true is a Python int: refuse it


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # json reads NaN, Infinity


def _optional(check):
    return lambda v: v is None or check(v)


def _list_of(check):
    return lambda v: isinstance(v, list) and all(check(x) for x in v)


# Annotation (a string: `from __future__ import annotations`) -> (check, what it is). A field with an
# annotation not listed fails the import below, so a new field cannot skip the check.
_TYPE_RULES = {
    "int": (_is_int, "an integer"),
    "float": (_is_number, "a finite number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "list[str] | None": (_optional(_list_of(lambda v: isinstance(v, str))), "null or a list of strings"),
    "list[int] | None": (_optional(_list_of(_is_int)), "null or a list of integers"),
    "float | None": (_optional(_is_number), "null or a finite number"),
    "dict[str, Any] | None": (_optional(lambda v: isinstance(v, dict)), "null or a JSON object"),
    "dict[str, Any]": (lambda v: isinstance(v, dict), "a JSON object"),
}
_FIELD_TYPES = {f.name: _TYPE_RULES[f.type] for f in dataclasses.fields(ModelConfig)}
# Sharper than the type alone, for the fields whose allowed values are a range or a set.
_ALLOWED = {
    **dict.fromkeys(_INTS_GE_1, "an integer >= 1"),
    **dict.fromkeys(_INTS_GE_0, "an integer >= 0"),
    **dict.fromkeys(_VISION_INTS_GE_1, "an integer >= 1"),
    **dict.fromkeys(_NUMBERS_GT_0, "a number > 0"),
    "dtype": f"one of {', '.join(DTYPES)}",
    "mla_rope": f"one of {', '.join(MLA_ROPE)}",
    "hidden_act": f"one of {', '.join(ACTIVATIONS)}",
    "kda_gate_lower_bound": "null (softplus decay) or a number < 0",
    "layer_types": f"a list with one of {', '.join(LAYER_TYPES)} per layer (null: the default schedule)",
    "dense_layers": "null or a list of distinct layer indices (0-based)",
    "mla_norm_eps": "null (rms_norm_eps) or a number > 0",
    "rope_scaling": 'null or a YaRN object {"type": "yarn", "factor": ..., "original_max_position_embeddings": ...}',
}


def _expected(name: str) -> str:
    return _ALLOWED.get(name, _FIELD_TYPES[name][1])


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a float" if math.isfinite(v) else "a non-finite number"
    if isinstance(v, list):  # name what it holds: "a list" alone does not say what is wrong with it
        return f"a list holding {', '.join(sorted({_json_type(x) for x in v}))}" if v else "an empty list"
    return {str: "a string", dict: "a JSON object"}.get(type(v), type(v).__name__)
