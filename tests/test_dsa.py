"""Gated DSA: dense equivalence, absorbed == expanded, real sparse selection, ties, cache contents, memory,
and the per-call options (no mode lives on the layer)."""

import math

import pytest
import torch

import horizon.model.dsa as dsa_mod
from horizon.model import Batch, ForwardOptions
from horizon.model.dsa import GatedDSA, topk_recent_first

from .conftest import TensorMemory, tiny, tiny_model


def make_layer(seed=0, **changes) -> GatedDSA:
    cfg = tiny(**changes)
    torch.manual_seed(seed)
    model = tiny_model(seed, **changes)
    return model.layers[cfg.dsa_layers[0]].attn.eval()


def run(layer, x, **kw):
    """One sequence x [T, d] through the layer without a cache."""
    with torch.no_grad():
        return layer(x, Batch.build([x.shape[0]]), **kw)


def explicit_attention(layer: GatedDSA, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """docs/design.md §1.2 written out for one sequence: expanded keys/values, softmax over `allowed` [T, T]."""
    T = x.shape[0]
    with torch.no_grad():
        q_nope, q_pe, _, latent = layer.project(x, torch.arange(T))
        c_kv, k_pe = latent.split((layer.kv_rank, layer.rope), -1)
        kv = layer.wkv_b(c_kv).view(T, layer.num_heads, layer.nope + layer.v_dim)
        k_nope, v = kv.split((layer.nope, layer.v_dim), -1)
        scores = torch.einsum("thd,shd->hts", q_nope, k_nope) + torch.einsum("the,se->hts", q_pe, k_pe)
        scores = scores / math.sqrt(layer.nope + layer.rope)
        probs = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1)
        o = torch.einsum("hts,shv->thv", probs, v)
        o = o * torch.sigmoid(layer.gate_b(layer.gate_a(x))).view_as(o)
        return layer.wo(o.flatten(1))


def brute_force_selection(layer: GatedDSA, x: torch.Tensor, k: int) -> list[list[int]]:
    """Per query: the k visible positions with the largest I(t, s), ties to the more recent position."""
    T = x.shape[0]
    pos = torch.arange(T)
    with torch.no_grad():
        _, _, c_q, _ = layer.project(x, pos)
        q, w = layer.indexer.queries(x, c_q, pos)
        keys = layer.indexer.keys(x, pos)
    d = layer.indexer.head_dim
    chosen = []
    for t in range(T):
        score = [float(sum(w[t, j] * d**-0.5 * torch.relu(q[t, j] @ keys[s]) for j in range(q.shape[1])))
                 for s in range(t + 1)]
        chosen.append(sorted(sorted(range(t + 1), key=lambda s: (score[s], s), reverse=True)[:k]))
    return chosen


def causal(T):
    return torch.ones(T, T, dtype=torch.bool).tril()


def test_topk_recent_first_orders_by_score_then_recency():
    s = torch.tensor([0.5, -0.0, 0.0, -1.0, 0.5, float("-inf"), 0.0, 2.0])
    assert sorted(topk_recent_first(s, 4).tolist()) == [0, 4, 6, 7]
    assert sorted(topk_recent_first(s, 5).tolist()) == [0, 2, 4, 6, 7]  # -0.0 ties 0.0: the later one wins
    assert sorted(topk_recent_first(s, 7).tolist()) == [0, 1, 2, 3, 4, 6, 7]
    g = torch.Generator().manual_seed(0)
    r = torch.randint(0, 4, (3, 50), generator=g).float()  # many exact ties
    picked = topk_recent_first(r, 10)
    for row, got in zip(r.tolist(), picked.tolist(), strict=True):
        want = sorted(range(50), key=lambda i: (row[i], i), reverse=True)[:10]
        assert sorted(got) == sorted(want)


