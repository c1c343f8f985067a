"""KDA: chunkwise == recurrent == flash-linear-attention's reference; state carried exactly."""

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import horizon.model.kda as kda_mod
from horizon.model import Batch
from horizon.model.kda import (
    decayed_scores,
    kda_chunkwise,
    kda_chunkwise_reference,
    kda_decode,
    kda_decode_reference,
    kda_recurrent,
    short_conv,
)
from horizon.quant.kernels import kernel_available, vector_path

from .conftest import tiny_model


def fla_naive():
    """flash-linear-attention's fla/ops/kda/naive.py, loaded from its file so triton is never imported."""
    spec = importlib.util.find_spec("fla")
    path = Path(spec.submodule_search_locations[0]) / "ops" / "kda" / "naive.py"
    module_spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def inputs(B=2, T=50, H=3, K=16, V=12, seed=0, decay=2.0):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    v = torch.randn(B, T, H, V, generator=g)
    log_alpha = -torch.rand(B, T, H, K, generator=g) * decay
    beta = torch.rand(B, T, H, generator=g)
    s0 = torch.randn(B, H, K, V, generator=g)
    return q, k, v, log_alpha, beta, s0


@pytest.mark.parametrize("T", [1, 15, 16, 33, 64, 97, 150])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("chunk", [16, 64])
def test_chunkwise_equals_recurrent(T, with_state, chunk):
    q, k, v, g, beta, s0 = inputs(T=T)
    s0 = s0 if with_state else None
    o_r, s_r = kda_recurrent(q, k, v, g, beta, initial_state=s0)
    o_c, s_c = kda_chunkwise(q, k, v, g, beta, initial_state=s0, chunk_size=chunk)
    torch.testing.assert_close(o_c, o_r, atol=1e-5, rtol=0)
    torch.testing.assert_close(s_c, s_r, atol=1e-5, rtol=0)


