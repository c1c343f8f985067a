"""Quantised layers: a quantised model computes exactly what dequantised weights compute, holds only packed
bytes for its experts, stores them under the gpt-oss names, matches the plan's byte count, and still decodes
from its cache like one full forward."""

import copy

import pytest
import torch
from torch import nn

from horizon.model import HorizonForCausalLM
from horizon.model.moe import Experts
from horizon.plan import mxfp4_nbytes, plan
from horizon.quant import (
    ATTENTION_PROJECTIONS,
    MXFP4Experts,
    MXFP4Linear,
    canonical_name,
    canonical_state_dict,
    dequantize,
    empty_quantized_model,
    quantize,
    quantize_model,
)

from .conftest import tiny, tiny_model
from .test_model import decode_in_steps

PACKED = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")


def rounded(t: torch.Tensor) -> torch.Tensor:
    """t through MXFP4 and back, in t's dtype."""
    return dequantize(*quantize(t), t.dtype, t.shape[-1])


@torch.no_grad()
def with_rounded_weights(model: HorizonForCausalLM, attention: bool) -> HorizonForCausalLM:
    """The reference: the same full-precision model with the to-be-quantised weights replaced by their rounding."""
    ref = copy.deepcopy(model)
    for parent in ref.modules():
        if isinstance(parent, Experts):
            parent.gate_up_proj.copy_(rounded(parent.gate_up_proj))
            parent.down_proj.copy_(rounded(parent.down_proj))
        for name in ATTENTION_PROJECTIONS.get(type(parent), ()) if attention else ():
            if isinstance(getattr(parent, name, None), nn.Linear):
                getattr(parent, name).weight.copy_(rounded(getattr(parent, name).weight))
    return ref


