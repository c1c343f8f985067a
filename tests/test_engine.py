"""Engine: continuous batching == running alone, memory returns, exact thinking caps, prefix reuse, pool pressure."""

import asyncio

import pytest
import torch

from horizon.chat import ChatTemplate, ReasoningDelta, TextDelta, load_tokenizer
from horizon.engine import Engine, EngineConfig, FinishEvent, Request, SamplingParams, TokenEvent

from .conftest import tiny_model

TOK = load_tokenizer()
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def engine(model, **kw) -> Engine:
    return Engine(model, TOK, EngineConfig(**{"max_num_seqs": 4, "max_batch_tokens": 32, "max_model_len": 256,
                                              "block_size": 16, **kw}))


def prompts(*lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(40, 4000, (n,), generator=g).tolist() for n in lengths]


def alone(model, prompt, params=GREEDY):
    return engine(model).generate([Request(prompt, params)])[0]


def assert_empty(e: Engine):
    m = e.metrics()
    assert m["running"] == 0 and m["queue_length"] == 0 and m["slots_free"] == e.config.max_num_seqs
    assert m["blocks_used"] == m["blocks_prefix_cache"]
    e.clear_prefix_cache()
    assert e.metrics()["blocks_used"] == 0 and (e.cache.block_table == -1).all()


def test_concurrent_staggered_requests_equal_running_alone(model):
    ps = prompts(5, 30, 17, 60, 2, 45, 12, 80)
    want = [alone(model, p).token_ids for p in ps]
    e = engine(model)
    got = {}

    def collect(event):
        if isinstance(event, TokenEvent):
            got.setdefault(event.request_id, []).append(event.token_id)

    for i, p in enumerate(ps):  # a new request arrives every other step, while others decode
        e.submit(Request(p, GREEDY, request_id=f"r{i}"), collect)
        e.step()
        e.step()
    e.run_until_idle()
    assert [got[f"r{i}"] for i in range(8)] == want
    m = e.metrics()
    assert m["forwards_multi_seq"] > 0 and m["max_seqs_in_forward"] == 4
    assert_empty(e)


def test_cancelling_mid_stream_frees_everything(model):
    e = engine(model)
    events = {}
    for i, p in enumerate(prompts(40, 50, 8, 70)):
        e.submit(Request(p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), request_id=f"c{i}"),
                 lambda ev: events.setdefault(ev.request_id, []).append(ev))
    for _ in range(6):
        e.step()
    e.cancel("c1")
    e.cancel("c3")
    e.run_until_idle()
    finishes = {rid: evs[-1] for rid, evs in events.items()}
    assert finishes["c1"].reason == finishes["c3"].reason == "cancelled"
    assert finishes["c0"].reason == finishes["c2"].reason == "length"
    assert_empty(e)


def test_thinking_cap_is_exact_and_the_answer_follows(model):
    budget = 7
    think_end = TOK.special.think_end
    # the bias keeps the random model from ending thinking by itself: the engine must force it
    params = SamplingParams(max_tokens=15, temperature=0, ignore_eos=True, tier="low", thinking_budget=budget,
                            logit_bias={think_end: -100.0})
    prompt = ChatTemplate(TOK).render([{"role": "user", "content": "hi"}], tier="low",
                                      add_generation_prompt=True).ids
    res = engine(model).generate([Request(prompt, params)])[0]
    # the budget counts the end of thinking, as reasoning_tokens does: budget - 1 free tokens, then the end
    assert res.token_ids[budget - 1] == think_end and think_end not in res.token_ids[:budget - 1]
    assert [ev.forced for ev in res.events if isinstance(ev, TokenEvent)].count(True) == 1
    reasoning = "".join(d.text for ev in res.events for d in getattr(ev, "deltas", []) if isinstance(d, ReasoningDelta))
    text = "".join(d.text for ev in res.events for d in getattr(ev, "deltas", []) if isinstance(d, TextDelta))
    assert reasoning == TOK.decode(res.token_ids[:budget - 1])
    assert text == TOK.decode(res.token_ids[budget:]) and len(res.token_ids) == 15
    assert res.usage.reasoning_tokens == budget and res.usage.completion_tokens == 15


