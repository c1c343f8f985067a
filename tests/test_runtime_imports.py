"""At run time horizon imports none of its test references (transformers, torchao, flash-linear-attention)."""

import subprocess
import sys

SCRIPT = r'''
import importlib.abc, pkgutil, sys
BLOCKED = ("transformers", "torchao", "fla", "triton")

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"blocked at run time: {name}")
        return None

sys.meta_path.insert(0, Block())
import torch, horizon
for mod in pkgutil.walk_packages(horizon.__path__, "horizon."):
    __import__(mod.name)
from horizon import ModelConfig
from horizon.model import HorizonForCausalLM
from horizon.cli import main
model = HorizonForCausalLM(ModelConfig.preset("tiny"))
cache = model.new_cache(1, 8)
model(torch.tensor([[1, 2, 3]]), cache=cache)
model(torch.tensor([[4]]), cache=cache)
assert main(["plan", "--preset", "2.8t", "--json"]) == 0
loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
assert not loaded, loaded
print("ok")
'''


def test_horizon_runs_with_test_references_blocked():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")
