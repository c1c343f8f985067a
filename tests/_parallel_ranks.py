"""What each of the 2 gloo ranks of tests/test_parallel.py runs: a sharded model against the full one.

Every rank builds the same seeded full model (its single-process reference), shards a copy to its
part, runs every check and records (error, passed) per check; the records of both ranks are gathered to
every rank before the group is torn down, and rank 0 writes them for the parent to assert.
"""

from __future__ import annotations

import copy
import json
import os
import traceback

import torch
import torch.distributed as dist

from horizon.checkpoint import RANDOM, open_model
from horizon.engine import Engine, EngineConfig, Request, SamplingParams
from horizon.engine.params import TokenEvent
from horizon.model import HorizonForCausalLM
from horizon.model.batch import Batch
from horizon.model.options import ForwardOptions
from horizon.parallel import all_reduce, init_group, leave_group
from horizon.parallel.shard import Layout, gather_state_dict, shard_model
from horizon.quant import quantize_model
from tests.conftest import K3_PIECES, tiny

TOL = 1e-4


def _model(seed=0, **changes):
    torch.manual_seed(seed)
    return HorizonForCausalLM(tiny(**changes)).eval()


def _err(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def module_checks(rank, results):
    cfg = dict(index_topk=8, moe_intermediate_size=64)  # 2 MXFP4 blocks per expert row: TP can split them
    full = _model(**cfg)
    for ep in (False, True):
        part = shard_model(copy.deepcopy(full), Layout(2, rank, ep))
        torch.manual_seed(1)
        lens = torch.tensor([23, 9])
        x = torch.randn(int(lens.sum()), full.config.hidden_size)
        batch = Batch.build(lens)
        with torch.no_grad():
            if not ep:
                want = full.layers[0].attn(x, batch)
                results["kda"] = _err(all_reduce(part.layers[0].attn(x, batch)), want)
                for form in ("expanded", "absorbed"):
                    for selection, name in (("dense", "dense"), ("indexer", "sparse")):
                        def opts(form=form, selection=selection):  # a fresh one per call
                            return ForwardOptions(attn_form=form, selection=selection)

                        want = full.layers[3].attn(x, batch, options=opts())
                        got = all_reduce(part.layers[3].attn(x, batch, options=opts()))
                        results[f"dsa_{name}_{form}"] = _err(got, want)
                results["dense_mlp"] = _err(all_reduce(part.layers[0].mlp(x)), full.layers[0].mlp(x))
            tag = "ep" if ep else "tp"
            results[f"moe_{tag}"] = _err(all_reduce(part.layers[1].mlp(x)), full.layers[1].mlp(x))
            q_full = quantize_model(copy.deepcopy(full), attention=True)
            q_part = shard_model(copy.deepcopy(q_full), Layout(2, rank, ep))
            results[f"moe_{tag}_mxfp4"] = _err(all_reduce(q_part.layers[1].mlp(x)), q_full.layers[1].mlp(x))
            results[f"kda_mxfp4_attention_{tag}"] = _err(all_reduce(q_part.layers[0].attn(x, batch)),
                                                          q_full.layers[0].attn(x, batch))
            for name, m_full, m_part in (("fp32", full, part), ("mxfp4", q_full, q_part)):
                gathered = gather_state_dict(m_part)
                want = m_full.state_dict()
                same = gathered.keys() == want.keys() and all(
                    gathered[k].shape == want[k].shape and torch.equal(gathered[k], want[k]) for k in want)
                results[f"round_trip_{name}_{tag}"] = 0.0 if same else float("inf")


def model_checks(rank, results):
    full = _model(index_topk=8)
    part = shard_model(copy.deepcopy(full), Layout(2, rank, ep=True))
    torch.manual_seed(2)
    ids = torch.randint(0, full.config.vocab_size, (2, 30))
    lens = [30, 17]
    worst, argmax_same, picks = 0.0, True, []
    caches = [m.new_cache(2, 64) for m in (full, part)]
    with torch.no_grad():
        for lo, hi in ((0, 12), (12, 30)):  # chunked prefill
            chunk = [max(0, min(n, hi) - lo) for n in lens]
            outs = []
            for m, cache in zip((full, part), caches, strict=True):
                opts = ForwardOptions(record_selection=True)
                outs.append(m(ids[:, lo:hi], cache=cache, lengths=chunk, options=opts))
                if m is part:
                    picks.append({k: v.tolist() for k, v in opts.selections.items()})
            valid = torch.arange(hi - lo)[None, :] < torch.tensor(chunk)[:, None]
            worst = max(worst, _err(outs[1][valid], outs[0][valid]))
            argmax_same &= bool((outs[1][valid].argmax(-1) == outs[0][valid].argmax(-1)).all())
        nxt = torch.tensor([[5], [7]])
        for _ in range(6):  # cached decode, the sparse path (context > index_topk)
            opts = ForwardOptions(record_selection=True)
            a = full(nxt, cache=caches[0])
            b = part(nxt, cache=caches[1], options=opts)
            picks.append({k: v.tolist() for k, v in opts.selections.items()})
            worst = max(worst, _err(b, a))
            argmax_same &= bool((a.argmax(-1) == b.argmax(-1)).all())
            nxt = a[:, -1].argmax(-1, keepdim=True)
    results["model_logits"] = worst
    results["model_argmax"] = 0.0 if argmax_same else float("inf")
    everyone = [None, None]
    dist.all_gather_object(everyone, picks)
    results["selections_identical"] = 0.0 if everyone[0] == everyone[1] and picks and picks[-1] else float("inf")


def k3_checks(rank, results):
    """A K3-shaped model sharded both ways, fp32 and with MXFP4 experts, through chunked prefill and cached
    decode against one process."""
    full = _model(**K3_PIECES)
    for ep in (False, True):
        for name, ref in (("fp32", full), ("mxfp4", quantize_model(copy.deepcopy(full)))):
            part = shard_model(copy.deepcopy(ref), Layout(2, rank, ep))
            torch.manual_seed(3)
            ids = torch.randint(0, full.config.vocab_size, (2, 24))
            caches = [m.new_cache(2, 40) for m in (ref, part)]
            worst = 0.0
            with torch.no_grad():
                for lo, hi in ((0, 10), (10, 24)):
                    worst = max(worst, _err(part(ids[:, lo:hi], cache=caches[1]), ref(ids[:, lo:hi], cache=caches[0])))
                nxt = torch.tensor([[5], [7]])
                for _ in range(4):
                    a, b = ref(nxt, cache=caches[0]), part(nxt, cache=caches[1])
                    worst = max(worst, _err(b, a))
                    nxt = a[:, -1].argmax(-1, keepdim=True)
            results[f"k3_{name}_{'ep' if ep else 'tp'}"] = worst


ENGINE = EngineConfig(max_num_seqs=4, max_batch_tokens=32, max_model_len=512)  # small chunks: mixed steps


def engine_scenario(engine: Engine) -> dict:
    """Greedy and seeded requests decoding while a long prompt prefills in chunks, a second turn that
    resumes from the prefix cache, and a request cancelled after three tokens; what came out."""
    enc = engine.tokenizer.encode
    prompts = [enc("The quick brown fox"), enc("Tensor parallel inference splits every layer by heads."),
               enc(" ".join(f"word{i}" for i in range(60)))]
    reqs = [Request(prompts[0], SamplingParams(max_tokens=10, temperature=0)),
            Request(prompts[1], SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=7)),
            Request(prompts[2], SamplingParams(max_tokens=6, temperature=0))]
    first = engine.generate(reqs)
    again = engine.generate([Request(prompts[0] + first[0].token_ids + enc(" and more"),
                                     SamplingParams(max_tokens=8, temperature=0))])
    seen = []

    def on_event(event):
        if isinstance(event, TokenEvent):
            seen.append(event.token_id)
            if len(seen) == 3:
                engine.cancel(event.request_id)
        else:
            seen.append(event.reason)

    engine.submit(Request(prompts[1], SamplingParams(max_tokens=20, temperature=0), request_id="to-cancel"), on_event)
    engine.run_until_idle()
    return {"tokens": [r.token_ids for r in first + again], "finish": [r.finish.reason for r in first + again],
            "prefix_hits": engine.metrics()["prefix_hits"], "cancelled": seen}


def engine_checks(rank, results):
    bundle = open_model(RANDOM, layout=Layout(2, rank, ep=False))
    engine = Engine(bundle.model, bundle.tokenizer, ENGINE, bundle.generation_config)
    if rank == 0:
        results["engine"] = engine_scenario(engine)
        engine.stop()
    else:
        engine.follow()


def main():
    group = init_group(timeout_s=60)
    results, error = {}, None
    try:
        module_checks(group.rank, results)
        model_checks(group.rank, results)
        k3_checks(group.rank, results)
        engine_checks(group.rank, results)
    except Exception:  # noqa: BLE001 - reported to the parent, which fails the test with it
        error = traceback.format_exc()
    everyone = [None] * group.world
    dist.all_gather_object(everyone, {"results": results, "error": error})
    if group.rank == 0:
        with open(os.environ["HORIZON_TEST_OUT"], "w") as f:
            json.dump({"ranks": everyone, "tolerance": TOL}, f)
    leave_group()  # together: a rank that closes first makes its peer's gloo threads abort at exit


if __name__ == "__main__":
    main()
