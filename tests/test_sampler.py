"""engine/sampler.py: what a draw at temperature > 0 may return, with which probabilities, and that it gets there
without the vocabulary-wide sort and per-token exponentials of the textbook route."""

import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from horizon.engine import sampler
from horizon.engine.params import SamplingParams
from horizon.engine.sampler import NUCLEUS_SORT_MAX, candidates, draw, sample
from horizon.quant.kernels import kernel_available


def reference(logits: torch.Tensor, p: SamplingParams) -> dict[int, float]:
    """The definition, in float64 with a full sort: softmax(logits / T) over the top_k best logits (ties with the
    k-th kept), then the fewest most likely tokens whose probability reaches top_p; token -> probability."""
    z = logits.double() / p.temperature
    if p.top_k and p.top_k < z.numel():
        z = z.masked_fill(z < z.topk(p.top_k).values[-1], -math.inf)
    probs = torch.softmax(z, 0)
    ranked, order = probs.sort(descending=True, stable=True)
    keep = ranked > 0
    if p.top_p < 1:  # (at 1 every token stays: a running sum rounded to 1 would cut the tail)
        keep &= (ranked.cumsum(0) - ranked) < p.top_p
    kept = ranked[keep] / ranked[keep].sum()
    # (below 1e-30 float32's exp, as the sampler's, runs out of range: such tokens are left out of both)
    return {i: q for i, q in zip(order[keep].tolist(), kept.tolist(), strict=True) if q > 1e-30}


def distribution(logits: torch.Tensor, p: SamplingParams) -> dict[int, float]:
    ids, w = candidates(logits, p)
    ids = torch.arange(w.numel()) if ids is None else ids
    w = w.double() / w.double().sum()
    return {i: q for i, q in zip(ids.tolist(), w.tolist(), strict=True) if q > 1e-30}


def logit_rows(v: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(v)
    flat = torch.randn(v, generator=g)
    peaked = torch.randn(v, generator=g) * 6
    zipf = -1.1 * torch.log(torch.arange(1, v + 1, dtype=torch.float32))[torch.randperm(v, generator=g)]
    ties = torch.randint(0, 6, (v,), generator=g).float()  # many equal logits, the k-th among them
    banned = peaked.clone()
    banned[torch.randperm(v, generator=g)[: v // 3]] = -math.inf  # bans and a grammar's mask leave -inf
    return {"flat": flat, "peaked": peaked, "zipf": zipf, "ties": ties, "banned": banned}


@pytest.fixture(scope="module")
def kernel():
    if not kernel_available():
        pytest.skip("the CPU kernels are not built here")
    return torch.ops.horizon_kernels.sample_row


@pytest.fixture(params=["kernel", "reference"])
def route(request, monkeypatch):
    """sample() and sample_rows() through the kernel (skipped where it is not built) or through their PyTorch
    reference."""
    if request.param == "kernel":
        request.getfixturevalue("kernel")
    else:
        monkeypatch.setattr(sampler.kernels, "sample_row", lambda *a: None)
        monkeypatch.setattr(sampler.kernels, "sample_rows", lambda *a: None)
    return request.param


SETTINGS = [SamplingParams(temperature=t, top_k=k, top_p=q)
            for t in (0.3, 1.0, 1.7) for k in (0, 1, 40) for q in (1.0, 0.95, 0.5, 1e-6)]


@pytest.mark.parametrize("v", [37, NUCLEUS_SORT_MAX + 1, 32768])
def test_the_candidates_and_their_probabilities_are_the_definitions(v):
    # 37 tokens are sorted as they are; past NUCLEUS_SORT_MAX top_p bins the weights first
    for name, logits in logit_rows(v).items():
        for p in SETTINGS:
            want, got = reference(logits, p), distribution(logits, p)
            assert len(got) == len(want), (name, p, len(got), len(want))
            if name != "ties":
                assert got.keys() == want.keys(), (name, p)
            # equal logits at the nucleus' edge: which of them stay is either's choice, their probabilities are not
            assert max(abs(a - b) for a, b in zip(sorted(got.values()), sorted(want.values()), strict=True)) < 1e-6
            full = reference(logits, SamplingParams(temperature=p.temperature, top_k=p.top_k))
            mass = sum(full[i] for i in got)
            assert max(abs(got[i] - full[i] / mass) for i in got) < 1e-6, (name, p)


def test_the_nucleus_keeps_the_token_that_crosses_top_p_and_always_the_best():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert distribution(logits, SamplingParams(top_p=0.5)).keys() == {0}  # 0.5 reaches 0.5
    assert distribution(logits, SamplingParams(top_p=0.51)).keys() == {0, 1}
    assert distribution(logits, SamplingParams(top_p=0.95)).keys() == {0, 1, 2}
    assert distribution(logits, SamplingParams(top_p=0.951)).keys() == {0, 1, 2, 3}
    assert distribution(logits, SamplingParams(top_p=1e-9)).keys() == {0}
    big = torch.cat([logits, torch.full((5000,), -40.0)])  # binned: the tail's 5,000 tokens are ~1e-17 each
    assert distribution(big, SamplingParams(top_p=0.95)).keys() == {0, 1, 2}
    assert distribution(big, SamplingParams(top_p=0.999)).keys() == {0, 1, 2, 3}


def test_a_draw_is_the_first_index_whose_running_sum_passes_a_uniform_share():
    w = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3, 0.0])
    cum = w.double().cumsum(0)
    for u in torch.rand(200, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).tolist():
        want = int((cum > u * cum[-1]).nonzero()[0])
        assert draw(w, u) == want and w[want] > 0


def test_a_uniform_that_rounds_to_the_whole_sum_gives_the_last_token_with_weight():
    assert draw(torch.tensor([0.25, 0.5, 0.0, 0.0]), 1.0) == 1  # (u * sum == sum: as if u had rounded up)


@pytest.mark.parametrize("p", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=3),
                               SamplingParams(temperature=1.3, top_p=0.8)])