@pytest.mark.parametrize("T", [20, 64, 70])
@pytest.mark.parametrize("with_state", [False, True])
def test_both_forms_equal_flash_linear_attention_reference(T, with_state):
    naive = fla_naive()
    q, k, v, g, beta, s0 = inputs(T=T, seed=1)
    s0 = s0 if with_state else None
    o_ref, s_ref = naive.naive_recurrent_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    for o, s in (kda_recurrent(q, k, v, g, beta, initial_state=s0),
                 kda_chunkwise(q, k, v, g, beta, initial_state=s0, chunk_size=16)):
        torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(s, s_ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("sub", [4, 8, 16])
def test_blocked_decayed_scores_equal_the_pairwise_formula(sub):
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(2, 3, 16, 5, generator=g), torch.randn(3, 16, 5, generator=g)
    G = (-torch.rand(3, 16, 5, generator=g) * 3).cumsum(-2)
    got = decayed_scores(a, b, G, sub=sub)
    want = torch.einsum("mcid,cjd,cijd->mcij", a, b, (G[:, :, None] - G[:, None]).exp()).tril()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_chunkwise_survives_strong_decay():
    # log-decays of up to -40 per token: a factorised exp(G_i) * exp(-G_j) would overflow fp32
    q, k, v, g, beta, s0 = inputs(T=64, decay=40.0)
    o_c, s_c = kda_chunkwise(q, k, v, g, beta, initial_state=s0, chunk_size=64)
    o_r, s_r = kda_recurrent(q, k, v, g, beta, initial_state=s0)
    assert torch.isfinite(o_c).all() and torch.isfinite(s_c).all()
    torch.testing.assert_close(o_c, o_r, atol=1e-5, rtol=0)


def test_zero_beta_and_decay_leave_the_state_unchanged():
    # the padding rule the batched layer relies on
    q, k, v, g, beta, s0 = inputs(T=9)
    g[:, 4:] = 0
    beta[:, 4:] = 0
    _, s_short = kda_chunkwise(q[:, :4], k[:, :4], v[:, :4], g[:, :4], beta[:, :4], initial_state=s0, chunk_size=4)
    _, s_long = kda_chunkwise(q, k, v, g, beta, initial_state=s0, chunk_size=4)
    torch.testing.assert_close(s_long, s_short, atol=1e-6, rtol=0)


def test_chunkwise_layer_never_calls_the_recurrent_step(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the chunkwise path called the recurrent step")

    model = tiny_model()
    ids = torch.randint(0, model.config.vocab_size, (2, 70))
    monkeypatch.setattr(kda_mod, "kda_recurrent", forbidden)
    with torch.no_grad():
        model(ids)  # full forward: chunkwise
        model(ids[:, :30], cache=model.new_cache(2, 80))  # multi-token prefill into a cache: chunkwise


def test_short_conv_with_carried_tail_equals_one_pass():
    torch.manual_seed(0)
    C, kernel, T = 6, 4, 11
    x = torch.randn(2, T, C)
    w = torch.randn(C, kernel)
    lens = torch.tensor([T, T])
    full, _ = short_conv(x, torch.zeros(2, kernel - 1, C), w, lens)
    first, tail = short_conv(x[:, :5], torch.zeros(2, kernel - 1, C), w, torch.tensor([5, 5]))
    second, _ = short_conv(x[:, 5:], tail, w, torch.tensor([T - 5, T - 5]))
    torch.testing.assert_close(torch.cat((first, second), 1), full)
    # the carried tail is the last kernel-1 real inputs, wherever each sequence's padding starts
    _, tail = short_conv(x, torch.zeros(2, kernel - 1, C), w, torch.tensor([7, 2]))
    torch.testing.assert_close(tail[0], x[0, 4:7])
    torch.testing.assert_close(tail[1, 1:], x[1, :2])
    assert (tail[1, 0] == 0).all()


def test_kda_decode_state_is_constant_size(model):
    cache = model.new_cache(1, 64)
    shapes = [(c.state.shape, c.conv.shape) for c in cache.layers if hasattr(c, "state")]
    cfg = model.config
    H, dk = cfg.kda_num_heads, cfg.kda_head_dim
    # one slot and the scratch slot (padding rows of compiled decode steps write there)
    assert shapes == [((2, H, dk, dk), (2, cfg.kda_conv_size - 1, 3 * H * dk))] * len(cfg.kda_layers)
    batch = Batch.build([5])
    assert batch.max_len == 5


def test_decode_layouts_change_strides_only(tmp_path):
    """use_decode_layouts (the runner calls it before compiling) stores the conv weights tap-major: the same
    values, shapes and names, so eager steps, state dicts and checkpoints are unchanged; a second call keeps
    the storage (a compiled graph reads the tensors it was compiled against)."""
    import horizon

    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cache = model.new_cache(1, 64)
    tokens = torch.randint(40, 4000, (9,), generator=torch.Generator().manual_seed(0))

    def prefill_and_step():
        cache.reset()
        model.forward_batch(tokens[:8], Batch.build([8], slots=[0]), cache, last_only=True)
        return model.forward_batch(tokens[8:], Batch.build([1], start=[8], slots=[0]), cache, last_only=True)

    with torch.inference_mode():
        ref = prefill_and_step()
        model.use_decode_layouts()
        convs = [layer.attn.conv_weight for layer in model.layers if hasattr(layer.attn, "conv_weight")]
        assert convs and all(w.t().is_contiguous() and not w.is_contiguous() for w in convs)
        ptrs = [w.data_ptr() for w in convs]
        model.use_decode_layouts()
        assert [w.data_ptr() for w in convs] == ptrs
        assert torch.equal(prefill_and_step(), ref)
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    horizon.save(model, tmp_path / "ckpt")
    loaded = horizon.load(tmp_path / "ckpt").state_dict()
    assert all(torch.equal(loaded[k], before[k]) for k in before)


needs_kernels = pytest.mark.skipif(not kernel_available(), reason="the CPU kernels did not build")


def decode_inputs(B, H, K, V, slots, seed=0):
    q, k, v, g, beta, _ = inputs(B=B, T=1, H=H, K=K, V=V, seed=seed)
    state = torch.randn(slots, H, K, V, generator=torch.Generator().manual_seed(seed + 1))
    return state, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0]


def test_decode_reference_is_the_recurrent_step_on_gathered_states():
    state, q, k, v, g, beta = decode_inputs(B=3, H=2, K=16, V=12, slots=5)
    slots = torch.tensor([4, 0, 2])
    before = state.clone()
    o = kda_decode_reference(state, slots, q, k, v, g, beta)
    want_o, want_s = kda_recurrent(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                                   initial_state=before[slots])
    assert torch.equal(o, want_o[:, 0]) and torch.equal(state[slots], want_s)
    assert torch.equal(state[[1, 3]], before[[1, 3]])  # slots nobody uses are left alone


@needs_kernels
@pytest.mark.parametrize("portable", [pytest.param(False, id="simd"), pytest.param(True, id="portable")])
@pytest.mark.parametrize("K, V", [(64, 64), (16, 32), (32, 16), (8, 128), (12, 24)])  # 24: no AVX-512 width
def test_decode_kernel_equals_reference_in_place(portable, K, V):
    """The kernel's outputs and updated states equal the reference's (fp32 summation order apart), only the
    batch's slots change, and rows sharing a slot (the engine's padding: g = beta = 0) leave it as it was."""
    state, q, k, v, g, beta = decode_inputs(B=7, H=3, K=K, V=V, slots=9)
    slots = torch.tensor([5, 8, 0, 8, 3, 8, 6])
    for b in (1, 3, 5):  # padding rows in the scratch slot 8
        g[b], beta[b] = 0, 0
    want_state, got_state = state.clone(), state.clone()
    want = kda_decode_reference(want_state, slots, q, k, v, g, beta)
    got = kda_decode(got_state, slots, q, k, v, g, beta, force_portable=portable)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-6)
    assert torch.equal(got_state[8], state[8])
    assert torch.equal(got_state[[1, 2, 4, 7]], state[[1, 2, 4, 7]])