def test_the_integer_topk_fallback_orders_by_score_then_recency():
    """The path compiled graphs take without the CPU kernels, on rows as a batched step gives it: many ties,
    and short sequences' rows -inf past their own context (it reads a batch's rows out of order; the set must
    not depend on that), at an even and an odd length."""
    g = torch.Generator().manual_seed(1)
    for n in (300, 301):
        r = torch.randint(0, 4, (4, n), generator=g).float()
        r[1, 40:] = float("-inf")  # fewer visible positions than k
        r[2, 90:] = float("-inf")
        r[3, ::3] = -0.0
        for k in (1, 64, n):
            picked = dsa_mod._topk_by_score_then_position(r, k)
            for row, got in zip(r.tolist(), picked.tolist(), strict=True):
                want = sorted(range(n), key=lambda i: (row[i] + 0.0, i), reverse=True)[:k]
                assert sorted(got) == sorted(want), (n, k)


def test_topk_covering_the_length_is_dense_causal_attention():
    layer = make_layer(index_topk=64)
    x = torch.randn(40, 64)
    torch.testing.assert_close(run(layer, x), explicit_attention(layer, x, causal(40)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("topk", [64, 8])  # dense, sparse
def test_absorbed_form_equals_expanded_form(topk):
    layer = make_layer(index_topk=topk)
    x = torch.randn(40, 64)
    expanded = run(layer, x, options=ForwardOptions(attn_form="expanded"))
    absorbed = run(layer, x, options=ForwardOptions(attn_form="absorbed"))
    torch.testing.assert_close(absorbed, expanded, atol=1e-5, rtol=0)


def test_sparse_selection_restricts_attention_to_the_indexer_choice():
    k, T = 8, 40
    layer = make_layer(index_topk=k)
    options = ForwardOptions(record_selection=True, measure_coverage=True)
    x = torch.randn(T, 64)
    out = run(layer, x, options=options)
    dense = explicit_attention(layer, x, causal(T))
    assert (out - dense).abs().max() > 1e-3  # selection really changes the result
    assert 0 < options.coverage[layer.layer_idx] < 1  # the selection keeps part of the dense attention mass
    chosen = brute_force_selection(layer, x, k)
    got = options.selections[layer.layer_idx][0]
    assert got.shape == (T, k)
    allowed = torch.zeros(T, T, dtype=torch.bool)
    for t in range(T):
        valid = sorted(s for s in got[t].tolist() if s <= t)
        assert valid == chosen[t], f"query {t}"
        allowed[t, chosen[t]] = True
    torch.testing.assert_close(out, explicit_attention(layer, x, allowed), atol=1e-5, rtol=0)


def test_recent_selection_keeps_the_most_recent_positions():
    k, T = 8, 40
    layer = make_layer(index_topk=k)
    # the ablation baseline of `horizon eval --selection recent`
    options = ForwardOptions(selection="recent", record_selection=True)
    x = torch.randn(T, 64)
    out = run(layer, x, options=options)
    got = options.selections[layer.layer_idx][0]
    allowed = torch.zeros(T, T, dtype=torch.bool)
    for t in range(T):
        want = list(range(max(0, t - k + 1), t + 1))
        assert sorted(s for s in got[t].tolist() if s <= t) == want, f"query {t}"
        allowed[t, want] = True
    torch.testing.assert_close(out, explicit_attention(layer, x, allowed), atol=1e-5, rtol=0)


def test_ties_break_toward_recent_positions_in_prefill_decode_and_batches():
    """With the indexer weights at zero every score ties: the selection must be the k most recent
    positions, the same in one prefill, token-by-token decode, and a batch with other sequences."""
    k, T = 6, 30
    model = tiny_model(index_topk=k)
    dsa_layers = [model.layers[i].attn for i in model.config.dsa_layers]
    for layer in dsa_layers:
        layer.indexer.weights_proj.weight.data.zero_()
    picks = lambda: ForwardOptions(record_selection=True)
    ids = torch.randint(0, model.config.vocab_size, (1, T))
    window = [sorted(range(max(0, t - k + 1), t + 1)) for t in range(T)]

    def valid(sel, t):
        return sorted(s for s in sel if s <= t)

    with torch.no_grad():
        full = model(ids, options=(opts := picks()))
        for layer in dsa_layers:
            assert [valid(opts.selections[layer.layer_idx][0, t].tolist(), t) for t in range(T)] == window
        cache = model.new_cache(2, T)
        model(ids[:, :10], cache=cache)
        steps = [model(ids[:, t:t + 1], cache=cache, options=(opts := picks())) for t in range(10, T)]
        for layer in dsa_layers:  # the last decode step's
            assert valid(opts.selections[layer.layer_idx][0, 0].tolist(), T - 1) == window[T - 1]
        torch.testing.assert_close(torch.cat(steps, 1), full[:, 10:], atol=1e-5, rtol=0)
        other = torch.randint(0, model.config.vocab_size, (1, T))
        batched = model(torch.cat((other, ids)), lengths=[T - 7, T], options=(opts := picks()))
        for layer in dsa_layers:
            assert [valid(opts.selections[layer.layer_idx][1, t].tolist(), t) for t in range(T)] == window
        torch.testing.assert_close(batched[1], full[0], atol=1e-5, rtol=0)


def test_decode_cache_holds_only_latent_rows_and_indexer_keys():
    model = tiny_model()
    cfg = model.config
    cache = model.new_cache(3, 50)
    rows = (cache.num_blocks + 1) * cache.block_size  # one block more: the scratch slot's (model/cache.py)
    assert cache.num_blocks * cache.block_size >= 3 * 50
    for i in cfg.dsa_layers:
        layer_cache = cache.layers[i]
        per_token = {name: tuple(t.shape) for name, t in vars(layer_cache).items()
                     if isinstance(t, torch.Tensor) and t is not cache.full_table}
        assert per_token == {"latent": (rows, cfg.kv_lora_rank + cfg.qk_rope_head_dim),
                             "index": (rows, cfg.index_head_dim)}
    assert cache.bytes_per_token() == len(cfg.dsa_layers) * (cfg.kv_lora_rank + cfg.qk_rope_head_dim
                                                             + cfg.index_head_dim) * 4


@pytest.mark.parametrize("topk", [64, 8])
def test_decode_never_applies_w_kvb_to_cached_rows(topk):
    model = tiny_model(index_topk=topk)
    calls = []
    for i in model.config.dsa_layers:
        model.layers[i].attn.wkv_b.register_forward_hook(lambda mod, inp, out: calls.append(inp[0].shape))
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    cache = model.new_cache(2, 24)
    with torch.no_grad():
        model(ids[:, :4], cache=cache)
        prefill_calls = len(calls)
        for t in range(4, 24):
            model(ids[:, t:t + 1], cache=cache)
    assert len(calls) == prefill_calls, "decode expanded cached rows through W_kvb"
    if topk == 64:
        assert prefill_calls > 0  # the hook does see the expanded (prefill) form


def test_sparse_path_gathers_exactly_topk_rows_per_query(monkeypatch):
    k = 8
    model = tiny_model(index_topk=k)
    shapes = []
    real = dsa_mod.gather_selected

    def spy(ctx, batch, idx):
        rows = real(ctx, batch, idx)
        shapes.append((tuple(idx.shape), tuple(rows.shape)))
        return rows

    monkeypatch.setattr(dsa_mod, "gather_selected", spy)
    ids = torch.randint(0, model.config.vocab_size, (2, 30))
    cache = model.new_cache(2, 40)
    with torch.no_grad():
        model(ids, lengths=[30, 20])
        model(ids[:, :20], cache=cache)
        model(ids[:, 20:21], cache=cache)
    width = model.config.kv_lora_rank + model.config.qk_rope_head_dim
    assert shapes, "the sparse path did not run"
    for idx_shape, rows_shape in shapes:
        assert idx_shape[-1] == k and rows_shape[2:] == (k, width)


def test_indexer_memory_grows_linearly_not_quadratically(monkeypatch):
    monkeypatch.setattr(dsa_mod, "INDEX_TILE_ELEMENTS", 1 << 18)
    layer = make_layer(index_topk=16)
    peaks, largest = {}, {}
    for T in (1024, 4096):
        x = torch.randn(T, 64)
        with TensorMemory() as mem:
            run(layer, x)
        peaks[T], largest[T] = mem.peak, mem.largest
    H_I = layer.indexer.n_heads
    assert largest[4096] < 4096 * 4096 * 4  # no [T, T] fp32 tensor, let alone [T, H_I, T]
    assert peaks[4096] < 4096 * 4096 * H_I * 4 / 32
    assert peaks[4096] / peaks[1024] < 6, peaks  # x4 tokens: linear gives ~4, quadratic ~16


def test_no_indexer_is_dense_mla():
    layer = make_layer(index_n_heads=0)
    assert layer.indexer is None
    x = torch.randn(30, 64)
    torch.testing.assert_close(run(layer, x), explicit_attention(layer, x, causal(30)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("mla_rope,index_rope", [("interleaved", 8), ("half", 0)])
def test_rotary_options_keep_cached_decode_equal_to_full_forward(mla_rope, index_rope):
    model = tiny_model(mla_rope=mla_rope, index_rope_dim=index_rope, index_topk=8)
    ids = torch.randint(0, model.config.vocab_size, (1, 25))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(1, 25)
        parts = [model(ids[:, :12], cache=cache)] + [model(ids[:, t:t + 1], cache=cache) for t in range(12, 25)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-4, rtol=0)
    # the rotation is really applied: the same weights without it give other logits
    plain = tiny_model(index_topk=8)
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (plain(ids) - full).abs().max() > 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_rows_equals_advanced_indexing(dtype):
    from horizon.model.cache import gather_rows

    g = torch.Generator().manual_seed(0)
    table = torch.randn(60, 10, generator=g).to(dtype)  # width 10 bf16 = 5 four-byte words
    rows = torch.randint(0, 60, (2, 5, 7), generator=g)
    assert torch.equal(gather_rows(table, rows), table[rows])


def test_forward_options_reject_unknown_modes_naming_the_allowed_ones():
    with pytest.raises(ValueError, match=r"selection='sparse': allowed indexer, recent, dense"):
        ForwardOptions(selection="sparse").validate()
    with pytest.raises(ValueError, match=r"attn_form='mla': allowed auto, expanded, absorbed"):
        ForwardOptions(attn_form="mla").validate()
    model = tiny_model(index_topk=8)
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    with pytest.raises(ValueError, match="allowed indexer, recent, dense"), torch.no_grad():
        model(ids, options=ForwardOptions(selection="Recent"))  # checked on the way in, not silently dense


def test_a_forward_leaves_no_per_call_state_on_the_layers():
    """Modes come in with the call and results go out through its options: the modules' own attributes are
    the same objects before and after forwards with every probe on (a compiled graph relies on it)."""
    model = tiny_model(index_topk=8)
    layers = [m for m in model.modules() if isinstance(m, GatedDSA)]
    modules = layers + [m.indexer for m in layers]

    def state():
        return [{k: (v if isinstance(v, (int, float, str, bool, type(None))) else id(v)) for k, v in vars(m).items()}
                for m in modules]

    before = state()
    ids = torch.randint(0, model.config.vocab_size, (2, 30))
    options = ForwardOptions(record_selection=True, measure_coverage=True, indexer_inputs=True)
    with torch.no_grad():
        model(ids, lengths=[30, 20], options=options)
        model(ids[:, :12], options=ForwardOptions(selection="dense", attn_form="absorbed"))
        cache = model.new_cache(2, 40)
        model(ids[:, :20], cache=cache, options=ForwardOptions(selection="recent", record_selection=True))
        model(ids[:, 20:21], cache=cache, options=ForwardOptions(measure_coverage=True))
        model(ids[:, 21:22], cache=cache)
    assert state() == before
    dsa = {m.layer_idx for m in layers}
    assert set(options.selections) == set(options.coverage) == set(options.indexer_taps) == dsa
    for i in dsa:  # the layer ran sparse (30 > index_topk): the tap carries its picks
        assert options.indexer_taps[i].selected is options.selections[i]
        assert options.selections[i].shape == (2, 30, 8)


def test_dense_selection_attends_to_every_visible_position():
    layer = make_layer(index_topk=8)
    x = torch.randn(40, 64)
    options = ForwardOptions(selection="dense", record_selection=True, indexer_inputs=True)
    torch.testing.assert_close(run(layer, x, options=options), explicit_attention(layer, x, causal(40)),
                               atol=1e-5, rtol=0)
    assert options.selections == {} and options.indexer_taps[layer.layer_idx].selected is None
