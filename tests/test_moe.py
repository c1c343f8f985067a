"""MoE: gate weights, bias-driven selection, group-limited routing, balancing, batched dispatch."""

import pytest
import torch

from horizon.model import balance_moe_bias
from horizon.model.moe import MoE, Router, _grouped_mm_takes, dispatch, glu_expert, grouped_experts
from horizon.quant.kernels import kernel_available

from .conftest import tiny


def router(seed=0, **changes) -> Router:
    torch.manual_seed(seed)
    r = Router(tiny(**changes))
    torch.nn.init.normal_(r.weight, std=0.5)
    return r


def test_gates_are_normalised_scores_times_scaling_whatever_the_bias():
    r = router(routed_scaling_factor=2.5, n_group=1, topk_group=1)
    x = torch.randn(64, 64)
    scores = torch.sigmoid(x @ r.weight.T)
    _, before = r(x)
    r.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, 8))
    weights, idx = r(x)
    assert not torch.equal(idx.sort(-1).values, before.sort(-1).values)  # the bias changed the choice
    chosen = scores.gather(1, idx)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True) * 2.5)
    # the choice is top-k of s + b
    want = (scores + r.e_score_correction_bias).topk(r.top_k, -1).indices
    assert torch.equal(idx.sort(-1).values, want.sort(-1).values)


def test_a_large_bias_forces_an_expert_in():
    r = router(n_group=1, topk_group=1)
    r.e_score_correction_bias[5] = 10.0
    _, idx = r(torch.randn(32, 64))
    assert (idx == 5).any(-1).all()


def test_group_limiting_keeps_experts_inside_the_best_groups():
    r = router(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3)
    r.e_score_correction_bias.copy_(torch.randn(8) * 0.2)
    x = torch.randn(200, 64)
    _, idx = r(x)
    s = torch.sigmoid(x @ r.weight.T) + r.e_score_correction_bias
    group_score = s.view(200, 4, 2).topk(2, -1).values.sum(-1)  # each group's two best, summed
    best = group_score.topk(2, -1).indices
    allowed = torch.zeros(200, 4, dtype=torch.bool).scatter(1, best, True).repeat_interleave(2, 1)
    assert allowed.gather(1, idx).all()
    # and within the allowed experts it is plain top-k of s + b
    want = s.masked_fill(~allowed, -float("inf")).topk(3, -1).indices
    assert torch.equal(idx.sort(-1).values, want.sort(-1).values)
    # without the limit, some tokens would pick outside those groups (so the test has teeth)
    free = s.topk(3, -1).indices
    assert not allowed.gather(1, free).all()


needs_kernels = pytest.mark.skipif(not kernel_available(), reason="the CPU kernels did not build")


