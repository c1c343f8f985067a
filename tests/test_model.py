"""The stack: cached chunked prefill + decode == one full forward; batching == running alone."""

import pytest
import torch

from horizon.model import Batch

from .conftest import tiny_model


def decode_in_steps(model, ids, lens, chunks, max_len):
    """Prefill each row in the given chunk sizes, then decode one token at a time, all in one batch."""
    B = ids.shape[0]
    cache = model.new_cache(B, max_len)
    pos = [0] * B
    out = [[] for _ in range(B)]

    def step(counts):
        x = torch.zeros(B, max(counts), dtype=torch.long)
        for b, n in enumerate(counts):
            x[b, :n] = ids[b, pos[b]:pos[b] + n]
        logits = model(x, cache=cache, lengths=counts)
        for b, n in enumerate(counts):
            out[b].append(logits[b, :n])
            pos[b] += n

    for round_ in range(max(len(c) for c in chunks)):
        step([c[round_] if round_ < len(c) else 0 for c in chunks])
    while any(p < n for p, n in zip(pos, lens, strict=True)):
        step([1 if p < n else 0 for p, n in zip(pos, lens, strict=True)])
    return [torch.cat(o) for o in out], cache


@pytest.mark.parametrize("topk", [16, 1024])  # sparse DSA, dense DSA
def test_chunked_prefill_then_decode_equals_full_forward_for_a_ragged_batch(topk):
    model = tiny_model(index_topk=topk)
    lens = [45, 23, 34]
    ids = torch.randint(0, model.config.vocab_size, (3, max(lens)))
    with torch.no_grad():
        full = model(ids, lengths=lens)
        stepped, cache = decode_in_steps(model, ids, lens, chunks=[[17, 11], [5, 9], [20, 3]], max_len=50)
    for b, n in enumerate(lens):
        torch.testing.assert_close(stepped[b], full[b, :n], atol=1e-4, rtol=0)
    assert cache.lens.tolist() == lens


def test_a_mixed_step_runs_decode_rows_apart_from_prompt_chunks_with_the_same_numbers(monkeypatch):
    model = tiny_model(index_topk=16)  # sparse DSA: the indexer path is the one padding made slow
    ids = torch.randint(0, model.config.vocab_size, (4, 40))
    lens, starts = [1, 12, 1, 7], [30, 3, 25, 10]  # two decode rows between two prompt chunks
    batch = Batch.build(lens, start=starts, slots=[0, 1, 2, 3])
    (dec, dec_idx), (rest, rest_idx) = batch.split_decode()
    assert dec.lens.tolist() == [1, 1] and dec.slots.tolist() == [0, 2] and dec.start.tolist() == [30, 25]
    assert rest.lens.tolist() == [12, 7] and rest.slots.tolist() == [1, 3] and rest.start.tolist() == [3, 10]
    assert dec_idx.tolist() == [0, 13] and rest_idx.tolist() == [1, *range(2, 13), *range(14, 21)]
    assert len(Batch.build([1, 1, 0]).split_decode()) == 1 and len(Batch.build([4, 2]).split_decode()) == 1

    step_rows = (torch.repeat_interleave(torch.arange(4), torch.tensor(lens)),
                 torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens, strict=True)]))

    def one_step(split: bool):
        if not split:  # the padded [B, T] layout for everyone: the reference for the split
            monkeypatch.setattr(Batch, "split_decode", lambda self: [(self, None)])
        cache = model.new_cache(4, 40)
        model(ids[:, :30], cache=cache, lengths=starts)
        out = model.forward_batch(ids[step_rows], Batch.build(lens, start=starts, slots=[0, 1, 2, 3]), cache)
        monkeypatch.undo()
        return out, cache

    with torch.no_grad():
        full = model(ids)
        split, cache = one_step(True)
        padded, _ = one_step(False)
    torch.testing.assert_close(split, padded, atol=1e-5, rtol=0)
    torch.testing.assert_close(split, full[step_rows], atol=1e-4, rtol=0)
    assert cache.lens.tolist() == [31, 15, 26, 17]


def test_a_batch_equals_each_sequence_alone():
    model = tiny_model()
    lens = [40, 9, 26]
    ids = torch.randint(0, model.config.vocab_size, (3, 40))
    with torch.no_grad():
        batched = model(ids, lengths=lens)
        for b, n in enumerate(lens):
            torch.testing.assert_close(batched[b, :n], model(ids[b:b + 1, :n])[0], atol=1e-5, rtol=0)


