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
    model = horizon.load("ckpt/", check_finite=True)   # also refuse NaN/Inf weights (check_finite_weights)
    model = horizon.load("ckpt/", dense="int8")        # dense projections as int8 (a load-time format)

`load` also reads Hugging Face folders of other model families (`horizon.interop`): their config
is translated to a ModelConfig and their tensors renamed, so they run on the one Horizon model.
Every way a checkpoint can be broken (a missing or truncated shard, a tensor of the wrong shape, a
missing or unexpected tensor, an unknown model_type) is a ValueError naming the file and tensor.
So is a config.json that lacks a field or holds a value of the wrong type (`ModelConfig.from_dict`),
and a generation_config.json whose keys Horizon reads are wrong (`validate_generation_config`; keys
Horizon does not read, such as Hugging Face's eos_token_id or do_sample, are kept and ignored).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from horizon.config import ModelConfig
from horizon.model.model import HorizonForCausalLM
from horizon.parallel.shard import Layout, model_splits, read_shard, shard_model, shard_tensor
from horizon.quant import canonical_name as _canonical_name  # `<name>.blocks` (gpt-oss) -> `<name>_blocks`
from horizon.quant import empty_quantized_model
from horizon.quant.int8 import Int8Linear, quantize_dense_int8
from horizon.quant.layers import MXFP4Experts, MXFP4Linear, set_int8_activations
from horizon.quant.mxfp4 import BLOCK as MXFP4_BLOCK
from horizon.quant.mxfp4 import E8M0_BIAS
from horizon.quant.mxfp4 import dequantize as mxfp4_dequantize
from horizon.quant.mxfp4 import quantize as mxfp4_quantize

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
TOKENIZER = "tokenizer.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 4 * 1024**3
QUANT_METHODS = ("mxfp4",)
DENSE_FORMATS = ("int8",)  # load-time formats of the dense projections (`load(dense=...)`); None: as stored
MXFP4_ACTIVATIONS = ("int8",)  # what MXFP4 layers round their inputs to (`load(mxfp4_activations=...)`); None: fp32


# --- reading tensors -------------------------------------------------------------------------------
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                       "F8_E5M2": torch.float8_e5m2}
MAX_HEADER = 512 * 1024**2  # a safetensors header larger than this is not one


