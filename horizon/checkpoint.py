"""Checkpoints: save and load models as safetensors + JSON. Nothing in Horizon reads or writes pickles.

A checkpoint folder holds

    config.json              the ModelConfig (model_type "horizon"), plus "quantization_config"
                             {"quant_method": "mxfp4"} when the routed experts are stored as MXFP4
    generation_config.json   generation defaults, including the token budget of each thinking tier
    tokenizer.json           the tokenizer (the bundled one unless another is given)
    model.safetensors        the weights; above `max_shard_bytes` they are split into
                             model-00001-of-0000N.safetensors with model.safetensors.index.json

    horizon.save(model, "ckpt/", quantize="mxfp4")
    model = horizon.load("ckpt/", dtype=torch.bfloat16)

`load` also reads Hugging Face folders of other model families (`horizon.interop`): their config
is translated to a ModelConfig and their tensors renamed, so they run on the one Horizon model.
Every way a checkpoint can be broken (a missing or truncated shard, a tensor of the wrong shape, a
missing or unexpected tensor, an unknown model_type) is a ValueError naming the file and tensor.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from horizon.config import ModelConfig
from horizon.model.model import HorizonForCausalLM
from horizon.quant import canonical_name as _canonical_name  # `<name>.blocks` (gpt-oss) -> `<name>_blocks`
from horizon.quant import empty_quantized_model
from horizon.quant.mxfp4 import quantize as mxfp4_quantize

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
TOKENIZER = "tokenizer.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 4 * 1024**3
QUANT_METHODS = ("mxfp4",)
_SAFETENSORS_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                            "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


# --- reading tensors -------------------------------------------------------------------------------
class TensorStore:
    """The tensors of a checkpoint folder (one file or an index of shards), read lazily by name."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = self.folder / INDEX
        if index.exists():
            data = _read_json(index)
            weight_map = data.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{index}: no 'weight_map' object mapping tensor names to shard files")
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
            if not files:
                raise ValueError(f"{self.folder}: no {WEIGHTS} (or sharded *.safetensors with {INDEX}) found")
            weight_map = None
        self.file_of: dict[str, str] = {}
        self._handles: dict[str, Any] = {}
        for name in files:
            path = self.folder / name
            if not path.exists():
                needed = [t for t, f in (weight_map or {}).items() if f == name]
                raise ValueError(f"{path}: shard listed in {INDEX} is missing "
                                 f"({len(needed)} tensors, e.g. {needed[:3]})")
            try:
                handle = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as e:
                raise ValueError(f"{path}: not a readable safetensors file (truncated or corrupt?): {e}") from None
            self._handles[name] = handle
            for key in handle.keys():
                if key in self.file_of:
                    raise ValueError(f"{path}: tensor {key} is also in {self.file_of[key]}")
                self.file_of[key] = name
        if weight_map is not None:
            for key, name in weight_map.items():
                if self.file_of.get(key) != name:
                    raise ValueError(f"{self.folder / name}: {INDEX} lists tensor {key} in this shard, "
                                     f"but the shard does not hold it")

    def names(self) -> list[str]:
        return list(self.file_of)

    def path_of(self, name: str) -> Path:
        return self.folder / self.file_of[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self.file_of[name]].get_slice(name).get_shape())

    def nbytes(self, name: str) -> int:
        """Bytes of one tensor's data, read from the header (for progress bars)."""
        sl = self._handles[self.file_of[name]].get_slice(name)
        return math.prod(sl.get_shape()) * _SAFETENSORS_DTYPE_BYTES.get(sl.get_dtype(), 4)

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._handles[self.file_of[name]].get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"{self.path_of(name)}: cannot read tensor {name} (truncated file?): {e}") from None


def _read_json(path: Path) -> dict:
    if not path.exists():
        raise ValueError(f"{path}: missing")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


# --- building and filling a model ----------------------------------------------------------------------
def _quantized_experts(state_names) -> bool:
    return any(n.endswith("_blocks") or n.endswith(".blocks") for n in state_names)


def build_model(config: ModelConfig, dtype: torch.dtype | None = None, device="cpu",
                quantization: str | None = None) -> HorizonForCausalLM:
    """A model with uninitialised weights on `device` (built on the meta device first: no init cost)."""
    with torch.device("meta"):
        model = HorizonForCausalLM(config, init=False)
    if quantization == "mxfp4":
        empty_quantized_model(model)
    model = model.to(dtype or config.torch_dtype)
    model.to_empty(device=device)
    model.reset_runtime_state()
    return model