def test_tier_budgets_come_from_the_generation_config(model):
    e = Engine(model, TOK, EngineConfig(max_num_seqs=2, max_batch_tokens=16, max_model_len=128),
               generation_config={"thinking_budgets": {"low": 3, "high": 9}})
    think_end = TOK.special.think_end
    for tier, cap in (("low", 3), ("high", 9)):
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, tier=tier,
                                logit_bias={think_end: -100.0})
        res = e.generate([Request(prompts(6)[0], params)])[0]
        assert res.token_ids.index(think_end) == cap - 1 and res.usage.reasoning_tokens == cap
    assert e.stats.thinking_tokens == {"low": 2, "high": 8, "max": 0}  # thinking text, the end not counted


def test_prefix_reuse_resumes_a_turn_with_the_logits_of_a_full_prefill(model):
    e = engine(model)
    first = prompts(40)[0]
    turn1 = e.generate([Request(first, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))])[0]
    second = first + turn1.token_ids + prompts(9, seed=1)[0]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=20)
    computed = e.stats.tokens_computed
    resumed = e.generate([Request(second, params)])[0]
    cached = len(first) + len(turn1.token_ids) - 1  # the last sampled token of turn 1 was never fed
    assert resumed.usage.cached_tokens == cached and e.metrics()["prefix_hits"] == 1
    # the model processed only what the cache did not hold: the new prompt tokens, then one per decode
    assert e.stats.tokens_computed - computed == (len(second) - cached) + (6 - 1)
    fresh = engine(model).generate([Request(second, params)])[0]
    assert fresh.usage.cached_tokens == 0 and fresh.token_ids == resumed.token_ids
    for a, b in zip(fresh.events[:-1], resumed.events[:-1], strict=True):
        assert abs(a.logprob - b.logprob) <= 1e-4
        assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
        assert max(abs(x - y) for (_, x), (_, y) in zip(a.top_logprobs, b.top_logprobs, strict=True)) <= 1e-4
    # and the model's own full forward agrees with the first resumed step
    with torch.no_grad():
        full = torch.log_softmax(model(torch.tensor([second]))[0, -1], -1)
    assert abs(float(full[resumed.token_ids[0]]) - resumed.events[0].logprob) <= 1e-4


def test_pool_exhaustion_queues_and_preempts_and_everything_completes(model):
    ps = prompts(30, 25, 40, 33, 20, 38, 28, 35)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    want = [alone(model, p, params).token_ids for p in ps]
    # 8 blocks of 16 rows: room for about two of these sequences at a time
    e = engine(model, num_blocks=8)
    res = e.generate([Request(p, params) for p in ps])
    assert [r.token_ids for r in res] == want
    assert all(r.finish.reason == "length" for r in res)
    assert e.metrics()["preemptions"] > 0
    assert_empty(e)


def test_a_request_larger_than_the_pool_is_refused_and_others_run(model):
    e = engine(model, num_blocks=2)  # 32 rows
    big, small = prompts(50, 10)
    with pytest.raises(ValueError, match="more cache than the whole pool holds"):
        e.submit(Request(big, GREEDY), print)
    res = e.generate([Request(small, GREEDY)])
    assert res[0].finish.reason == "length" and res[0].token_ids == alone(model, small).token_ids
    assert_empty(e)


def test_stops_seeds_and_bad_requests(model):
    e = engine(model)
    p = prompts(10)[0]
    ref = e.generate([Request(p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))])[0]
    stop_tok = ref.token_ids[4]
    res = e.generate([Request(p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                stop_token_ids=[stop_tok]))])[0]
    assert res.token_ids == ref.token_ids[:ref.token_ids.index(stop_tok) + 1] and res.finish.reason == "stop"
    text = TOK.decode(ref.token_ids)
    needle = text[len(text) // 2: len(text) // 2 + 3]
    res = e.generate([Request(p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[needle]))])[0]
    streamed = "".join(d.text for ev in res.events for d in ev.deltas if isinstance(d, TextDelta))
    assert res.finish.reason == "stop" and streamed == text[: text.index(needle)]
    sampled = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    a, b = e.generate([Request(p, sampled), Request(prompts(33)[0], GREEDY)])[0], e.generate([Request(p, sampled)])[0]
    assert a.token_ids == b.token_ids  # the seed reproduces, whatever shares the batch
    # without a seed a request draws from a generator of its own, never torch's global one (which a compile's
    # trace restores when it ends: two requests sampled meanwhile would repeat each other's draws)
    unseeded = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    c = e.generate([Request(p, unseeded)])[0]
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(0)
    assert e.generate([Request(p, unseeded)])[0].token_ids != c.token_ids  # 10 draws at temperature 1
    with pytest.raises(ValueError, match="exceeds the context window of 256"):
        e.submit(Request(p, SamplingParams(max_tokens=300)), print)
    with pytest.raises(ValueError, match="top_p"):
        e.submit(Request(p, SamplingParams(top_p=0)), print)


