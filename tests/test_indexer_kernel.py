"""The lightning indexer's paged decode scores (horizon/quant/kernels/indexer.cpp, dsa.paged_index_scores):
the kernel computes what gathering the keys and scoring them computes, on both of its code paths (AVX-512 and
portable), for block tables with unassigned blocks, head counts below, at and past one vector of 16 lanes, and
odd widths; a decode step through the cache scores with it and selects what the reference selects;
torch.compile traces it with a dynamic context length; without the kernel the reference runs."""

import os

import pytest
import torch

import horizon.quant.kernels as kernels
from horizon.model import HorizonCache
from horizon.model.batch import Batch
from horizon.model.dsa import decode_index_scores, paged_index_scores, paged_index_scores_reference
from tests.conftest import tiny_model

DISABLED = os.environ.get("HORIZON_KERNELS", "1").strip() == "0"
# "simd": the CPU's vector path; "portable": the portable C++ path
PATHS = [pytest.param(False, id="simd"), pytest.param(True, id="portable")]


def problem(B, H, d, bs, L, seed=0):
    """A pool holding B sequences' blocks in shuffled order, with unassigned (-1) blocks past the ends of
    sequence 0's table and of every other sequence past a shorter length."""
    gen = torch.Generator().manual_seed(seed)
    nb = (L + bs - 1) // bs + 2
    pool = torch.randn((B * nb + 1) * bs, d, generator=gen)
    table = torch.randperm(B * nb, generator=gen).view(B, nb)
    table[0, -1] = -1
    table[1:, max(1, L // (2 * bs)):] = -1
    return pool, table, torch.randn(B, H, d, generator=gen), torch.randn(B, H, generator=gen)


@pytest.mark.skipif(DISABLED, reason="HORIZON_KERNELS=0: the kernel is disabled")
@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize("B,H,d,bs,L", [(1, 8, 64, 64, 1000), (3, 8, 64, 64, 4097), (2, 64, 128, 16, 777),
                                        (2, 5, 33, 7, 50), (2, 20, 3, 4, 1),
                                        # eight heads in lane pairs: odd j-step and row tails; odd d falls back
                                        (1, 8, 6, 5, 23), (2, 8, 33, 16, 100)])
def test_the_kernel_computes_the_reference(portable, B, H, d, bs, L):
    assert kernels.kernel_available(), "the kernels did not build (see the logged warning)"
    pool, table, q, w = problem(B, H, d, bs, L)
    want = paged_index_scores_reference(pool, table, q, w, L, bs)
    got = paged_index_scores(pool, table, q, w, L, bs, force_portable=portable)
    assert got.shape == (B, L) and got.dtype == torch.float32
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * scale)
    assert torch.equal(got[1:, max(1, L // (2 * bs)) * bs:], torch.zeros_like(got[1:, max(1, L // (2 * bs)) * bs:]))


def test_an_unusable_pool_or_a_missing_kernel_takes_the_reference(monkeypatch):
    pool, table, q, w = problem(2, 8, 16, 8, 40)
    want = paged_index_scores_reference(pool, table, q, w, 40, 8)
    torch.testing.assert_close(paged_index_scores(pool.double(), table, q.double(), w.double(), 40, 8),
                               paged_index_scores_reference(pool.double(), table, q.double(), w.double(), 40, 8))
    monkeypatch.setattr(kernels, "_built", False)
    assert torch.equal(paged_index_scores(pool, table, q, w, 40, 8), want)


def test_compile_sees_one_op_with_a_dynamic_context():
    pool, table, q, w = problem(2, 8, 16, 8, 64)

    def f(pool, table, q, w, L: int):
        return paged_index_scores(pool, table, q, w, L, 8).relu()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for L in (10, 33, 64):
        torch.testing.assert_close(compiled(pool, table, q, w, L),
                                   paged_index_scores_reference(pool, table, q, w, L, 8).relu(), rtol=1e-5, atol=1e-5)


def test_a_decode_step_over_the_paged_cache_scores_what_the_gathered_keys_score():
    """A DSA layer's cache with shuffled blocks and sequences of different lengths (one shorter than a block):
    decode_index_scores (the kernel in place, or the reference without it) equals scoring the keys the cache
    gathers, at every visible position."""
    model = tiny_model(seed=2)
    cfg = model.config
    layer = next(i for i, kind in enumerate(cfg.layer_types) if kind == "dsa")
    lens, bs = [70, 3, 129], 16
    cache = HorizonCache(cfg, len(lens), 160, block_size=bs, num_blocks=40)
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(40, generator=gen)
    for s, n in enumerate(lens):
        blocks = -(-(n + 1) // bs)
        cache.block_table[s, :blocks] = order[:blocks]
        order = order[blocks:]
    ctx = cache.layers[layer]
    ctx.index.copy_(torch.randn(ctx.index.shape, generator=gen))
    cache.lens[:] = torch.tensor(lens)
    batch = Batch.decode(torch.tensor(lens), torch.arange(len(lens)), max(lens) + 1)
    H, d = cfg.index_n_heads, cfg.index_head_dim
    qi, wi = torch.randn(len(lens), 1, H, d, generator=gen), torch.randn(len(lens), 1, H, generator=gen)
    got = decode_index_scores(ctx, batch, qi, wi)
    want = model.layers[layer].attn.indexer.scores(qi, wi, ctx.index_keys(batch))
    visible = torch.arange(batch.max_ctx)[None, None] <= torch.tensor(lens)[:, None, None]
    assert got.shape == want.shape == (len(lens), 1, max(lens) + 1)
    torch.testing.assert_close(got[visible], want[visible], rtol=1e-5, atol=1e-6 * float(want.abs().max()))
