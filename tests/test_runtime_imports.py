"""At run time horizon imports none of its test references (transformers, torchao, flash-linear-attention), nor
triton off CUDA (horizon.quant.kernels.mxfp4_triton, imported on the first CUDA MXFP4 call only)."""

import subprocess
import sys

SCRIPT = r'''
import importlib.abc, pkgutil, sys
BLOCKED = ("transformers", "torchao", "fla", "triton", "mlx", "mlx_lm")
GPU_ONLY = ("horizon.quant.kernels.mxfp4_triton",)  # the Triton kernel: CUDA only

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"blocked at run time: {name}")
        return None

sys.meta_path.insert(0, Block())
import torch, horizon
for mod in pkgutil.walk_packages(horizon.__path__, "horizon."):
    if mod.name not in GPU_ONLY:
        __import__(mod.name)
from horizon import ModelConfig
from horizon.model import HorizonForCausalLM
from horizon.cli import main
model = HorizonForCausalLM(ModelConfig.preset("tiny"))
cache = model.new_cache(1, 8)
model(torch.tensor([[1, 2, 3]]), cache=cache)
model(torch.tensor([[4]]), cache=cache)
from horizon.quant import quantize_model
qmodel = quantize_model(HorizonForCausalLM(ModelConfig.preset("tiny")))  # MXFP4 experts on the CPU
qcache = qmodel.new_cache(1, 8)
qmodel(torch.tensor([[1, 2, 3]]), cache=qcache)
qmodel(torch.tensor([[4]]), cache=qcache)
assert main(["plan", "--preset", "2.8t", "--json"]) == 0
k3 = HorizonForCausalLM(ModelConfig.preset("tiny").replace(  # Kimi K3's pieces
    hidden_act="situ", attn_res_block_size=2, kda_gate_lower_bound=-5.0, kda_gate_full_rank=True, dsa_gate_rank=0,
    dsa_gate_full_rank=True, index_n_heads=0, moe_latent_size=32, moe_latent_norm=True, n_group=1, vision_layers=0))
k3(torch.tensor([[1, 2, 3]]))
loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED or m in GPU_ONLY)
assert not loaded, loaded
print("ok")
'''


def test_horizon_runs_with_test_references_blocked():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")