def test_sampled_frequencies_follow_the_probabilities(p, route):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -3.0, -math.inf])
    want = reference(logits, p)
    g = torch.Generator().manual_seed(0)
    n = 20_000
    counts = torch.bincount(torch.tensor([sample(logits, p, [], g) for _ in range(n)]), minlength=7)
    for token in range(7):
        q = want.get(token, 0.0)
        if q == 0:
            assert counts[token] == 0, token  # never a token outside the candidates
        else:  # within 5 standard deviations of the binomial count
            assert abs(counts[token] - n * q) < 5 * math.sqrt(n * q * (1 - q)) + 1, (token, int(counts[token]), n * q)


def test_the_same_generator_state_draws_the_same_tokens(route):
    logits = torch.randn(5000, generator=torch.Generator().manual_seed(3)) * 2
    p = SamplingParams(temperature=0.9, top_p=0.9, top_k=200)
    a = [sample(logits, p, [], torch.Generator().manual_seed(7)) for _ in range(3)]
    g = torch.Generator().manual_seed(7)
    b = [sample(logits, p, [], g) for _ in range(3)]
    assert len(set(a)) == 1 and b[0] == a[0] and len(set(b)) > 1  # a fresh seed repeats; one generator moves on


def test_no_vocabulary_wide_sort_and_no_exponential_per_token(route):
    v = 32768
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(v, generator=g) * 6  # a peaked row, as a trained model's mostly are
    for p in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9),
              SamplingParams(temperature=0.8, top_k=40, top_p=0.95)):
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            sample(logits, p, [], g)
        ops = {e.key: e for e in prof.key_averages(group_by_input_shape=True)}
        assert not any(k in ops for k in ("aten::multinomial", "aten::exponential_")), p
        sorts = [e.input_shapes[0] for e in prof.key_averages(group_by_input_shape=True) if e.key == "aten::sort"]
        assert all(s and s[0] < v // 8 for s in sorts), (p, sorts)


@pytest.mark.parametrize("portable", [False, True], ids=["vector", "portable"])
@pytest.mark.parametrize("v", [37, 5000])
def test_the_kernel_draws_the_references_tokens(kernel, v, portable):
    us = torch.rand(24, dtype=torch.float64, generator=torch.Generator().manual_seed(v)).tolist()
    near = 0
    for name, logits in logit_rows(v).items():
        for p in SETTINGS:
            ids, w = candidates(logits, p)
            cum = w.double().cumsum(0)
            for u in us:
                got = kernel(logits, p.temperature, p.top_k, p.top_p, u, portable)
                i = draw(w, u)
                if got != (i if ids is None else int(ids[i])):
                    # the weights' exponentials differ by ~2e-7 (the kernel's vector exp against torch.exp): only
                    # a draw within that of a boundary between two tokens may go the other way
                    x = u * float(cum[-1])
                    edge = min(abs(x - float(cum[i])), abs(x - float(cum[i - 1])) if i else math.inf)
                    assert edge < 1e-5 * float(cum[-1]), (name, p, u, got, i)
                    near += 1
    assert near <= 2


def test_a_top_k_past_the_vocabulary_and_past_int64_is_off(route):
    logits = torch.tensor([0.0, -1.0, -2.0])
    g = torch.Generator().manual_seed(0)
    seen = {sample(logits, SamplingParams(temperature=1.0, top_k=k), [], g)
            for k in (3, 2**63, 10**30) for _ in range(60)}
    assert seen == {0, 1, 2}


def test_a_temperature_below_float32s_range_acts_as_greedy(route):
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    logits[37] = 5.0
    g = torch.Generator().manual_seed(0)
    for t in (1e-30, 1e-45, 1e-300):
        for p in (SamplingParams(temperature=t), SamplingParams(temperature=t, top_p=0.9, top_k=5)):
            assert {sample(logits, p, [], g) for _ in range(20)} == {37}, p


def test_rows_drawn_at_once_are_the_tokens_each_draws_alone(route):
    # each row its own settings and generator; the one call must give what sample() gives row by row
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 3000, generator=g) * torch.tensor([1.0, 3.0, 6.0, 2.0, 4.0, 0.5])[:, None]
    logits[4, 100:] = -math.inf  # a row with bans
    params = [SamplingParams(temperature=t, top_k=k, top_p=q) for t, k, q in
              [(1.0, 0, 1.0), (0.7, 0, 0.9), (0.8, 40, 1.0), (1.2, 40, 0.95), (1e-50, 0, 0.9), (0.9, 2, 0.5)]]
    for seed in range(20):
        alone = [sample(row, p, [], torch.Generator().manual_seed(seed + i), finite=True)
                 for i, (row, p) in enumerate(zip(logits, params, strict=True))]
        gens = [torch.Generator().manual_seed(seed + i) for i in range(6)]
        assert sampler.sample_rows(logits, params, gens) == alone, seed


