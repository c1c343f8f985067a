"""The model runner on a CUDA GPU: compiled decode steps (inductor + CUDA graphs, mode "reduce-overhead") ==
the eager reference, in fp32 and with MXFP4 experts (the Triton kernel inside the graph), and the engine on
top of it. Skipped without a GPU (CI has none); tests/test_runner.py checks the same runner on the CPU.

One runner pair per model is shared by the checks of this module (each graph compiles once).
"""

import copy

import pytest
import torch

from horizon.engine import Engine, EngineConfig, Request, SamplingParams
from horizon.engine.runner import ModelRunner, StepInputs
from horizon.model import HorizonCache

from .conftest import tiny_model
from .test_runner import TOPK, close, decode_both, graphs, load_tok, prefill, prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def cudagraph_skips() -> int:
    """Graphs that cudagraph trees ran without CUDA graphs (a mutated input, a CPU tensor, ...)."""
    return torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]


def runners(model):
    def runner(compile: bool) -> ModelRunner:
        return ModelRunner(model, HorizonCache(model.config, 4, 128, dtype=torch.float32, device="cuda",
                                               block_size=16), compile=compile, buckets=(1, 4))
    return runner(True), runner(False)


@pytest.fixture(scope="module")
def model():
    return tiny_model().cuda()


@pytest.fixture(scope="module")
def pair(model):
    return runners(model)


@pytest.fixture(scope="module")
def mxfp4_pair(model):
    from horizon.quant import quantize_model
    from horizon.quant.kernels import mxfp4_kernel_runs_on

    if not mxfp4_kernel_runs_on(torch.device("cuda")):
        pytest.skip("triton does not import here: MXFP4 experts on CUDA take the dequantising reference")
    return runners(quantize_model(copy.deepcopy(model)))


@pytest.mark.parametrize("lengths", [(6,), (3, 7, 5)], ids=["bucket1", "bucket4-padded"])
@pytest.mark.parametrize("which", ["fp32", "mxfp4"])
def test_compiled_decode_matches_eager_on_both_sides_of_topk(request, which, lengths):
    pair = request.getfixturevalue("pair" if which == "fp32" else "mxfp4_pair")
    skips = cudagraph_skips()
    ps = prompts(*lengths)
    prefill(pair, ps)
    steps = decode_both(pair, ps, TOPK + 6 - min(lengths))  # dense attention, then the indexer's selection
    errors = [(a - b).abs().max().item() / max(1.0, b.abs().max().item()) for a, b in steps]
    assert max(errors) <= 1e-5, errors
    assert {(pair[0].bucket(len(ps)), sparse) for sparse in (False, True)} <= pair[0].graphs_seen
    assert cudagraph_skips() == skips  # the steps ran as CUDA graphs, not inductor's kernels one by one


def test_logits_outlive_the_next_replay(pair):
    """A CUDA graph's output buffer is overwritten by the next replay: run() hands out a copy."""
    ps = prompts(6)
    prefill(pair, ps)
    step = StepInputs([[ps[0][-1]]], [len(ps[0])], [0])
    first = pair[0].run(step)
    kept = first.clone()
    pair[0].run(StepInputs([[ps[0][-1]]], [len(ps[0]) + 1], [0]))
    assert torch.equal(first, kept)


def test_no_recompiles_and_few_recordings_as_the_context_grows(pair):
    ps = prompts(TOPK + 2)
    prefill(pair, ps)
    decode_both(pair, ps, 2)
    before = graphs()
    steps = decode_both(pair, ps, 90)  # context 20 -> 110: widths 32, 64, 128 (the cache's max_len)
    assert graphs() == before
    assert all(close(a, b) for a, b in steps)


def test_compiled_engine_generates_what_the_eager_engine_does(model):
    """Greedy output, batched and alone, over paged blocks the scheduler assigns while decoding."""
    cfg = dict(max_num_seqs=4, max_batch_tokens=64, max_model_len=256, block_size=16)
    compiled, eager = (Engine(model, load_tok(), EngineConfig(**cfg, compile=c)) for c in (True, False))
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    ps = prompts(5, 12, 3)
    want = [r.token_ids for r in eager.generate([Request(p, params) for p in ps])]
    assert [r.token_ids for r in compiled.generate([Request(p, params) for p in ps])] == want
    assert compiled.generate([Request(ps[1], params)])[0].token_ids == want[1]
    assert compiled.runner.graphs_seen