def read_header(path: Path) -> tuple[dict[str, dict], int]:
    """(the tensor entries of a safetensors file's JSON header {name: {dtype, shape, data_offsets}}, where the
    data starts), read without mapping the file; ValueError if it is unreadable or shorter than it declares."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ValueError(f"{path}: not a readable safetensors file (truncated or corrupt?): shorter than "
                                 f"its 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER:
                raise ValueError(f"{path}: not a readable safetensors file (truncated or corrupt?): header "
                                 f"length {n}")
            header = json.loads(fh.read(n))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a readable safetensors file (truncated or corrupt?): {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a readable safetensors file: its header is not a JSON object")
    header.pop("__metadata__", None)
    end = 0
    for name, entry in header.items():
        try:
            a, b = entry["data_offsets"]
            ok = entry["dtype"] in _SAFETENSORS_DTYPES and isinstance(entry["shape"], list) and 0 <= a <= b
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"{path}: tensor {name}: a header entry safetensors does not define: {entry!r}")
        end = max(end, b)
    size = path.stat().st_size
    if size < 8 + n + end:
        raise ValueError(f"{path}: truncated: {size} bytes, its header declares {8 + n + end}")
    return header, 8 + n


class TensorStore:
    """The tensors of a checkpoint folder (one file or an index of shards), read lazily by name.

    The headers are read at once (names, shapes, dtypes; a truncated shard is refused before anything
    loads). A whole tensor is read with one positioned read into a fresh tensor, not through a memory
    map, so a loader holds no mapped shard pages: its peak memory is the model plus the tensor in flight
    (bench/k3_load_memory.py). A slice (a tensor-parallel rank's part) is read through safetensors'
    mapped slices, which touch only its bytes.
    """

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
        self._entry: dict[str, dict] = {}
        self._data_start: dict[str, int] = {}
        self._handles: dict[str, Any] = {}  # safetensors handles, opened for slice reads only
        self._files: dict[str, Any] = {}  # unbuffered file objects, opened once per shard for whole reads
        for name in files:
            path = self.folder / name
            if not path.exists():
                needed = [t for t, f in (weight_map or {}).items() if f == name]
                raise ValueError(f"{path}: shard listed in {INDEX} is missing "
                                 f"({len(needed)} tensors, e.g. {needed[:3]})")
            header, start = read_header(path)
            self._data_start[name] = start
            for key, entry in header.items():
                if key in self.file_of:
                    raise ValueError(f"{path}: tensor {key} is also in {self.file_of[key]}")
                self.file_of[key] = name
                self._entry[key] = entry
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
        return tuple(self._entry[name]["shape"])

    def dtype(self, name: str) -> str:
        """The stored dtype's safetensors code (F32, BF16, U8, ...)."""
        return self._entry[name]["dtype"]

    def nbytes(self, name: str) -> int:
        """Bytes of one tensor's data, from the header."""
        a, b = self._entry[name]["data_offsets"]
        return b - a

    def get(self, name: str, split=None, layout: Layout | None = None) -> torch.Tensor:
        """The tensor; with a split (horizon.parallel.shard), only this rank's part of it is read."""
        if split is not None:
            return read_shard(self._slice(name), self.shape(name), split, layout)
        entry, path = self._entry[name], self.path_of(name)
        dtype, shape = _SAFETENSORS_DTYPES[entry["dtype"]], self.shape(name)
        a, b = entry["data_offsets"]
        if (b - a) != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{path}: tensor {name}: {b - a} bytes for shape {list(shape)} of {entry['dtype']}")
        file = self.file_of[name]
        if file not in self._files:
            self._files[file] = open(path, "rb", buffering=0)  # kept open for the store's lifetime
        out = torch.empty(b - a, dtype=torch.uint8)
        view = memoryview(out.numpy())
        done = 0
        while done < len(view):  # one positioned read; the loop only for reads the kernel returns short
            got = os.preadv(self._files[file].fileno(), [view[done:]], self._data_start[file] + a + done)
            if got <= 0:
                raise ValueError(f"{path}: cannot read tensor {name} (truncated file?)")
            done += got
        return out.view(dtype).reshape(shape)

    def _slice(self, name: str):
        file = self.file_of[name]
        if file not in self._handles:
            path = self.folder / file
            try:
                self._handles[file] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as e:
                raise ValueError(f"{path}: not a readable safetensors file (truncated or corrupt?): {e}") from None
            except RuntimeError as e:  # the file could not be memory-mapped (address space or overcommit limits)
                raise ValueError(f"{path}: cannot map the shard into memory: {e}") from None
        try:
            return self._handles[file].get_slice(name)
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
                quantization: str | None = None, layout: Layout | None = None) -> HorizonForCausalLM:
    """A model with uninitialised weights on `device` (built on the meta device first: no init cost);
    with a tensor-parallel layout, only this rank's part of each weight is allocated."""
    with torch.device("meta"):
        model = HorizonForCausalLM(config, init=False)
    if quantization == "mxfp4":
        empty_quantized_model(model)
    model = model.to(dtype or config.torch_dtype)
    if layout is not None:
        shard_model(model, layout)
    model.to_empty(device=device)
    model.reset_runtime_state()
    return model