@needs_kernels
@pytest.mark.parametrize("portable", [pytest.param(False, id="simd"), pytest.param(True, id="portable")])
def test_decode_kernel_reads_strided_rows_in_place(portable):
    """Views as a compiled step passes them (slices of a wider projection, a transposed batch, a strided last
    dimension, which is copied) give what contiguous copies of the same values give."""
    state, q, k, v, g, beta = decode_inputs(B=5, H=3, K=32, V=32, slots=6)
    slots = torch.tensor([4, 0, 2, 5, 1])
    wide = torch.randn(5, 3, 96)
    wide[..., 16:48] = q
    qv = wide[..., 16:48]  # rows 96 apart, heads 96 apart
    kt = k.transpose(0, 1).contiguous().transpose(0, 1)  # batch stride K, head stride B * K
    vt = torch.randn(3, 5, 32)
    vt.copy_(v.transpose(0, 1))
    vt = vt.transpose(0, 1)  # [B, H, V] with batch stride 32, head stride 5 * 32
    gs = torch.zeros(5, 3, 64)
    gs[..., ::2] = g
    gs = gs[..., ::2]  # last dimension strided: the kernel copies this one
    bt = beta.t().contiguous().t()
    assert not (qv.is_contiguous() or vt.is_contiguous() or gs.is_contiguous() or bt.is_contiguous())
    want_state, got_state = state.clone(), state.clone()
    want = kda_decode(want_state, slots, q, k, v, g, beta, force_portable=portable)
    got = kda_decode(got_state, slots, qv, kt, vt, gs, bt, force_portable=portable)
    assert torch.equal(got, want) and torch.equal(got_state, want_state)


@needs_kernels
def test_decode_kernel_steps_carry_the_state_like_the_chunkwise_form():
    """Twelve decode steps through the kernel end where one chunkwise pass over the same tokens ends."""
    q, k, v, g, beta, s0 = inputs(B=2, T=12, H=2, K=64, V=64, seed=3)
    state = torch.zeros(3, 2, 64, 64)
    state[[2, 0]] = s0
    slots = torch.tensor([2, 0])
    outs = [kda_decode(state, slots, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t]) for t in range(12)]
    want_o, want_s = kda_chunkwise(q, k, v, g, beta, initial_state=s0, chunk_size=4)
    torch.testing.assert_close(torch.stack(outs, 1), want_o, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state[[2, 0]], want_s, rtol=1e-4, atol=1e-5)