def test_varlen_forward_with_mixed_prefill_and_decode_in_one_step():
    model = tiny_model()
    ids = torch.randint(0, model.config.vocab_size, (2, 30))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(2, 30)
        model(ids[:, :20], cache=cache, lengths=[20, 5])  # row 0 is ahead of row 1
        # one step: row 0 decodes one token while row 1 prefills 15
        batch = Batch.build([1, 15], start=cache.lens, slots=[0, 1])
        tokens = torch.cat((ids[0, 20:21], ids[1, 5:20]))
        logits = model.forward_batch(tokens, batch, cache)
        nxt = torch.stack((ids[0, 21], ids[1, 20]))  # row 0 is now at position 21, row 1 at 20
        last = model.forward_batch(nxt, Batch.build([1, 1], start=cache.lens, slots=[0, 1]), cache,
                                   last_only=True)
    torch.testing.assert_close(logits[0], full[0, 20], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[1:], full[1, 5:20], atol=1e-4, rtol=0)
    torch.testing.assert_close(last, torch.stack((full[0, 21], full[1, 20])), atol=1e-4, rtol=0)


def test_cache_slots_are_independent_and_resettable():
    model = tiny_model()
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    with torch.no_grad():
        alone = model(ids)
        cache = model.new_cache(3, 20)
        batch = Batch.build([12], slots=[2])
        model.forward_batch(torch.randint(0, 100, (12,)), Batch.build([12], slots=[0]), cache)
        torch.testing.assert_close(model.forward_batch(ids[0], batch, cache), alone[0], atol=1e-5, rtol=0)
        cache.reset([2])
        assert cache.lens.tolist() == [12, 0, 0]
        torch.testing.assert_close(model.forward_batch(ids[0], Batch.build([12], slots=[2]), cache), alone[0],
                                   atol=1e-5, rtol=0)


def test_bad_inputs_raise_clear_errors():
    model = tiny_model()
    with pytest.raises(ValueError, match="vocab_size"):
        model(torch.tensor([[1, 2, 99999]]))
    with pytest.raises(ValueError, match="lengths"):
        model(torch.tensor([[1, 2, 3]]), lengths=[4])
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        model(torch.tensor([1, 2, 3]))
    cache = model.new_cache(1, 4)
    with pytest.raises(ValueError, match="max_len=4"):
        model(torch.tensor([[1, 2, 3, 4, 5]]), cache=cache)
    with pytest.raises(ValueError, match="slots"):
        model(torch.zeros(2, 3, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.new_cache(1, 10**7)


def test_bf16_model_runs_and_tracks_fp32_closely():
    model = tiny_model()
    ids = torch.randint(0, model.config.vocab_size, (2, 20))
    with torch.no_grad():
        ref = model(ids)
        out = model.to(torch.bfloat16)(ids)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert (out - ref).abs().max() < 0.05 * ref.abs().max() + 1e-3


def test_training_step_produces_gradients_everywhere_that_matters():
    model = tiny_model().train()
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    logits = model(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    # the indexer learns from its own KL loss (training issue), not from the LM loss: top-k is not differentiable;
    # the vision encoder only sees images (none here)
    assert all(".indexer." in n or n.startswith("vision.") for n in no_grad), no_grad
    assert sum(int(m.load.sum()) for m in model.modules() if hasattr(m, "load")) > 0
    # with an image, the vision encoder learns from the LM loss too
    model.zero_grad()
    img = torch.randint(0, 256, (32, 32, 3), dtype=torch.uint8)
    emb = torch.cat(model.encode_images([img]))
    mask = torch.zeros(2, 23, dtype=torch.bool)
    mask[0, 2: 2 + emb.shape[0]] = True
    logits = model(ids[:, :-1], image_embeds=emb, image_mask=mask)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.vision.parameters())


def test_paged_cache_with_scattered_blocks_equals_a_static_cache():
    from horizon.model import HorizonCache

    model = tiny_model()
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (2, 37))
    with torch.no_grad():
        full = model(ids, lengths=[37, 30])
        paged = HorizonCache(cfg, num_slots=2, max_len=40, block_size=8, num_blocks=12)
        with pytest.raises(ValueError, match="no cache block assigned"):
            model(ids[:, :5], cache=paged)
        order = torch.randperm(12, generator=torch.Generator().manual_seed(0))
        paged.block_table[0, :5] = order[:5]  # slot 0: 5 scattered blocks, slot 1: 4 others
        paged.block_table[1, :4] = order[5:9]
        first = model(ids[:, :13], cache=paged)
        rest = [model(ids[:, t:t + 1], cache=paged, lengths=[1, int(t < 30)]) for t in range(13, 37)]
    got = torch.cat([first] + rest, 1)
    torch.testing.assert_close(got[0], full[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[1, :30], full[1, :30], atol=1e-4, rtol=0)