def fill_model(model: HorizonForCausalLM, tensors: Iterator[tuple[str, torch.Tensor, str]]) -> None:
    """Copy (name, tensor, source file) triples into the model, checking names and shapes; all must be present."""
    target = model.state_dict()
    tied = model.config.tie_word_embeddings
    seen = set()
    for name, tensor, source in tensors:
        if name not in target:
            raise ValueError(f"{source}: tensor {name} is not part of this model "
                             f"({type(model).__name__}, {len(target)} tensors)")
        want = target[name]
        if tuple(tensor.shape) != tuple(want.shape):
            raise ValueError(f"{source}: tensor {name} has shape {list(tensor.shape)}, expected {list(want.shape)}")
        if tensor.dtype.is_floating_point != want.dtype.is_floating_point:
            raise ValueError(f"{source}: tensor {name} has dtype {tensor.dtype}, expected {want.dtype}")
        want.copy_(tensor)
        seen.add(name)
    missing = [n for n in target if n not in seen and not (tied and n == "lm_head.weight")]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s) of the model, e.g. {missing[:5]}")


# --- save ----------------------------------------------------------------------------------------------
def _stored(pairs, quantize: str | None) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs as written: routed experts become `<name>_blocks` / `<name>_scales` with mxfp4."""
    for name, tensor in pairs:
        if quantize == "mxfp4" and _is_routed_expert(name) and tensor.is_floating_point():
            blocks, scales = mxfp4_quantize(tensor)
            yield f"{name}_blocks", blocks
            yield f"{name}_scales", scales
        else:
            yield _canonical_name(name), tensor


def _is_routed_expert(name: str) -> bool:
    return name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj")


def write_weights(path: Path, tensors, max_shard_bytes: int = DEFAULT_SHARD_BYTES, progress=None) -> None:
    """Stream (name, tensor) pairs into model.safetensors, or shards + index above `max_shard_bytes`.

    Only one shard is held in memory at a time, so a checkpoint larger than RAM can be rewritten
    tensor by tensor. `progress(nbytes)` is called after each tensor.
    """
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    for old in list(path.glob("model*.safetensors")) + [path / INDEX]:
        old.unlink(missing_ok=True)  # a re-save must not leave stale shards behind
    files: list[tuple[Path, list[str], int]] = []
    shard: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        tmp = path / f"model-{len(files) + 1:05d}.safetensors.partial"
        save_file(shard, str(tmp), metadata={"format": "pt"})  # raw storage: contiguous CPU tensors
        files.append((tmp, list(shard), size))

    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > max_shard_bytes:
            flush()
            shard, size = {}, 0
        shard[name] = tensor.detach().to("cpu").contiguous()
        size += nbytes
        if progress is not None:
            progress(nbytes)
    flush()
    if len(files) == 1:
        files[0][0].rename(path / WEIGHTS)
        return
    weight_map, total = {}, 0
    for i, (tmp, names, nbytes) in enumerate(files):
        final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        tmp.rename(path / final)
        weight_map.update(dict.fromkeys(names, final))
        total += nbytes
    (path / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                         indent=2) + "\n")


def _write_metadata(path: Path, config: dict, quantization: str | None, generation_config: dict | None,
                    tokenizer) -> None:
    config = dict(config)
    config.pop("quantization_config", None)
    if quantization:
        config["quantization_config"] = {"quant_method": quantization, "modules": "routed experts"}
    (path / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    gen = default_generation_config()
    gen.update(generation_config or {})
    (path / GENERATION_CONFIG).write_text(json.dumps(gen, indent=2) + "\n")
    _save_tokenizer(path, tokenizer)


def _check_quantize(quantize: str | None) -> None:
    if quantize not in (None, *QUANT_METHODS):
        raise ValueError(f"quantize={quantize!r} is not supported; allowed: None, {', '.join(QUANT_METHODS)}")


def save(model: HorizonForCausalLM, path: str | Path, quantize: str | None = None, tokenizer=None,
         generation_config: dict[str, Any] | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write a checkpoint folder; `quantize="mxfp4"` stores the routed experts as MXFP4 (DESIGN 2)."""
    _check_quantize(quantize)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    quantization = quantize or ("mxfp4" if _quantized_experts(model.state_dict()) else None)
    config = model.config.to_dict()
    config["dtype"] = str(model.embed.weight.dtype).removeprefix("torch.")  # the dtype the weights are in
    _write_metadata(path, config, quantization, generation_config, tokenizer)
    tied = model.config.tie_word_embeddings  # lm_head.weight is embed.weight: stored once, re-tied at load
    pairs = ((n, t) for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight"))
    write_weights(path, _stored(pairs, quantize), max_shard_bytes)
    return path


def quantize_checkpoint(src: str | Path, dst: str | Path, method: str = "mxfp4",
                        max_shard_bytes: int = DEFAULT_SHARD_BYTES, progress=None) -> Path:
    """Rewrite a Horizon checkpoint with its routed experts quantised, one tensor at a time."""
    _check_quantize(method)
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise ValueError(f"{dst}: the destination must differ from the source")
    raw = _read_json(src / CONFIG)
    if raw.get("model_type") != ModelConfig.model_type:
        raise ValueError(f"{src / CONFIG}: quantize works on Horizon checkpoints; convert a "
                         f"{raw.get('model_type')!r} checkpoint first (horizon convert)")
    store = TensorStore(src)
    dst.mkdir(parents=True, exist_ok=True)
    gen = _read_json(src / GENERATION_CONFIG) if (src / GENERATION_CONFIG).exists() else None
    tokenizer = None
    if (src / TOKENIZER).exists():
        shutil.copyfile(src / TOKENIZER, dst / TOKENIZER)
    _write_metadata(dst, raw, method, gen, tokenizer)

    write_weights(dst, _stored(((n, store.get(n)) for n in store.names()), method), max_shard_bytes, progress)
    return dst


def default_generation_config() -> dict[str, Any]:
    from horizon.chat import DEFAULT_THINKING_BUDGETS

    return {"thinking_budgets": dict(DEFAULT_THINKING_BUDGETS), "temperature": 1.0, "top_p": 1.0}


def load_generation_config(path: str | Path) -> dict[str, Any]:
    """generation_config.json of a checkpoint merged over the defaults (missing file: the defaults)."""
    gen = default_generation_config()
    file = Path(path) / GENERATION_CONFIG
    if file.exists():
        gen.update(_read_json(file))
    return gen


def _save_tokenizer(path: Path, tokenizer) -> None:
    from horizon.chat.tokenizer import BUNDLED_TOKENIZER

    if tokenizer is None:
        if not (path / TOKENIZER).exists():
            shutil.copyfile(BUNDLED_TOKENIZER, path / TOKENIZER)
    else:
        tokenizer.save(path / TOKENIZER)


# --- load ----------------------------------------------------------------------------------------------
def load(path: str | Path, dtype: torch.dtype | None = None, device="cpu") -> HorizonForCausalLM:
    """Load a Horizon checkpoint folder, or a supported Hugging Face one (see horizon.interop)."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: not a checkpoint folder")
    raw = _read_json(path / CONFIG)
    model_type = raw.get("model_type")
    if model_type == ModelConfig.model_type:
        quant = raw.pop("quantization_config", None)
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        if method not in (None, *QUANT_METHODS):
            raise ValueError(f"{path / CONFIG}: quantization_config quant_method={method!r} is not supported; "
                             f"allowed: {', '.join(QUANT_METHODS)}")
        try:
            config = ModelConfig.from_dict(raw)
        except ValueError as e:
            raise ValueError(f"{path / CONFIG}: {e}") from None
        store = TensorStore(path)
        model = build_model(config, dtype, device, quantization=method)
        fill_model(model, ((_canonical_name(n), store.get(n), str(store.path_of(n))) for n in store.names()))
    else:
        from horizon import interop

        family = interop.family(model_type, path / CONFIG)
        try:
            config = family.config_from_hf(raw)
        except ValueError as e:
            raise ValueError(f"{path / CONFIG}: {e}") from None
        store = TensorStore(path)
        model = build_model(config, dtype, device)
        fill_model(model, family.convert_tensors(store, config))
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    return model.eval()


# --- a model ready to serve ----------------------------------------------------------------------------
BUNDLED = "bundled"  # the name `open_model` accepts for the model Horizon ships
RANDOM = "tiny-random"  # the random-weight tiny model (tests, and a fallback)
BUNDLED_DIR = Path(__file__).parent / "assets" / "horizon-tiny"


@dataclass
class Bundle:
    model: HorizonForCausalLM
    tokenizer: Any
    generation_config: dict[str, Any]
    source: str  # where it came from, for logs and /v1/models


def open_model(path: str | Path | None = None, dtype: torch.dtype | None = None, device="cpu") -> Bundle:
    """Model, tokenizer and generation config of a checkpoint folder, or of a model Horizon ships.

    None or "bundled": the trained `horizon-tiny` shipped in `horizon/assets/horizon-tiny` (MXFP4
    experts), or the random model below if a checkout lacks it. "tiny-random": the `tiny` preset with
    random weights from a fixed seed, the same on every machine (it speaks the chat format's tokens
    but not sense; the tests use it because its behaviour does not change when the bundled model is
    retrained).
    """
    from horizon.chat import load_tokenizer

    if str(path) == RANDOM or ((path is None or str(path) == BUNDLED) and not (BUNDLED_DIR / CONFIG).is_file()):
        model = HorizonForCausalLM(ModelConfig.preset("tiny"), init=False)
        model.init_weights(seed=0)  # the same weights on every machine
        model = model.to(device=device, dtype=dtype or torch.float32)
        return Bundle(model.eval(), load_tokenizer(), default_generation_config(), "bundled:tiny-random")
    if path is None or str(path) == BUNDLED:
        model = load(BUNDLED_DIR, dtype=dtype, device=device)
        return Bundle(model, load_tokenizer(BUNDLED_DIR), load_generation_config(BUNDLED_DIR), "bundled:horizon-tiny")
    model = load(path, dtype=dtype, device=device)
    return Bundle(model, load_tokenizer(path), load_generation_config(path), str(path))
