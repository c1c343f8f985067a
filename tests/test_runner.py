"""ModelRunner: compiled decode steps == the eager reference, bucket padding, no recompiles as the context grows.

Compiling is slow on 2 cores (tens of seconds a graph), so one runner and one engine are built per module
and every check shares their graphs: bucket 1 and bucket 4, each on both sides of the tiny preset's
index_topk (16), plus the engine's own graphs.
"""

import os
import subprocess
import sys
import threading

import pytest
import torch

from horizon import ModelConfig
from horizon.engine import Engine, EngineConfig, Request, SamplingParams
from horizon.engine.memory import unavailable
from horizon.engine.runner import ModelRunner, StepInputs
from horizon.model import HorizonCache, HorizonForCausalLM
from horizon.model.moe import MoE

from .conftest import rows_matmul_calls, tiny_model

TOPK = ModelConfig.preset("tiny").index_topk


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def model() -> HorizonForCausalLM:
    return tiny_model()


@pytest.fixture(scope="module")
def pair(model):
    """(compiled runner, eager runner), each over its own 4-slot cache."""
    def runner(compile: bool) -> ModelRunner:
        return ModelRunner(model, HorizonCache(model.config, 4, 128, dtype=torch.float32, block_size=16),
                           compile=compile, buckets=(1, 4))
    return runner(True), runner(False)


def prefill(runners, prompts):
    for r in runners:
        for slot, p in enumerate(prompts):
            r.cache.reset([slot])
            r.run(StepInputs([p], [0], [slot]))


def decode_both(runners, prompts, steps: int):
    """Greedy decode the slots 0..len(prompts)-1 in lockstep on both runners; the logits of every step."""
    compiled, eager = runners
    pos = [len(p) for p in prompts]
    nxt = [[p[-1]] for p in prompts]
    out = []
    for _ in range(steps):
        step = StepInputs(nxt, list(pos), list(range(len(prompts))))
        a, b = compiled.run(step), eager.run(step)
        out.append((a, b))
        nxt = [[int(t)] for t in b.argmax(-1)]
        pos = [x + 1 for x in pos]
    return out