@needs_kernels
def test_decode_with_gradients_takes_the_reference():
    """The op has no backward: inputs that need a gradient go through the reference, which has one."""
    state, q, k, v, g, beta = decode_inputs(B=2, H=2, K=16, V=16, slots=3)
    v.requires_grad_(True)
    o = kda_decode(state.clone(), torch.tensor([0, 2]), q, k, v, g, beta)
    o.sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0


@needs_kernels
def test_decode_kernel_rejects_bad_inputs_clearly():
    state, q, k, v, g, beta = decode_inputs(B=2, H=2, K=16, V=16, slots=3)
    op = torch.ops.horizon_kernels.kda_decode_
    alpha = g.exp()
    with pytest.raises(RuntimeError, match=r"slots\[1\] = 3 is not in \[0, 3\)"):
        op(state, torch.tensor([0, 3]), q, k, v, alpha, beta, 0.25)
    with pytest.raises(RuntimeError, match=r"v must be a float32 CPU tensor \[2, 2, 16\]"):
        op(state, torch.tensor([0, 1]), q, k, v[:, :, :8], alpha, beta, 0.25)
    with pytest.raises(RuntimeError, match="state must be a contiguous float32"):
        op(state.double(), torch.tensor([0, 1]), q, k, v, alpha, beta, 0.25)
    empty = op(state, torch.zeros(0, dtype=torch.long), q[:0], k[:0], v[:0], alpha[:0], beta[:0], 0.25)
    assert empty.shape == (0, 2, 16)


@needs_kernels
def test_decode_kernel_in_a_compiled_graph_updates_the_cache_itself():
    """Compiled, the op writes the cache tensor it is given (no copy of the whole cache), and equals eager (up
    to the last bits of exp(g), which inductor computes with its own vectorised exp)."""
    state, q, k, v, g, beta = decode_inputs(B=4, H=2, K=16, V=16, slots=6, seed=5)
    slots = torch.tensor([1, 4, 5, 5])
    g[3], beta[3] = 0, 0
    eager_state = state.clone()
    compiled = torch.compile(lambda *a: kda_decode(state, *a) * 2, fullgraph=True)
    for _ in range(2):
        got = compiled(slots, q, k, v, g, beta)
        want = kda_decode(eager_state, slots, q, k, v, g, beta) * 2
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(state, eager_state, rtol=1e-6, atol=1e-7)
    assert not torch.equal(state, decode_inputs(B=4, H=2, K=16, V=16, slots=6, seed=5)[0])  # it did write


# the chunkwise kernel's vector paths (AVX-512, or AVX2: HORIZON_AVX512=0 sends it there, and the rerun in
# test_mxfp4_kernel.py takes the tests named chunkwise_kernel so)
needs_vector_path = pytest.mark.skipif(vector_path() == "portable", reason="no AVX-512 or AVX2 kernel path here")


@needs_vector_path
@pytest.mark.parametrize("B, T, H, K, chunk, decay", [(2, 50, 3, 16, 16, 2.0), (1, 130, 2, 64, 64, 0.5),
                                                      (1, 64, 1, 64, 64, 2.0), (1, 200, 2, 128, 32, 1.0),
                                                      (2, 97, 3, 32, 64, 40.0)])  # 40: exponents far below -87