@pytest.mark.parametrize("attention", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantized_model_equals_the_model_with_dequantized_weights(attention, dtype):
    model = tiny_model(dtype=dtype)
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    ref = with_rounded_weights(model, attention)
    with torch.no_grad():
        before = model(ids)
        quantize_model(model, attention=attention)
        got, want = model(ids), ref(ids)
    assert not torch.equal(before, want)  # the rounding changed the weights (so the comparison has teeth)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)  # the same ops on the same values: equal in practice


def test_quantized_experts_hold_no_float_tensor_of_expert_shape():
    model = tiny_model()
    cfg = model.config
    E, d, f = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    floats_before = sum(t.numel() for t in list(model.parameters()) + list(model.buffers()) if t.is_floating_point())
    quantize_model(model)
    experts = [m for m in model.modules() if isinstance(m, MXFP4Experts)]
    assert len(experts) == cfg.num_layers - cfg.first_k_dense
    assert not any(isinstance(m, Experts) for m in model.modules())
    for m in experts:
        assert not list(m.parameters())
        assert {b.dtype for b in m.buffers()} == {torch.uint8}
    tensors = list(model.parameters()) + list(model.buffers())
    assert not any(t.is_floating_point() and tuple(t.shape) in {(E, 2 * f, d), (E, d, f)} for t in tensors)
    # and the float tensors left are exactly the model's minus the experts': no copy is kept anywhere
    floats_after = sum(t.numel() for t in tensors if t.is_floating_point())
    assert floats_after == floats_before - (cfg.num_layers - cfg.first_k_dense) * E * 3 * f * d


@pytest.mark.parametrize("attention", [False, True])
def test_state_dict_holds_exactly_the_packed_tensors_under_gpt_oss_names(attention):
    model = tiny_model()
    cfg = model.config
    full = model.state_dict()
    quantize_model(model, attention=attention)
    sd = model.state_dict()
    nb_d, nb_f = -(-cfg.hidden_size // 32), -(-cfg.moe_intermediate_size // 32)
    E, d, f = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    shapes = {"gate_up_proj_blocks": (E, 2 * f, nb_d, 16), "gate_up_proj_scales": (E, 2 * f, nb_d),
              "down_proj_blocks": (E, d, nb_f, 16), "down_proj_scales": (E, d, nb_f)}
    for i in range(cfg.first_k_dense, cfg.num_layers):
        prefix = f"layers.{i}.mlp.experts."
        assert sorted(k for k in sd if k.startswith(prefix)) == sorted(prefix + n for n in PACKED)
        for n in PACKED:
            assert sd[prefix + n].dtype == torch.uint8 and tuple(sd[prefix + n].shape) == shapes[n]
    # every other tensor is the full-precision model's, except the quantised attention projections
    linears = {f"{p}.{n}.weight" for p, m in model.named_modules() for n in ATTENTION_PROJECTIONS.get(type(m), ())
               if attention and hasattr(m, n)}
    kept = {k for k in full if ".experts." not in k and k not in linears}
    assert kept == {k for k in sd if not k.endswith(("_blocks", "_scales"))}
    packed_linears = {k for k in sd if k.endswith(("_blocks", "_scales")) and ".experts." not in k}
    assert packed_linears == {k[: -len(".weight")] + s for k in linears for s in (".weight_blocks", ".weight_scales")}


def test_attention_quantizes_only_the_listed_projections_never_gates_router_embeddings_or_head():
    model = quantize_model(tiny_model(), attention=True)
    quantized = {n for n, m in model.named_modules() if isinstance(m, MXFP4Linear)}
    assert quantized and all(n.rsplit(".", 1)[-1] in {p for ps in ATTENTION_PROJECTIONS.values() for p in ps}
                             for n in quantized)
    gates = {"f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj", "gate_a", "gate_b"}  # KDA's and DSA's
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):  # full precision: gates, the indexer, the MLPs, the head, the vision encoder
            assert (name.rsplit(".", 1)[-1] in gates or ".indexer." in name or ".mlp." in name
                    or name == "lm_head" or name.startswith("vision.")), name
    assert isinstance(model.embed, nn.Embedding) and isinstance(model.lm_head, nn.Linear)
    assert all(isinstance(m.gate.weight, nn.Parameter) for m in model.modules() if hasattr(m, "shared_experts"))


@pytest.mark.parametrize("attention", [False, True])
@pytest.mark.parametrize("changes", [{}, {"moe_intermediate_size": 40}])  # 40: experts padded to whole blocks
def test_plan_mxfp4_bytes_equal_the_resident_bytes_of_a_quantized_model(changes, attention):
    model = quantize_model(tiny_model(dtype="bfloat16", **changes), attention=attention)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    packed = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith(("_blocks", "_scales")))
    if not attention:  # the plan counts routed experts in MXFP4 and everything else in bf16
        assert params + packed == plan(model.config)["weight_bytes_mxfp4"]
    cfg = model.config
    E, d, f = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    for m in model.modules():
        if isinstance(m, MXFP4Experts):
            got = sum(b.numel() for b in m.buffers())
            assert got == mxfp4_nbytes(torch.Size((E, 2 * f, d))) + mxfp4_nbytes(torch.Size((E, d, f)))
        if isinstance(m, MXFP4Linear):
            assert sum(b.numel() for b in m.buffers()) == mxfp4_nbytes(torch.Size((m.out_features, m.in_features)))


@pytest.mark.parametrize("attention", [False, True])
def test_cached_decode_equals_full_forward_for_a_quantized_model(attention):
    model = quantize_model(tiny_model(), attention=attention)
    lens = [30, 17]
    ids = torch.randint(0, model.config.vocab_size, (2, max(lens)))
    with torch.no_grad():
        full = model(ids, lengths=lens)
        stepped, _ = decode_in_steps(model, ids, lens, chunks=[[9, 8], [5, 4]], max_len=32)
    for b, n in enumerate(lens):
        torch.testing.assert_close(stepped[b], full[b, :n], atol=1e-4, rtol=0)