def prompts(*lengths):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(40, 4000, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("lengths", [(6,), (3, 7, 5)], ids=["bucket1", "bucket4-padded"])
def test_compiled_decode_matches_eager_on_both_sides_of_topk(pair, lengths):
    ps = prompts(*lengths)
    prefill(pair, ps)
    # from below index_topk (dense attention) to past it (the indexer's selection): two graphs per bucket
    steps = decode_both(pair, ps, TOPK + 6 - min(lengths))
    for a, b in steps:
        assert a.shape == b.shape == (len(ps), pair[0].model.config.vocab_size)
        assert (a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item())
    assert {(pair[0].bucket(len(ps)), sparse) for sparse in (False, True)} <= pair[0].graphs_seen


def test_batched_projections_run_in_the_few_rows_kernel(pair):
    """At bucket 4 the graph pass sends the projections to rows_matmul; at bucket 1 only those over
    FUSED_ONE_ROW_MAX (the LM head), the rest stay inductor's own loops. The routed experts take the kernel
    at both. The parity with eager is the test above."""
    from horizon.quant.kernels import FUSED_ONE_ROW_MAX, kernel_available

    if not kernel_available():
        pytest.skip("the CPU kernels are not built here")
    ps = prompts(5, 6, 7)
    prefill(pair, ps)
    decode_both(pair, ps, 1)  # the graph exists (shared with the test above)
    step = StepInputs([[p[-1]] for p in ps], [len(p) for p in ps], [0, 1, 2])
    calls, forwards = {}, []
    model = pair[0].model
    hooks = [m.register_forward_hook(lambda *_: forwards.append(1)) for m in model.modules()
             if isinstance(m, torch.nn.Linear)]
    try:
        for runner in pair:
            calls[runner.compile] = rows_matmul_calls(lambda runner=runner: runner.run(step))[1]
    finally:
        for h in hooks:
            h.remove()
    routers = sum(isinstance(m, MoE) for m in model.modules())
    assert calls[False] == 0  # eager: F.linear
    # every nn.Linear the eager step calls (the compiled one runs no hooks), each router's F.linear, and the
    # routed experts' two products (Experts.sync_free) per MoE layer
    assert forwards and calls[True] == len(forwards) + 3 * routers

    prefill(pair, ps[:1])
    decode_both(pair, ps[:1], 1)
    large = [m for m in model.modules() if isinstance(m, torch.nn.Linear)
             and max(m.in_features, m.out_features) > FUSED_ONE_ROW_MAX]
    assert [m is model.lm_head for m in large] == [True]  # the tiny preset's 4,096-token vocabulary
    # the LM head and the routed experts' two products per MoE layer
    assert rows_matmul_calls(lambda: pair[0].run(StepInputs([[ps[0][-1]]], [len(ps[0])], [0])))[1] == 1 + 2 * routers


def test_padding_rows_leave_real_slots_alone(pair):
    """A batch of 3 runs at bucket 4: the padding row writes the scratch slot, never slot 3."""
    compiled, _ = pair
    ps = prompts(4, 4, 4, 9)
    prefill(pair, ps)
    state = [layer.state[3].clone() for layer in compiled.cache.kda_layers()]
    decode_both(pair, ps[:3], 3)
    assert all(torch.equal(layer.state[3], s) for layer, s in zip(compiled.cache.kda_layers(), state, strict=True))
    assert int(compiled.cache.lens[3]) == 9


def test_no_recompiles_as_the_context_grows(pair):
    ps = prompts(TOPK + 2)  # sparse from the first step
    prefill(pair, ps)
    decode_both(pair, ps, 2)  # warm-up (the bucket-1 sparse graph exists already)
    before = graphs()
    steps = decode_both(pair, ps, 60)  # context 20 -> 80
    assert graphs() == before
    assert all((a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item()) for a, b in steps)


def test_the_compiled_runner_reads_its_weights_from_one_huge_page_arena(pair, model):
    """The compiled runner moved the model's weights into one arena before compiling (engine/memory.py), so
    every compiled check in this module ran on them; the eager runner left them where they were."""
    compiled, eager = pair
    if unavailable() is not None:
        assert compiled.weight_placement.arena_bytes == 0
        pytest.skip(f"no huge pages here: {unavailable()}")
    placed = compiled.weight_placement
    assert placed.arena_bytes > 0 and "MiB in one arena" in placed.describe()
    assert len({t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}) == 1
    assert eager.weight_placement.arena_bytes == 0 and eager.weight_placement.reason == "an eager runner"


def test_runners_over_different_models_keep_their_own_graphs(pair, model):
    """The compiled step skips dynamo's guards on module state (the runner gives it a forward of its own
    instead): a second runner over a model of another structure (MXFP4 experts) in the same process
    compiles its own graph and matches its eager reference, and the first runner's graph is untouched."""
    import copy

    from horizon.quant import quantize_model

    other = quantize_model(copy.deepcopy(model))
    second = tuple(ModelRunner(other, HorizonCache(other.config, 4, 128, dtype=torch.float32, block_size=16),
                               compile=c, buckets=(1, 4)) for c in (True, False))
    ps = prompts(6)
    prefill(pair, ps)
    prefill(second, ps)
    for runners in (second, pair, second):
        steps = decode_both(runners, ps, 2)
        assert all((a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item()) for a, b in steps)
    assert second[0].graphs_seen == {(1, False)}
    step = StepInputs([[ps[0][-1]]], [len(ps[0])], [0])
    # the two models differ, so a graph shared between the runners would have shown above
    assert (second[0].run(step) - pair[0].run(step)).abs().max() > 1e-3


@pytest.fixture(scope="module")
def engines(model):
    cfg = dict(max_num_seqs=4, max_batch_tokens=64, max_model_len=256, block_size=16)
    return (Engine(model, load_tok(), EngineConfig(**cfg, compile=True)),
            Engine(model, load_tok(), EngineConfig(**cfg)))


def load_tok():
    from horizon.chat import load_tokenizer

    return load_tokenizer()


def test_compiled_engine_generates_what_the_eager_engine_does(engines):
    """Greedy output, batched and alone, over paged blocks the scheduler assigns while decoding."""
    compiled, eager = engines
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    ps = prompts(5, 12, 3)
    want = [r.token_ids for r in eager.generate([Request(p, params) for p in ps])]
    assert [r.token_ids for r in compiled.generate([Request(p, params) for p in ps])] == want
    assert compiled.generate([Request(ps[1], params)])[0].token_ids == want[1]
    assert compiled.runner.graphs_seen  # the decode steps did run compiled


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item())