@needs_kernels
@pytest.mark.parametrize("E, G, kept, k", [(8, 2, 1, 2), (64, 4, 2, 4), (64, 1, 1, 6), (12, 3, 2, 3), (608, 8, 4, 16)])
def test_router_kernel_selects_what_the_reference_selects(E, G, kept, k):
    """The group-limited top-k kernel gives the reference's experts in the reference's order (largest choice
    first), with a bias, at the tiny, small and 2.8t shapes and without groups; a NaN score ranks first in both."""
    r = router(n_routed_experts=E, n_group=G, topk_group=kept, num_experts_per_tok=k)
    r.e_score_correction_bias.copy_(torch.randn(E, generator=torch.Generator().manual_seed(1)) * 0.1)
    scores = torch.rand(300, E, generator=torch.Generator().manual_seed(2))
    scores[7, E // 2] = float("nan")
    got = r.select(scores)
    assert got.dtype == torch.int64 and torch.equal(got, r.select_reference(scores))
    assert got[7, 0] == E // 2


@needs_kernels
def test_router_kernel_breaks_ties_toward_lower_indices_and_rejects_bad_shapes():
    """Equal choices rank the lower index first (groups, then experts); a selection the groups cannot fill, or
    groups that do not divide the experts, get a clear error."""
    op = torch.ops.horizon_kernels.grouped_topk
    scores = torch.full((2, 8), 0.5)
    assert op(scores, torch.zeros(8), 3, 4, 2).tolist() == [[0, 1, 2]] * 2
    scores[1, 6:] = 0.9  # group 3 now leads
    assert op(scores, torch.zeros(8), 3, 4, 2).tolist()[1] == [6, 7, 0]
    with pytest.raises(RuntimeError, match=r"k must be in \[1, 4\] \(the experts of the kept groups\), got 5"):
        op(scores, torch.zeros(8), 5, 4, 2)
    with pytest.raises(RuntimeError, match="need n_group dividing E = 8"):
        op(scores, torch.zeros(8), 2, 3, 1)
    with pytest.raises(RuntimeError, match=r"bias must be a float32 CPU tensor \[8\]"):
        op(scores, torch.zeros(7), 2, 4, 2)


@needs_kernels
def test_router_forward_selects_through_the_kernel_and_still_trains(monkeypatch):
    """Router.forward takes its experts from the kernel on the CPU (the indices carry no gradient), and the gate
    weights still give the router's weight a gradient."""
    r = router()
    monkeypatch.setattr(Router, "select_reference", lambda *a: pytest.fail("the reference ran"))
    weights, idx = r(torch.randn(16, 64))
    weights.sum().backward()
    assert idx.shape == (16, r.top_k) and r.weight.grad is not None and r.weight.grad.abs().sum() > 0


def test_batched_dispatch_equals_a_per_token_reference():
    torch.manual_seed(0)
    moe = MoE(tiny())
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(37, 64)
    weights, idx = moe.gate(x)
    ref = torch.stack([
        sum(weights[n, j] * moe.experts.expert(int(idx[n, j]), x[n:n + 1])[0] for j in range(idx.shape[1]))
        for n in range(x.shape[0])
    ]) + moe.shared_experts(x)
    torch.testing.assert_close(moe(x), ref, atol=1e-6, rtol=1e-5)


def test_bias_updates_drive_a_skewed_router_toward_uniform_load():
    torch.manual_seed(0)
    moe = MoE(tiny(n_group=1, topk_group=1, n_routed_experts=8, num_experts_per_tok=2)).train()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    with torch.no_grad():  # a feature that is always on pushes experts 0 and 1 up for every token
        moe.gate.weight[:, 0] = 0.0
        moe.gate.weight[:2, 0] = 2.0
    gen = torch.Generator().manual_seed(1)

    def tokens(n: int) -> torch.Tensor:
        x = torch.randn(n, 64, generator=gen)
        x[:, 0] = 1.0
        return x

    held_out = tokens(4096)

    def load_spread() -> float:  # coefficient of variation of the per-expert load
        _, idx = moe.gate(held_out)
        load = torch.bincount(idx.flatten(), minlength=8).float()
        return float(load.std() / load.mean())

    start = load_spread()
    with torch.no_grad():
        for _ in range(200):
            moe(tokens(256))
            balance_moe_bias(moe, gamma=0.003)
    end = load_spread()
    assert start > 1.0 and end < 0.15, (start, end)
    assert abs(float(moe.gate.e_score_correction_bias.sum())) < 1e-4  # centred updates
    assert int(moe.load.sum()) == 0  # counts restart after each update


def test_bias_and_loads_keep_their_precision_under_bf16():
    moe = MoE(tiny()).to(torch.bfloat16)
    assert moe.gate.e_score_correction_bias.dtype == torch.float32
    assert moe.load.dtype == torch.int64
    assert moe.gate.weight.dtype == torch.bfloat16


def _experts_problem(N, k, E, d, f, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, d, generator=gen).to(dtype)
    gate_up = (torch.randn(E, 2 * f, d, generator=gen) * d ** -0.5).to(dtype)
    down = (torch.randn(E, d, f, generator=gen) * f ** -0.5).to(dtype)
    idx = torch.rand(N, E, generator=gen).argsort(-1)[:, :k]
    weights = torch.rand(N, k, generator=gen).softmax(-1)
    return x, weights, idx, gate_up, down


def _dispatched(x, weights, idx, gate_up, down):
    return dispatch(x, weights, idx, gate_up.shape[0], lambda e, xs: glu_expert(gate_up[e], down[e], xs))[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_the_dispatch_loop(dtype):
    """The host-sync-free grouped form (CUDA graphs' path for dense experts past 2E pairs, on sm90 in bf16),
    checked here through torch._grouped_mm's CPU kernel: the same sums as the per-expert loop, also with
    experts nobody routes to and with another rank's experts (id E, weight 0, under expert parallelism)."""
    for N, k, E in [(20, 2, 8), (3, 4, 16), (50, 4, 8)]:
        x, weights, idx, gate_up, down = _experts_problem(N, k, E, 64, 48, dtype)
        assert torch.equal(grouped_experts(x, weights, idx, gate_up, down), _dispatched(x, weights, idx, gate_up, down))
        idx[::3, 0] = E
        weights = weights * (idx < E)
        got = grouped_experts(x, weights, idx, gate_up, down)
        assert torch.equal(got, _dispatched(x, weights, idx, gate_up, down)) and got.isfinite().all()
    assert not _grouped_mm_takes(x, gate_up)  # on the CPU the loop (or the kernels) keep the call


def test_grouped_experts_compile_into_one_graph():
    """fullgraph: no host sync in the trace (torch._grouped_mm's fake takes bf16 only, as its fused kernel)."""
    x, weights, idx, gate_up, down = _experts_problem(24, 4, 8, 64, 32, torch.bfloat16)
    compiled = torch.compile(grouped_experts, fullgraph=True, dynamic=False)
    for seed in range(2):
        idx = torch.rand(24, 8, generator=torch.Generator().manual_seed(seed)).argsort(-1)[:, :4]
        want = _dispatched(x, weights, idx, gate_up, down)
        # inductor fuses silu * up in fp32 before rounding: a bf16 step or two apart
        torch.testing.assert_close(compiled(x, weights, idx, gate_up, down), want, rtol=2 ** -6, atol=2 ** -6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dense_experts_past_2e_pairs_capture_in_a_cuda_graph(dtype):
    """Past 2E pairs a CUDA step takes torch._grouped_mm in bf16 on compute capability 9.0+, else the per-pair
    product-and-sum (fp32 here): either captures in a CUDA graph (the host-syncing loop would not)."""
    from horizon.model.moe import Experts

    if dtype == torch.bfloat16 and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._grouped_mm's fused kernel needs compute capability 9.0+")
    experts = Experts(8, 64, 32).cuda().to(dtype)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x, weights, idx, _, _ = _experts_problem(24, 4, 8, 64, 32, dtype)  # 96 pairs > 2E
    x, weights, idx = x.cuda(), weights.cuda(), idx.cuda()
    assert _grouped_mm_takes(x, experts.gate_up_proj) == (dtype == torch.bfloat16)
    want = _dispatched(x, weights, idx, experts.gate_up_proj, experts.down_proj)
    experts.sync_free(x, weights, idx)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts.sync_free(x, weights, idx)
    graph.replay()
    tol = 2 ** -6 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)