@pytest.mark.parametrize("attention", [False, True])
def test_an_empty_quantized_model_built_on_meta_loads_a_quantized_state_dict(attention):
    model = quantize_model(tiny_model(), attention=attention)
    with torch.device("meta"):
        empty = HorizonForCausalLM(model.config, init=False)
    empty_quantized_model(empty, attention=attention)
    assert {k: (v.shape, v.dtype) for k, v in empty.state_dict().items()} == \
           {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
    empty.to_empty(device="cpu")
    empty.load_state_dict(model.state_dict())
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    with torch.no_grad():
        assert torch.equal(empty.eval()(ids), model(ids))
    # on CPU the swapped-in modules start zero-filled: unloaded experts contribute exactly nothing
    zero = empty_quantized_model(tiny_model(), attention=attention)
    assert all(not b.any() for n, b in zero.named_buffers() if n.endswith(("_blocks", "_scales")))


def test_only_the_experts_a_step_routes_to_are_dequantized(monkeypatch):
    monkeypatch.setattr("horizon.quant.kernels._built", False)  # the dequantising fallback
    model = quantize_model(tiny_model())
    experts = model.layers[1].mlp.experts
    seen = []
    real = MXFP4Experts.weight

    def spy(self, name, e, dtype):
        seen.append(e)
        return real(self, name, e, dtype)

    monkeypatch.setattr(MXFP4Experts, "weight", spy)
    x = torch.randn(5, model.config.hidden_size)
    idx = torch.tensor([[1, 3], [3, 1], [1, 3], [6, 1], [3, 6]])
    y, counts = experts(x, torch.full((5, 2), 0.5), idx)
    assert sorted(set(seen)) == [1, 3, 6] and len(seen) == 6  # gate_up and down, once per routed expert
    assert counts.tolist() == [0, 4, 0, 4, 0, 0, 2, 0]
    want = torch.stack([sum(0.5 * experts.expert(int(e), x[t:t + 1])[0] for e in idx[t]) for t in range(5)])
    torch.testing.assert_close(y, want, atol=1e-6, rtol=0)


def test_experts_dequantize_one_expert_matrix_at_a_time(monkeypatch):
    import horizon.quant.layers as layers

    monkeypatch.setattr("horizon.quant.kernels._built", False)  # the dequantising fallback
    model = quantize_model(tiny_model())
    experts = model.layers[1].mlp.experts
    d, f = experts.dim, experts.hidden
    shapes = []
    real = layers.dequantize

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(layers, "dequantize", spy)
    E = experts.n_experts
    experts(torch.randn(E, d), torch.ones(E, 2), torch.stack((torch.arange(E), torch.arange(E).roll(1)), 1))
    assert sorted(shapes) == sorted([(2 * f, d), (d, f)] * E)  # every expert routed, each matrix decoded alone


def test_mxfp4_linear_matches_a_linear_with_rounded_weights_for_any_width():
    torch.manual_seed(0)
    lin = nn.Linear(45, 7, bias=True)  # 45 inputs: one block and a zero-padded one
    q = MXFP4Linear.from_linear(lin)
    assert q.weight_blocks.shape == (7, 2, 16) and q.bias is lin.bias
    x = torch.randn(3, 45)
    # the fused kernel sums in its own order: equal to rounding error
    torch.testing.assert_close(q(x), nn.functional.linear(x, rounded(lin.weight), lin.bias), atol=1e-6, rtol=1e-5)
    assert torch.equal(q.weight, rounded(lin.weight.detach()))  # `.weight` reads the dequantised matrix


def test_quantize_model_is_idempotent_and_refuses_meta_weights():
    model = quantize_model(tiny_model())
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    quantize_model(model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in sd.items())
    with torch.device("meta"):
        meta = HorizonForCausalLM(tiny(), init=False)
    with pytest.raises(ValueError, match="meta device.*empty_quantized_model"):
        quantize_model(meta)


def test_either_mxfp4_naming_reads_as_horizons():
    assert canonical_name("layers.1.mlp.experts.gate_up_proj.blocks") == "layers.1.mlp.experts.gate_up_proj_blocks"
    assert canonical_name("a.down_proj.scales") == "a.down_proj_scales"
    assert canonical_name("a.down_proj_scales") == "a.down_proj_scales"
    assert canonical_name("a.weight") == "a.weight"
    model = quantize_model(tiny_model())
    sd = model.state_dict()
    dotted = {k.replace("_blocks", ".blocks").replace("_scales", ".scales"): v for k, v in sd.items()}
    assert dotted.keys() != sd.keys() and canonical_state_dict(dotted).keys() == sd.keys()
    with pytest.raises(ValueError, match="both name"):
        canonical_state_dict({"x.w_blocks": sd[next(iter(sd))], "x.w.blocks": sd[next(iter(sd))]})