def test_graphs_compile_in_the_background_while_steps_run_eagerly(pair, model):
    """compile_in_background (what horizon serve does): a step whose graph is not ready runs eagerly instead of
    waiting for a compile; the thread then makes every (bucket, attention) graph, after which decoding across
    index_topk at both buckets compiles nothing more and matches the eager reference."""
    runner = ModelRunner(model, HorizonCache(model.config, 4, 128, dtype=torch.float32, block_size=16),
                         compile=True, buckets=(1, 4))
    gate, warm = threading.Event(), runner._warm
    runner._warm = lambda key: (gate.wait(), warm(key))  # the compile held before its first graph
    assert runner.compile_in_background() and not runner.compile_in_background()  # one thread at a time
    runners = (runner, pair[1])
    try:
        ps = prompts(6)
        prefill(runners, ps)
        # eager (the two eager forwards may differ by an ulp: the held thread's OpenMP team shares the cores)
        assert all(close(a, b) for a, b in decode_both(runners, ps, TOPK))
        assert runner.graphs_seen == set() and runner.graphs_pending == 4
    finally:
        gate.set()
    assert runner.wait_compiled(timeout=900)
    assert runner.graphs_seen == {(1, False), (1, True), (4, False), (4, True)} and not runner.graphs_failed
    assert runner.graphs_pending == 0 and not runner.compile_in_background()  # nothing left to make
    before = graphs()
    for lengths in [(6,), (3, 7, 5)]:
        ps = prompts(*lengths)
        prefill(runners, ps)
        assert all(close(a, b) for a, b in decode_both(runners, ps, TOPK + 6 - min(lengths)))
    assert graphs() == before


def test_an_engine_serves_eagerly_while_its_graphs_compile(model, engines):
    """EngineConfig(compile_in_background=True): the compile starts with the engine, its requests do not wait
    for it (they run eagerly and generate what the eager engine does), the metrics say how far it is, and stop()
    ends it."""
    gate = threading.Event()
    original = ModelRunner._warm
    ModelRunner._warm = lambda self, key: gate.wait()  # never compiles here: the test above compiles
    engine = None
    try:
        engine = Engine(model, load_tok(), EngineConfig(max_num_seqs=4, max_batch_tokens=64, max_model_len=256,
                                                        block_size=16, compile=True, compile_in_background=True))
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        ps = prompts(5, 12, 3)
        want = [r.token_ids for r in engines[1].generate([Request(p, params) for p in ps])]
        assert [r.token_ids for r in engine.generate([Request(p, params) for p in ps])] == want
        m = engine.metrics()
        # buckets 1, 2, 4, each dense and sparse (the window, 256, passes index_topk)
        assert (m["decode_graphs_compiled"], m["decode_graphs_pending"]) == (0, 6)
    finally:
        if engine is not None:
            engine.stop()
        gate.set()
        stopped = engine is None or engine.runner.wait_compiled(timeout=60)
        ModelRunner._warm = original
    assert stopped and engine.runner.graphs_pending == 5  # stopped after the one it was on


@pytest.mark.parametrize("preset", [None, "elsewhere"])
def test_compiled_graphs_are_cached_where_the_docs_say(tmp_path, preset):
    """inductor's caches go to ~/.cache/horizon/inductor unless TORCHINDUCTOR_CACHE_DIR says otherwise, after the
    runner's imports and torch._dynamo's (which writes torch's /tmp default into that variable when first
    imported). A fresh interpreter, so the import order is the real one."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["HOME"] = str(tmp_path)
    if preset:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / preset)
    code = ("import horizon.engine.runner, torch._dynamo\n"
            "from torch._inductor.runtime.cache_dir_utils import cache_dir\n"
            "print(cache_dir())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    want = tmp_path / preset if preset else tmp_path / ".cache" / "horizon" / "inductor"
    assert out.stdout.strip() == str(want)


def test_a_runner_makes_room_for_its_graphs_in_dynamos_limit(model):
    """Dynamo keeps `recompile_limit` graphs per code object (8 by default) and every runner compiles the
    same DecodeStep.forward; past the limit fullgraph fails hard. Each runner adds room for its buckets,
    so a runner still compiles when the limit alone would refuse its second graph. (Last in the module:
    it clears dynamo's caches.)"""
    torch._dynamo.reset()
    # config.patch, not monkeypatch: monkeypatch's undo deletes a config entry it did not see as an attribute,
    # and every later torch.compile in the process then fails to read it
    with torch._dynamo.config.patch(recompile_limit=1):
        runner = ModelRunner(model, HorizonCache(model.config, 4, 128, dtype=torch.float32, block_size=16),
                             compile=True, buckets=(1, 4))
        ps = prompts(5, 6)
        prefill((runner,), ps)
        runner.run(StepInputs([[ps[0][-1]]], [len(ps[0])], [0]))
        runner.run(StepInputs([[p[-1]] for p in ps], [len(p) for p in ps], [0, 1]))
    assert runner.graphs_seen == {(1, False), (4, False)}
