"""Gated DSA's decode attention over the paged latent pool (horizon/quant/kernels/attention.cpp,
dsa.paged_latent_attention): the kernel computes what gathering the rows and attending over them computes, on
both code paths (AVX-512 and portable), dense (every position below a limit) and sparse (a selection with
invisible and out-of-range picks), for block tables with unassigned blocks, block sizes that are not multiples
of 16, widths that are not multiples of 16, contexts shorter than one group and longer than one chunk, and a
sequence that sees nothing; torch.compile traces it with a dynamic context; a cached decode through the model
equals the same decode without the kernel (the gathering reference), dense and sparse."""

import os

import pytest
import torch

import horizon.model.dsa as dsa_mod
import horizon.quant.kernels as kernels
from horizon.model.dsa import paged_latent_attention, paged_latent_attention_reference
from tests.conftest import tiny_model

DISABLED = os.environ.get("HORIZON_KERNELS", "1").strip() == "0"
# "simd": the CPU's vector path; "portable": the portable C++ path
PATHS = [pytest.param(False, id="simd"), pytest.param(True, id="portable")]


def problem(B, H, W, bs, L, seed=0):
    """A pool holding B sequences' blocks in shuffled order; sequence 0 sees L positions, the others fewer, the
    last none (limit 0); blocks past each limit are unassigned (-1)."""
    gen = torch.Generator().manual_seed(seed)
    nb = (L + bs - 1) // bs + 1
    pool = torch.randn((B * nb + 1) * bs, W, generator=gen)
    table = torch.randperm(B * nb, generator=gen).view(B, nb)
    limit = torch.tensor([L] + [max(1, L // (b + 2)) for b in range(1, B)], dtype=torch.long)
    if B > 1:
        limit[-1] = 0
    for b in range(B):
        table[b, (int(limit[b]) + bs - 1) // bs:] = -1
    q = torch.randn(B, H, W, generator=gen) * 0.5
    return pool, table, q, limit


@pytest.mark.skipif(DISABLED, reason="HORIZON_KERNELS=0: the kernel is disabled")
@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize("B,H,W,V,bs,L", [(3, 8, 160, 128, 64, 1950), (1, 8, 160, 128, 64, 700), (2, 4, 40, 32, 16, 70),
                                          (3, 5, 33, 17, 7, 300), (2, 64, 576, 512, 64, 40), (2, 3, 8, 0, 4, 5)])
def test_the_kernel_computes_the_reference_dense(portable, B, H, W, V, bs, L):
    assert kernels.kernel_available(), "the kernels did not build (see the logged warning)"
    pool, table, q, limit = problem(B, H, W, bs, L)
    scale = W**-0.5
    want = paged_latent_attention_reference(pool, table, q, limit, L, bs, scale, V)
    got = paged_latent_attention(pool, table, q, limit, L, bs, scale, V, force_portable=portable)
    assert got.shape == (B, H, V) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if B > 1:
        assert torch.equal(got[-1], torch.zeros_like(got[-1]))  # nothing visible: zeros, not NaN


@pytest.mark.skipif(DISABLED, reason="HORIZON_KERNELS=0: the kernel is disabled")
@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize("k", [5, 16, 300])
def test_the_kernel_computes_the_reference_over_a_selection(portable, k):
    B, H, W, V, bs, L = 3, 8, 40, 32, 16, 400
    pool, table, q, limit = problem(B, H, W, bs, L, seed=1)
    gen = torch.Generator().manual_seed(2)
    idx = torch.stack([torch.randperm(L, generator=gen)[:k] for _ in range(B)])
    idx[0, 0], idx[1, -1] = -3, 10 * L  # out of range on both sides: never read, never attended
    want = paged_latent_attention_reference(pool, table, q, limit, L, bs, 0.3, V, idx)
    got = paged_latent_attention(pool, table, q, limit, L, bs, 0.3, V, idx, force_portable=portable)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_an_unusable_pool_or_a_missing_kernel_takes_the_reference(monkeypatch):
    pool, table, q, limit = problem(2, 4, 24, 8, 40)
    args = (40, 8, 0.2, 16)
    torch.testing.assert_close(paged_latent_attention(pool.double(), table, q.double(), limit, *args),
                               paged_latent_attention_reference(pool.double(), table, q.double(), limit, *args))
    monkeypatch.setattr(kernels, "_built", False)
    assert torch.equal(paged_latent_attention(pool, table, q, limit, *args),
                       paged_latent_attention_reference(pool, table, q, limit, *args))


def test_compile_sees_one_op_with_a_dynamic_context():
    pool, table, q, limit = problem(2, 4, 24, 8, 64)

    def f(pool, table, q, limit, L: int):
        return paged_latent_attention(pool, table, q, limit.clamp(max=L), L, 8, 0.2, 16).relu()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for L in (10, 33, 64):
        want = paged_latent_attention_reference(pool, table, q, limit.clamp(max=L), L, 8, 0.2, 16).relu()
        torch.testing.assert_close(compiled(pool, table, q, limit, L), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(DISABLED, reason="HORIZON_KERNELS=0: the kernel is disabled")
@pytest.mark.parametrize("topk", [64, 8], ids=["dense", "sparse"])
def test_a_cached_decode_equals_the_gathering_reference(monkeypatch, topk):
    """Prefill two sequences of different lengths, then decode a few tokens through the cache: logits with
    the kernel equal logits with every kernel off (the DSA layers gather their rows), dense (top-k above the
    context) and sparse (top-k below it)."""
    model = tiny_model(index_topk=topk, seed=3)
    calls = []
    real = dsa_mod.paged_latent_attention
    monkeypatch.setattr(dsa_mod, "paged_latent_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = torch.randint(0, model.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(0))

    def decode():
        cache = model.new_cache(2, 40)
        out = [model(ids[:, :24], cache=cache, lengths=[24, 17])]
        for t in range(24, 30):
            out.append(model(ids[:, t:t + 1], cache=cache))
        return out

    with torch.no_grad():
        assert kernels.kernel_available()
        with_kernel = decode()
        dsa_layers = model.config.layer_types.count("dsa")
        assert len(calls) == 6 * dsa_layers  # every decode step's DSA layers read the pool in place
        monkeypatch.setattr(kernels, "_built", False)
        without = decode()
        assert len(calls) == 6 * dsa_layers  # and without the kernel none did
    for a, b in zip(with_kernel, without, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
