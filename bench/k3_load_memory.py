"""Peak memory while loading a Kimi K3-layout checkpoint: is it the model's bytes plus the largest tensor?

Writes a ~1 GB checkpoint in K3's released layout (random weights: a K3-shaped model of hidden 1024, 8
layers, 256 latent experts per MoE layer in MXFP4, exported with `horizon export`'s code), then loads it
in a fresh process and reports, as one JSON object:

    baseline_rss      RSS after importing horizon and torch, before loading
    peak_rss          the process's peak RSS (getrusage) after `horizon.load`
    model_bytes       bytes of the loaded model's tensors (what must be resident)
    largest_tensor    the largest stored tensor's bytes
    rss_anon_after, rss_file_after   after the load: heap (the tensors) and mapped shard pages (page cache)
    overhead          peak_rss - baseline_rss - model_bytes - largest_tensor (the "fixed margin"; < 0 is better)

    python bench/k3_load_memory.py [--out /tmp/k3-1gb] [--keep]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
from pathlib import Path


def write_checkpoint(out: Path) -> None:
    import torch

    from horizon.config import ModelConfig
    from horizon.interop.kimi_k3 import export
    from horizon.model.model import HorizonForCausalLM
    from horizon.quant import empty_quantized_model

    cfg = ModelConfig.preset("k3").replace(
        vocab_size=32768, hidden_size=1024, num_layers=8, intermediate_size=4096, max_position_embeddings=65536,
        kda_num_heads=16, kda_head_dim=64, num_heads=16, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64,
        qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
        moe_latent_size=512, attn_res_block_size=4)
    with torch.device("meta"):
        model = HorizonForCausalLM(cfg, init=False)
        empty_quantized_model(model)
    model = model.to(torch.bfloat16).to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if t.dtype == torch.uint8:  # packed experts: random nibbles, scales near 2^-10
                t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8) if name.endswith("_blocks")
                        else torch.randint(115, 119, t.shape, generator=gen, dtype=torch.uint8))
            else:
                t.copy_(torch.randn(t.shape, generator=gen) * 0.02)
    export(model, out, max_shard_bytes=256 * 1024**2)


def rss_bytes(field: str = "VmRSS") -> int:
    """A field of /proc/self/status in bytes: VmRSS (all resident), RssAnon (heap: tensors) or RssFile (mapped
    file pages: the safetensors shards the loader memory-maps, page cache the kernel may drop)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(folder: Path) -> dict:
    import torch  # noqa: F401  (imported before the baseline: its own memory is not the loader's)

    import horizon
    from horizon.checkpoint import TensorStore

    store = TensorStore(folder)
    largest = max(store.nbytes(n) for n in store.names())
    baseline = rss_bytes()
    model = horizon.load(folder)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    anon, mapped = rss_bytes("RssAnon"), rss_bytes("RssFile")  # after the load, while the shards stay mapped
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return {"baseline_rss": baseline, "peak_rss": peak, "model_bytes": model_bytes, "largest_tensor": largest,
            "stored_bytes": sum(store.nbytes(n) for n in store.names()),
            "rss_anon_after": anon, "rss_file_after": mapped,
            "overhead": peak - baseline - model_bytes - largest}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/k3-load-memory")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(Path(args.measure))))
        return 0
    out = Path(args.out)
    if not (out / "config.json").exists():
        write_checkpoint(out)
    child = subprocess.run([sys.executable, __file__, "--measure", str(out)], capture_output=True, text=True,
                           check=True)
    result = json.loads(child.stdout.strip().splitlines()[-1])
    result["bound_holds"] = result["overhead"] <= 256 * 1024**2  # a fixed margin of 256 MB
    print(json.dumps(result))
    if not args.keep:
        shutil.rmtree(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
