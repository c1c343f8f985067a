"""`horizon inspect DIR`: a checkpoint checked from its config.json and safetensors headers alone.

No tensor data is read (a 1.4 TB Kimi K3 folder is inspected in seconds): the config is translated as
`horizon.load` would, every tensor the loader expects is looked up in the shard index and the headers
(name, shape, dtype), and every stored tensor the loader would not use is reported. Then the counts,
bytes and the deployment plan (horizon.plan) of the model the folder describes. A folder with problems
is one ValueError listing them (the first 20), as `load` would have failed on the first.

Kimi K3 folders (the released layout, horizon.interop.kimi_k3) and Horizon's own are checked tensor by
tensor; for the other imported families the translation and the plan are shown, not the tensor check.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from horizon.checkpoint import TensorStore, read_config

FLOATS = {"F32", "F16", "BF16", "F64"}


def _k3_expected(config, store: TensorStore) -> dict[str, tuple[tuple[int, ...], set[str]]]:
    from horizon.interop import kimi_k3
    from horizon.quant.mxfp4 import BLOCK

    names = store.names()
    prefix = kimi_k3.PREFIX if any(n.startswith(kimi_k3.PREFIX) for n in names) else ""
    want: dict[str, tuple[tuple[int, ...], set[str]]] = {}
    for theirs, _ours, how, shape in kimi_k3.tensor_table(config):
        if how == "a_log":  # [H] or zero-padded: the length is checked when the values are read
            stored = store.shape(prefix + theirs) if prefix + theirs in store.file_of else shape
            shape = stored if len(stored) == 1 and stored[0] >= shape[0] else shape
        want[prefix + theirs] = (shape, FLOATS)
    packed = config.extra.get("experts") == "mxfp4"
    for i in range(config.num_layers):
        if not config.is_moe_layer(i):
            continue
        for stem, ours, _e, _row, rows in kimi_k3.expert_table(config, i):
            cols = kimi_k3._expert_cols(config, ours)
            if packed:
                want[prefix + stem + ".weight_packed"] = ((rows, cols // 2), {"U8"})
                want[prefix + stem + ".weight_scale"] = ((rows, cols // BLOCK), {"U8"})
            else:
                want[prefix + stem + ".weight"] = ((rows, cols), FLOATS)
    return want


def _horizon_expected(config, method) -> dict[str, tuple[tuple[int, ...], set[str]]]:
    import torch

    from horizon.model.model import HorizonForCausalLM
    from horizon.quant import canonical_name, empty_quantized_model

    with torch.device("meta"):
        model = HorizonForCausalLM(config, init=False)
        if method == "mxfp4":
            empty_quantized_model(model)
    out = {}
    for name, t in model.state_dict().items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        out[canonical_name(name)] = (tuple(t.shape), FLOATS if t.dtype.is_floating_point else {"U8"})
    return out


def inspect_checkpoint(folder: str | Path) -> dict[str, Any]:
    """The report of a checkpoint folder (see the module docstring); ValueError listing its problems."""
    from horizon.plan import plan

    folder = Path(folder)
    config, method, family = read_config(folder)
    store = TensorStore(folder)  # headers only: no tensor is read, no shard mapped
    names = store.names()
    kind = "horizon" if family is None else family.FAMILY
    expected = None
    if family is None:
        expected = _horizon_expected(config, method)
    elif kind == "kimi_k3":
        expected = _k3_expected(config, store)
    problems: list[str] = []
    by_dtype: Counter[str] = Counter()
    for name in names:
        by_dtype[store.dtype(name)] += store.nbytes(name)
    if expected is not None:
        for name, (shape, dtypes) in expected.items():
            if name not in store.file_of:
                problems.append(f"tensor {name} is missing (expected {list(shape)})")
                continue
            got, dtype = store.shape(name), store.dtype(name)
            if got != shape:
                problems.append(f"{store.path_of(name).name}: tensor {name} has shape {list(got)}, "
                                f"expected {list(shape)}")
            if dtype not in dtypes:
                problems.append(f"{store.path_of(name).name}: tensor {name} has dtype {dtype}, "
                                f"expected {' or '.join(sorted(dtypes))}")
        from horizon.interop.kimi_k3 import VISION_PREFIXES  # skipped by the loader, with a note

        unexpected = [n for n in names if n not in expected and not n.startswith(VISION_PREFIXES)]
        problems += [f"{store.path_of(n).name}: tensor {n} is not part of this model" for n in unexpected[:20]]
    if problems:
        more = f" (and {len(problems) - 20} more)" if len(problems) > 20 else ""
        raise ValueError(f"{folder}: {len(problems)} problem(s): " + "; ".join(problems[:20]) + more)
    p = plan(config)
    return {
        "folder": str(folder), "format": kind, "experts": method or "unquantised",
        "tensors": len(names), "shards": len(set(store.file_of.values())),
        "bytes": sum(by_dtype.values()), "bytes_by_dtype": dict(sorted(by_dtype.items())),
        "checked": expected is not None,
        "config": {k: v for k, v in config.to_dict().items() if k not in ("extra",)},
        "plan": p,
    }


def render_inspection(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from horizon.plan import _human, render_plan

    table = Table(title=f"horizon inspect: {report['folder']}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("format", f"{report['format']} (routed experts: {report['experts']})")
    table.add_row("tensors / shards", f"{report['tensors']:,} in {report['shards']}")
    table.add_row("stored bytes", _human(report["bytes"]))
    for dtype, n in report["bytes_by_dtype"].items():
        table.add_row(f"  {dtype}", _human(n))
    table.add_row("names, shapes, dtypes", "checked: as the loader expects" if report["checked"]
                  else "not checked for this format (config translated only)")
    Console().print(table)
    render_plan(report["folder"], report["plan"])