def fill_model(model: HorizonForCausalLM, tensors: Iterator[tuple]) -> None:
    """Copy (name, tensor, source file) triples into the model, checking names, shapes and kinds of dtype; all
    must be present. A 4-tuple (name, tensor, source, index) fills `target[index]` only (one expert of a
    stacked tensor, so a loader never holds a second copy of the stack); such a tensor counts as present once
    its parts covered every element."""
    target = model.state_dict()
    tied = model.config.tie_word_embeddings
    seen = set()
    filled: dict[str, int] = {}  # elements written through indexed parts
    for name, tensor, source, *index in tensors:
        if name not in target:
            raise ValueError(f"{source}: tensor {name} is not part of this model "
                             f"({type(model).__name__}, {len(target)} tensors)")
        want = target[name][index[0]] if index else target[name]
        if tuple(tensor.shape) != tuple(want.shape):
            raise ValueError(f"{source}: tensor {name}{'' if not index else ' (part)'} has shape "
                             f"{list(tensor.shape)}, expected {list(want.shape)}")
        if tensor.dtype.is_floating_point != want.dtype.is_floating_point:
            raise ValueError(f"{source}: tensor {name} has dtype {tensor.dtype}, expected {want.dtype}")
        want.copy_(tensor)
        if not index:
            seen.add(name)
        else:
            filled[name] = filled.get(name, 0) + want.numel()
            if filled[name] >= target[name].numel():
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
    # Checked before anything is written: a checkpoint must not be saved that its own loader refuses.
    gen = validate_generation_config(generation_config or {}, f"{path / GENERATION_CONFIG} (being written)")
    (path / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    (path / GENERATION_CONFIG).write_text(json.dumps(gen, indent=2) + "\n")
    _save_tokenizer(path, tokenizer)


def _check_quantize(quantize: str | None) -> None:
    if quantize not in (None, *QUANT_METHODS):
        raise ValueError(f"quantize={quantize!r} is not supported; allowed: None, {', '.join(QUANT_METHODS)}")


def save(model: HorizonForCausalLM, path: str | Path, quantize: str | None = None, tokenizer=None,
         generation_config: dict[str, Any] | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write a checkpoint folder; `quantize="mxfp4"` stores the routed experts as MXFP4 (docs/design.md §2)."""
    _check_quantize(quantize)
    # Int8Linear's weight_int8 / weight_scale would be written under names no loader accepts: refuse
    # before anything touches the folder
    if any(isinstance(m, Int8Linear) for m in model.modules()):
        raise ValueError("int8 dense weights are a load-time format; save the full-precision model "
                         "(load it without dense='int8') instead")
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
    gen = load_generation_config(src)  # checked against the source file's name, not the copy's
    tokenizer = None
    if (src / TOKENIZER).exists():
        shutil.copyfile(src / TOKENIZER, dst / TOKENIZER)
    _write_metadata(dst, raw, method, gen, tokenizer)

    write_weights(dst, _stored(((n, store.get(n)) for n in store.names()), method), max_shard_bytes, progress)
    return dst


def default_generation_config() -> dict[str, Any]:
    from horizon.chat import DEFAULT_THINKING_BUDGETS

    return {"thinking_budgets": dict(DEFAULT_THINKING_BUDGETS), "temperature": 1.0, "top_p": 1.0}


def validate_generation_config(gen: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`gen` merged over `default_generation_config()`, with every key Horizon reads checked.

    thinking_budgets: some of low/high/max -> integers >= 1, merged per tier over the defaults and
    ordered (`horizon.chat.thinking.check_thinking_budgets`); temperature: a finite number >= 0;
    top_p: a number in (0, 1]. Other keys are kept as they are: Hugging Face generation configs carry
    many (bos_token_id, eos_token_id, do_sample, max_new_tokens, ...) that Horizon does not read.
    A ValueError starts with `where` (the file, or whoever passed the dict) and names the key, the
    value and what is allowed.
    """
    from horizon.chat.thinking import as_json, check_thinking_budgets

    if not isinstance(gen, Mapping):
        raise ValueError(f"{where}: a generation config must be a JSON object, got {as_json(gen)}")
    out = {**default_generation_config(), **gen}
    out["thinking_budgets"] = check_thinking_budgets(gen.get("thinking_budgets", {}), where)
    for key, ok, allowed in (
            ("temperature", lambda v: v >= 0, "a finite number >= 0"),
            ("top_p", lambda v: 0 < v <= 1, "a number in (0, 1]")):
        value = out[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not ok(value):
            raise ValueError(f"{where}: {key}={as_json(value)}; allowed: {allowed}")
    return out


def load_generation_config(path: str | Path) -> dict[str, Any]:
    """generation_config.json of a checkpoint merged over the defaults and checked (missing file: the
    defaults); see `validate_generation_config`."""
    file = Path(path) / GENERATION_CONFIG
    return validate_generation_config(_read_json(file) if file.exists() else {}, str(file))


def _save_tokenizer(path: Path, tokenizer) -> None:
    from horizon.chat.tokenizer import BUNDLED_TOKENIZER

    if tokenizer is None:
        if not (path / TOKENIZER).exists():
            shutil.copyfile(BUNDLED_TOKENIZER, path / TOKENIZER)
    else:
        tokenizer.save(path / TOKENIZER)


# --- load ----------------------------------------------------------------------------------------------
_NONFINITE_CHUNK = 1 << 24  # elements tested at once: bounds the bool temporary (16 MB) on huge tensors


def _count_nonfinite(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    # The screen: min and max are both finite exactly when every value is (NaN propagates through
    # both, +Inf is the max, -Inf the min), and one aminmax pass costs ~1/30 of isfinite().all() on
    # CPU (no bool temporary). Only a tensor that fails it is counted.
    low, high = torch.aminmax(t.detach())
    if bool(torch.isfinite(low) & torch.isfinite(high)):
        return 0
    flat = t.detach().reshape(-1)
    return sum(int((~torch.isfinite(part)).sum()) for part in flat.split(_NONFINITE_CHUNK))


def _mxfp4_nonfinite(blocks: torch.Tensor, scales: torch.Tensor, size: int, dtype: torch.dtype) -> int:
    """Non-finite values the packed weight decodes to in `dtype` (what the model computes with).

    Packed bytes hold no NaN; only the E8M0 scale can make one: byte 0xFF is NaN in the MX spec (and
    `dequantize` decodes that whole block to NaN), and a scale so large that 6 * 2^(s - 127), E2M1's
    largest magnitude, exceeds `dtype`'s range may overflow to Inf. `quantize` writes neither, so the
    scales alone (1/16 of the bytes) are read, and only the blocks they flag are decoded; padding
    columns past `size` are not counted.
    """
    limit = E8M0_BIAS + math.floor(math.log2(torch.finfo(dtype).max / 6))  # largest scale byte that cannot overflow
    if scales.numel() == 0 or int(scales.max()) <= limit:  # one reduction, no bool temporary: the usual case
        return 0
    suspect = scales > limit
    values = mxfp4_dequantize(blocks[suspect], scales[suspect], dtype).view(-1, MXFP4_BLOCK)  # [K blocks, 32]
    column = suspect.nonzero()[:, -1:] * MXFP4_BLOCK + torch.arange(MXFP4_BLOCK, device=scales.device)
    return int((~torch.isfinite(values) & (column < size)).sum())


def _packed_weights(module: torch.nn.Module) -> list[tuple[str, int]]:
    """(name, logical columns) of each MXFP4 weight a module holds as `<name>_blocks` / `<name>_scales`."""
    if isinstance(module, MXFP4Experts):
        return [("gate_up_proj", module.dim), ("down_proj", module.hidden)]
    if isinstance(module, MXFP4Linear):
        return [("weight", module.in_features)]
    return []


def check_finite_weights(model: HorizonForCausalLM, source: str) -> None:
    """ValueError unless every floating parameter and buffer is finite and every MXFP4 weight decodes to
    finite values; it names `source`, the first tensors at fault and how many values are NaN/Inf.

    One NaN in a weight turns every logit it reaches into NaN: the server would then answer each
    request with garbage or an error, far from the cause; this finds it at load, before serving.
    """
    dtype = model.embed.weight.dtype  # the activations' dtype: MXFP4 experts decode into it
    bad: list[tuple[str, int]] = []
    for name, t in chain(model.named_parameters(), model.named_buffers()):
        if t.is_floating_point() and (n := _count_nonfinite(t)):
            bad.append((name, n))
    for prefix, module in model.named_modules():
        for packed, size in _packed_weights(module):
            n = _mxfp4_nonfinite(getattr(module, f"{packed}_blocks"), getattr(module, f"{packed}_scales"), size, dtype)
            if n:
                bad.append((f"{prefix}.{packed}", n))
    if bad:
        shown = ", ".join(f"{name} ({n})" for name, n in bad[:5])
        if len(bad) > 5:
            shown += f", and {len(bad) - 5} more"
        raise ValueError(f"{source}: {sum(n for _, n in bad)} non-finite weight value(s) (NaN/Inf) in {len(bad)} "
                         f"tensor(s): {shown}. The checkpoint is corrupt (a diverged run or a bad conversion?); "
                         "to load it anyway skip this check: check_finite=False, or `horizon serve --no-weight-check`")


def _check_formats(dense: str | None, mxfp4_activations: str | None = None) -> None:
    if dense not in (None, *DENSE_FORMATS):
        raise ValueError(f"dense={dense!r} is not supported; allowed: None (the stored weights), "
                         f"{', '.join(map(repr, DENSE_FORMATS))}")
    if mxfp4_activations not in (None, *MXFP4_ACTIVATIONS):
        raise ValueError(f"mxfp4_activations={mxfp4_activations!r} is not supported; allowed: None (fp32), "
                         f"{', '.join(map(repr, MXFP4_ACTIVATIONS))}")


def _apply_formats(model: HorizonForCausalLM, source: str, dense: str | None, mxfp4_activations: str | None) -> None:
    """The load-time choices, in place: int8 dense projections, int8 activations into the MXFP4 layers."""
    if dense == "int8":
        quantize_dense_int8(model)
    if mxfp4_activations == "int8" and not set_int8_activations(model):
        raise ValueError(f"{source}: mxfp4_activations='int8' rounds the inputs of MXFP4 layers, and this model has "
                         "none (its experts are stored in full precision; `horizon quantize` makes an MXFP4 copy)")


def read_config(path: Path):
    """(the ModelConfig, the quantization method or None, the interop family or None for a Horizon folder)
    of a checkpoint folder, from its config.json alone."""
    if not path.is_dir():
        raise ValueError(f"{path}: not a checkpoint folder")
    raw = _read_json(path / CONFIG)
    model_type = raw.get("model_type")
    if model_type != ModelConfig.model_type:
        from horizon import interop

        family = interop.family(model_type, path / CONFIG)
        try:
            method = family.quantization(raw) if hasattr(family, "quantization") else None
            return family.config_from_hf(raw), method, family
        except ValueError as e:
            raise ValueError(f"{path / CONFIG}: {e}") from None
    quant = raw.pop("quantization_config", None)
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if method not in (None, *QUANT_METHODS):
        raise ValueError(f"{path / CONFIG}: quantization_config quant_method={method!r} is not supported; "
                         f"allowed: {', '.join(QUANT_METHODS)}")
    try:
        return ModelConfig.from_dict(raw), method, None
    except ValueError as e:
        raise ValueError(f"{path / CONFIG}: {e}") from None


def load(path: str | Path, dtype: torch.dtype | None = None, device="cpu", check_finite: bool = False,
         dense: str | None = None, layout: Layout | None = None,
         mxfp4_activations: str | None = None) -> HorizonForCausalLM:
    """Load a Horizon checkpoint folder, or a supported Hugging Face one (see horizon.interop).

    check_finite: after filling the model, refuse NaN/Inf weights (`check_finite_weights`).
    dense: "int8" swaps the dense projections for int8 ones after loading (`quantize_dense_int8`;
    ~1/4 of fp32's bytes); such a model cannot be saved.
    mxfp4_activations: "int8" rounds what the MXFP4 layers multiply to int8 per 32 values first
    (`set_int8_activations`: faster, not exact; docs/model.md); a model without MXFP4 layers is refused.
    layout: this rank's part of a tensor / expert-parallel model (horizon.parallel.shard). A Horizon
    checkpoint is read slice by slice; another family's tensors are converted one at a time, then cut.
    """
    _check_formats(dense, mxfp4_activations)
    path = Path(path)
    config, method, family = read_config(path)
    if family is None:
        store = TensorStore(path)
        model = build_model(config, dtype, device, quantization=method, layout=layout)
        splits = model_splits(model, layout) if layout is not None else {}
        fill_model(model, ((_canonical_name(n), store.get(n, splits.get(_canonical_name(n)), layout),
                            str(store.path_of(n))) for n in store.names()))
    else:
        store = TensorStore(path)
        model = build_model(config, dtype, device, quantization=method, layout=layout)
        splits = model_splits(model, layout) if layout is not None else {}
        if getattr(family, "READS_RANK_PARTS", False):  # it reads only this rank's slices itself (Kimi K3)
            tensors = family.convert_tensors(store, config, layout=layout, splits=splits)
        else:
            tensors = family.convert_tensors(store, config)
            if layout is not None:
                tensors = _sharded(tensors, splits, layout)
        fill_model(model, tensors)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    if check_finite:
        check_finite_weights(model, str(path))
    _apply_formats(model, str(path), dense, mxfp4_activations)
    return model.eval()


def _sharded(tensors, splits, layout: Layout):
    """A family's converted tensors (read whole) cut to this rank's part."""
    for name, tensor, source in tensors:
        yield name, shard_tensor(tensor, splits[name], layout) if name in splits else tensor, source


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


def open_config(path: str | Path | None = None) -> tuple[ModelConfig, str | None]:
    """(config, quantization method) of what `open_model(path)` would open, without reading any weight."""
    if str(path) == RANDOM or ((path is None or str(path) == BUNDLED) and not (BUNDLED_DIR / CONFIG).is_file()):
        return ModelConfig.preset("tiny"), None
    config, method, _ = read_config(BUNDLED_DIR if path is None or str(path) == BUNDLED else Path(path))
    return config, method


def open_model(path: str | Path | None = None, dtype: torch.dtype | None = None, device="cpu",
               check_finite: bool = False, dense: str | None = None, layout: Layout | None = None,
               mxfp4_activations: str | None = None) -> Bundle:
    """Model, tokenizer and generation config of a checkpoint folder, or of a model Horizon ships.

    None or "bundled": the trained `horizon-tiny` shipped in `horizon/assets/horizon-tiny` (MXFP4
    experts), or the random model below if a checkout lacks it. "tiny-random": the `tiny` preset with
    random weights from a fixed seed, the same on every machine (it speaks the chat format's tokens
    but not sense; the tests use it because its behaviour does not change when the bundled model is
    retrained). check_finite: refuse a checkpoint with NaN/Inf weights (see `load`); the random
    model is made here, not read, and is not checked. dense, mxfp4_activations: as in `load`, for every source.
    layout: this rank's part of a tensor-parallel model (see `load`).
    """
    from horizon.chat import load_tokenizer

    _check_formats(dense, mxfp4_activations)
    if str(path) == RANDOM or ((path is None or str(path) == BUNDLED) and not (BUNDLED_DIR / CONFIG).is_file()):
        model = HorizonForCausalLM(ModelConfig.preset("tiny"), init=False)
        model.init_weights(seed=0)  # the same weights on every machine
        model = model.to(device=device, dtype=dtype or torch.float32)
        if layout is not None:
            shard_model(model, layout)
        _apply_formats(model, RANDOM, dense, mxfp4_activations)
        return Bundle(model.eval(), load_tokenizer(), default_generation_config(), "bundled:tiny-random")
    # The generation config first: a typo in it should not wait for (possibly minutes of) weights.
    if path is None or str(path) == BUNDLED:
        gen = load_generation_config(BUNDLED_DIR)
        model = load(BUNDLED_DIR, dtype=dtype, device=device, check_finite=check_finite, dense=dense, layout=layout,
                     mxfp4_activations=mxfp4_activations)
        return Bundle(model, load_tokenizer(BUNDLED_DIR), gen, "bundled:horizon-tiny")
    gen = load_generation_config(path)
    model = load(path, dtype=dtype, device=device, check_finite=check_finite, dense=dense, layout=layout,
                 mxfp4_activations=mxfp4_activations)
    return Bundle(model, load_tokenizer(path), gen, str(path))