@pytest.mark.parametrize("with_state", [False, True])
def test_chunkwise_kernel_equals_the_reference_and_the_recurrence(B, T, H, K, chunk, decay, with_state):
    """The chunkwise prefill through the kernel (K = V, chunk a multiple of 16) gives the recurrence's outputs and
    final state, and the reference's, at every decay strength, with a partial last chunk or none; the initial
    state passed in is left as it was."""
    q, k, v, g, beta, s0 = inputs(B=B, T=T, H=H, K=K, V=K, decay=decay)
    s0 = s0 if with_state else None
    before = None if s0 is None else s0.clone()
    o, s = kda_chunkwise(q, k, v, g, beta, initial_state=s0, chunk_size=chunk)
    o_r, s_r = kda_recurrent(q, k, v, g, beta, initial_state=s0)
    o_ref, s_ref = kda_chunkwise_reference(q, k, v, g, beta, initial_state=s0, chunk_size=chunk)
    assert o.shape == o_r.shape and s.shape == s_r.shape
    for got, want in ((o, o_r), (s, s_r), (o, o_ref), (s, s_ref)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert s0 is None or torch.equal(s0, before)


@needs_vector_path
def test_chunkwise_kernel_carries_the_state_through_padding():
    """Positions with g = beta = 0 (how batches pad a shorter sequence) leave the state as it was: a sequence
    padded from 20 to 45 tokens ends where it ends alone, and its first 20 outputs are its own."""
    q, k, v, g, beta, s0 = inputs(B=1, T=45, H=2, K=32, V=32, seed=4)
    g[:, 20:], beta[:, 20:] = 0, 0
    o_pad, s_pad = kda_chunkwise(q, k, v, g, beta, initial_state=s0, chunk_size=16)
    o, s = kda_chunkwise(q[:, :20], k[:, :20], v[:, :20], g[:, :20], beta[:, :20], initial_state=s0, chunk_size=16)
    torch.testing.assert_close(s_pad, s, atol=1e-6, rtol=0)
    torch.testing.assert_close(o_pad[:, :20], o, atol=1e-6, rtol=0)


@needs_vector_path
def test_chunkwise_takes_the_kernel_and_training_the_reference(monkeypatch):
    """Without gradients, with K = V and a chunk size that is a multiple of 16, kda_chunkwise runs the kernel;
    otherwise (another chunk size, K != V, inputs that need a gradient: the op has no backward) the reference."""
    calls = []
    reference = kda_mod.kda_chunkwise_reference
    monkeypatch.setattr(kda_mod, "kda_chunkwise_reference", lambda *a, **kw: calls.append(1) or reference(*a, **kw))
    q, k, v, g, beta, s0 = inputs(T=40, K=16, V=16)
    kda_chunkwise(q, k, v, g, beta, initial_state=s0, chunk_size=16)
    assert not calls
    kda_chunkwise(q, k, v, g, beta, initial_state=s0, chunk_size=8)
    kda_chunkwise(q, k, v[..., :12], g, beta, initial_state=s0[..., :12], chunk_size=16)
    assert len(calls) == 2
    k.requires_grad_(True)
    o, _ = kda_chunkwise(q, k, v, g, beta, initial_state=s0, chunk_size=16)
    o.sum().backward()
    assert len(calls) == 3 and k.grad is not None and k.grad.abs().sum() > 0


@needs_vector_path
def test_chunkwise_kernel_rejects_bad_inputs_clearly():
    q, k, v, g, beta, s0 = inputs(T=20, K=16, V=16)
    op = torch.ops.horizon_kernels.kda_chunk_forward_
    with pytest.raises(RuntimeError, match=r"g must be a float32 CPU tensor \[2, 20, 3, 16\]"):
        op(s0.clone(), q, k, v, g.double(), beta, 0.25, 16)
    with pytest.raises(RuntimeError, match="chunk size must be a positive multiple of 16, got 24"):
        op(s0.clone(), q, k, v, g, beta, 0.25, 24)
    with pytest.raises(RuntimeError, match=r"state must be a contiguous float32 CPU tensor \[2, 3, 16, 16\]"):
        op(s0[:1].clone(), q, k, v, g, beta, 0.25, 16)
    with pytest.raises(RuntimeError, match="K = V in \\{16, 32, 64, 128\\}, got K = 8"):
        op(s0[..., :8, :8].contiguous(), q[..., :8], k[..., :8], v[..., :8], g[..., :8], beta, 0.25, 16)


@needs_vector_path
def test_chunkwise_kernel_traces_into_a_compiled_graph():
    """The op's fake (shape and dtype) lets torch.compile trace kda_chunkwise whole, without a graph break,
    and the compiled call equals eager; the state it fills is a fresh tensor, so the inputs stay as they were."""
    q, k, v, g, beta, s0 = inputs(B=2, T=37, H=2, K=16, V=16, seed=6)
    before = s0.clone()
    compiled = torch.compile(lambda *a: kda_chunkwise(*a, initial_state=s0, chunk_size=16), fullgraph=True)
    got_o, got_s = compiled(q, k, v, g, beta)
    want_o, want_s = kda_chunkwise(q, k, v, g, beta, initial_state=s0, chunk_size=16)
    torch.testing.assert_close(got_o, want_o, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_s, want_s, rtol=1e-6, atol=1e-6)
    assert torch.equal(s0, before)