def test_async_streams_and_a_client_that_walks_away(model):
    e = engine(model)
    ps = prompts(20, 35, 15)

    async def consume(i, p, leave_after=None):
        tokens = []
        async for ev in e.stream(Request(p, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                                         request_id=f"a{i}")):
            if isinstance(ev, FinishEvent):
                return tokens, ev.reason
            tokens.append(ev.token_id)
            if leave_after is not None and len(tokens) >= leave_after:
                return tokens, "left"
        return tokens, None

    async def main():
        return await asyncio.gather(consume(0, ps[0]), consume(1, ps[1], leave_after=3), consume(2, ps[2]))

    e.start()
    try:
        results = asyncio.run(main())
        for _ in range(100):  # the cancellation lands between steps
            if not e.has_work:
                break
            asyncio.run(asyncio.sleep(0.02))
    finally:
        e.stop()
    assert results[0][1] == "length" and results[2][1] == "length" and results[1][1] == "left"
    want = alone(model, ps[0], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)).token_ids
    assert results[0][0] == want
    assert_empty(e)


def test_generate_and_chat_commands_stream_from_the_random_model():
    import subprocess
    import sys

    run = [sys.executable, "-m", "horizon.cli"]
    # the random model: it never ends thinking or a turn by itself, so the counts below are exact
    out = subprocess.run(run + ["generate", "--model", "tiny-random", "--prompt", "hi", "--tier", "low",
                                "--max-tokens", "8", "--seed", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "thinking:" in out.stdout and "8 tokens, 8 thinking" in out.stdout
    out = subprocess.run(run + ["chat", "--model", "tiny-random", "--max-tokens", "5", "--temperature", "0"],
                         input="hello\nagain\n\n", capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("[length; 5 tokens") == 2


def test_a_reply_that_re_renders_differently_still_resumes_from_the_previous_prompt(model):
    e = engine(model)
    first = prompts(30)[0]
    turn1 = e.generate([Request(first, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))])[0]
    # the client's copy of the reply tokenises differently: only the previous prompt is a shared prefix
    altered = [t + 1 for t in turn1.token_ids]
    second = first + altered + prompts(5, seed=2)[0]
    res = e.generate([Request(second, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))])[0]
    assert res.usage.cached_tokens == len(first)
    fresh = engine(model).generate([Request(second, SamplingParams(max_tokens=4, temperature=0,
                                                                   ignore_eos=True))])[0]
    assert fresh.token_ids == res.token_ids
    # the exact continuation still resumes from the longer, end-of-turn entry
    exact = first + turn1.token_ids + prompts(5, seed=3)[0]
    res = e.generate([Request(exact, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))])[0]
    assert res.usage.cached_tokens == len(first) + len(turn1.token_ids) - 1


def test_the_prefix_index_finds_what_a_scan_of_every_entry_finds():
    """The hashed index against the plain reference: the longest entry that is a proper prefix."""
    import random

    from horizon.engine.blocks import BlockPool, PrefixCache

    rng = random.Random(0)
    state = [(torch.zeros(2), torch.zeros(1))]
    cache = PrefixCache(BlockPool(4096), max_bytes=10**9)
    stems = [[rng.randrange(6) for _ in range(rng.randrange(1, 12))] for _ in range(8)]
    for _ in range(300):  # entries sharing stems, so many are prefixes of others
        tokens = rng.choice(stems) + [rng.randrange(4) for _ in range(rng.randrange(0, 6))]
        if rng.random() < 0.3:
            tokens = [("image", "digest", 0), *tokens]  # an image key, as Sequence.key writes it
        cache.add(tokens, state, [], kind=rng.choice(("finish", "prompt", "boundary")))
        if rng.random() < 0.1:
            cache.evict_one()
        prompt = rng.choice(stems) + [rng.randrange(4) for _ in range(rng.randrange(0, 8))]
        expected = [e for e in cache.entries.values() if len(e.tokens) < len(prompt) and prompt[: len(e.tokens)]
                    == e.tokens]
        got = cache.lookup(prompt)
        if not expected:
            assert got is None
        else:
            assert got is not None and len(got.tokens) == max(len(e.tokens) for e in expected)
            assert prompt[: len(got.tokens)] == got.tokens
    # the byte count stays consistent through superseding and eviction
    assert cache.nbytes == sum(e.nbytes for e in cache.entries.values())