def test_an_engine_draws_its_sampled_rows_in_one_call_a_step_with_the_same_tokens(monkeypatch):
    from horizon.chat import load_tokenizer
    from horizon.engine import Engine, EngineConfig, Request

    from .conftest import tiny_model

    if not kernel_available():
        pytest.skip("the CPU kernels are not built here")
    model, tok = tiny_model(), load_tokenizer()
    requests = [([5, 6, 7], SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=1, ignore_eos=True)),
                ([9, 10], SamplingParams(max_tokens=8, temperature=1.0, top_k=20, seed=2, ignore_eos=True)),
                ([11, 12, 13, 14], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))]

    def run() -> tuple[list[list[int]], dict[str, int]]:
        engine = Engine(model, tok, EngineConfig(max_num_seqs=3, max_batch_tokens=32, max_model_len=64,
                                                 compile=False))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            results = engine.generate([Request(p, s) for p, s in requests])
        return [r.token_ids for r in results], {e.key: e.count for e in prof.key_averages()}

    tokens, count = run()
    # 7 decode steps draw the two sampled rows at once; only the prefill step, one row at a time, draws alone
    assert count.get("horizon_kernels::sample_rows", 0) >= 7 and count.get("horizon_kernels::sample_row", 0) <= 2
    monkeypatch.setattr(Engine, "_draw_plain", lambda self, plan, logits, finite: {})  # every row alone
    alone, count = run()
    assert alone == tokens and count.get("horizon_kernels::sample_rows", 0) == 0
