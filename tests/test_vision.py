"""Images end to end: the vision encoder in the model, the engine's batching and prefix reuse with
images, and both SDKs sending images to a live server (plus the documented 400s)."""

from __future__ import annotations

import base64
import io

import anthropic
import openai
import pytest
import torch
from PIL import Image

from horizon.chat import ChatTemplate
from horizon.chat.images import to_data_url
from horizon.engine import Engine, EngineConfig, Request, SamplingParams
from horizon.model.vision import image_grid, num_image_tokens, preprocess

from .conftest import tiny_model
from .live import LiveServer

MODEL = "horizon-test"


def random_image(h: int, w: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_the_token_count_follows_the_image_size_and_is_bounded():
    cfg = tiny_model().config
    unit = cfg.vision_patch_size * cfg.vision_merge
    assert image_grid(cfg, 2 * unit, 3 * unit) == (2, 3)
    assert image_grid(cfg, 1, 1) == (1, 1)
    for h, w in [(4000, 4000), (10, 5000), (5000, 10), (999, 333)]:
        rows, cols = image_grid(cfg, h, w)
        assert 1 <= rows * cols <= cfg.vision_max_tokens
    assert image_grid(cfg, 4000, 1000)[0] > image_grid(cfg, 4000, 1000)[1]  # the aspect ratio is kept
    x = preprocess(cfg, random_image(37, 71, 0))
    rows, cols = image_grid(cfg, 37, 71)
    assert x.shape == (3, rows * unit, cols * unit) and -1 <= float(x.min()) and float(x.max()) <= 1


@torch.no_grad()
def test_images_change_the_logits_and_cached_decode_equals_the_full_forward():
    model = tiny_model()
    cfg = model.config
    img_a, img_b = random_image(40, 60, 1), random_image(40, 60, 2)
    n = num_image_tokens(cfg, 40, 60)
    image_id = 5  # any id: the mask, not the id, says where the embeddings go
    ids = torch.tensor([[1, 2, 3, *[image_id] * n, 7, 8, 9, 10, 11]])
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[0, 3: 3 + n] = True
    emb_a, emb_b = (torch.cat(model.encode_images([img])) for img in (img_a, img_b))
    assert emb_a.shape == (n, cfg.hidden_size)
    full_a = model(ids, image_embeds=emb_a, image_mask=mask)
    full_b = model(ids, image_embeds=emb_b, image_mask=mask)
    assert (full_a - full_b).abs().max() > 1e-3  # a different image, different logits
    again = model(ids, image_embeds=torch.cat(model.encode_images([img_a.clone()])), image_mask=mask)
    assert torch.equal(full_a, again)  # the same image, identical logits
    # prefill in chunks that cut through the image, then decode one token at a time
    cache = model.new_cache(num_slots=1, max_len=64)
    outs, used = [], 0
    for start, end in [(0, 5), (5, 3 + n + 1), (3 + n + 1, ids.shape[1] - 2), (ids.shape[1] - 2, ids.shape[1] - 1),
                       (ids.shape[1] - 1, ids.shape[1])]:
        k = int(mask[0, start:end].sum())
        outs.append(model(ids[:, start:end], cache=cache, image_embeds=emb_a[used: used + k],
                          image_mask=mask[:, start:end]))
        used += k
    assert (torch.cat(outs, 1) - full_a).abs().max() < 1e-4
    with pytest.raises(ValueError, match="image_embeds must be"):
        model(ids, image_embeds=emb_a[:-1], image_mask=mask)


def render(tok, cfg, messages, images):
    sizes = {part_url: img.shape[:2] for part_url, img in images.items()}
    template = ChatTemplate(tok, image_tokens=lambda part: num_image_tokens(cfg, *sizes[part["image_url"]["url"]]))
    out = template.render(messages, add_generation_prompt=True)
    return out.ids, [images[p["image_url"]["url"]] for p in out.images]


def user(text, *urls):
    return {"role": "user", "content": [*({"type": "image_url", "image_url": {"url": u}} for u in urls),
                                        {"type": "text", "text": text}]}


def test_engine_batches_images_and_resumes_a_history_without_re_encoding():
    from horizon.chat import load_tokenizer

    tok = load_tokenizer()
    model = tiny_model()
    cfg = model.config
    images = {"a": random_image(48, 64, 3), "b": random_image(30, 90, 4), "c": random_image(48, 64, 5)}
    greedy = SamplingParams(max_tokens=6, temperature=0)
    prompts = [render(tok, cfg, [user("Compare these.", "a", "b")], images),
               render(tok, cfg, [user("And this one?", "c")], images),
               render(tok, cfg, [user("No image here.")], images)]

    def fresh():
        return Engine(model, tok, EngineConfig(max_num_seqs=4, max_batch_tokens=24))  # chunks cut through images

    together = fresh().generate([Request(ids, greedy, images=imgs or None) for ids, imgs in prompts])
    for (ids, imgs), res in zip(prompts, together, strict=True):
        alone = fresh().generate([Request(ids, greedy, images=imgs or None)])[0]
        assert [e.token_id for e in alone.events[:-1]] == [e.token_id for e in res.events[:-1]]
        assert res.finish.usage.image_tokens == ids.count(tok.special.image)

    engine = fresh()
    first_ids, first_imgs = prompts[0]
    turn1 = engine.generate([Request(first_ids, greedy, images=first_imgs)])[0]
    assert engine.metrics()["images_encoded"] == 2
    reply = [e.token_id for e in turn1.events[:-1]]
    # the next turn extends the first prompt: it resumes from the cache and the two images are not encoded again
    second = first_ids + reply + tok.encode(" more")
    turn2 = engine.generate([Request(second, greedy, images=first_imgs)])[0]
    assert turn2.finish.usage.cached_tokens >= len(first_ids) - 1
    assert engine.metrics()["images_encoded"] == 2
    # the same placeholders with a different image of the same size must not resume from the first one's state
    swapped = [images["c"], first_imgs[1]]
    turn3 = engine.generate([Request(second, greedy, images=swapped)])[0]
    assert turn3.finish.usage.cached_tokens < first_ids.index(tok.special.image) + 1
    with pytest.raises(ValueError, match="image placeholders"):
        engine.submit(Request(first_ids, greedy, images=first_imgs[:1]), print)


def png_b64(img: torch.Tensor) -> str:
    return to_data_url(img).split(",", 1)[1]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with LiveServer(tmp_path_factory.mktemp("keys")) as s:
        yield s


def test_both_sdks_send_an_image_and_the_prompt_counts_its_tokens(srv):
    cfg = srv.engine.model.config
    img = random_image(64, 96, 6)
    n = num_image_tokens(cfg, 64, 96)
    oa = openai.OpenAI(base_url=srv.url + "/v1", api_key=srv.api_key, max_retries=0)
    text = [{"type": "text", "text": "What is in the picture?"}]
    plain = oa.chat.completions.create(model=MODEL, max_completion_tokens=4, messages=[
        {"role": "user", "content": text}])
    with_image = oa.chat.completions.create(model=MODEL, max_completion_tokens=4, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": to_data_url(img)}}, *text]}])
    assert with_image.usage.prompt_tokens == plain.usage.prompt_tokens + n
    assert with_image.usage.prompt_tokens_details.model_dump()["image_tokens"] == n
    an = anthropic.Anthropic(base_url=srv.url, api_key=srv.api_key, max_retries=0)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png_b64(img)}}
    message = an.messages.create(model=MODEL, max_tokens=4, messages=[
        {"role": "user", "content": [block, {"type": "text", "text": "What is in the picture?"}]}])
    counted = an.messages.count_tokens(model=MODEL, messages=[
        {"role": "user", "content": [block, {"type": "text", "text": "What is in the picture?"}]}])
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == counted.input_tokens
    no_image = an.messages.count_tokens(model=MODEL, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is in the picture?"}]}])
    assert counted.input_tokens == no_image.input_tokens + n


def bad_images() -> dict[str, tuple[str, str]]:
    """name -> (data URL, a phrase the 400 must contain)."""
    big = io.BytesIO()
    Image.new("RGB", (5000, 5000)).save(big, "PNG")  # tiny file, 25M pixels: over the 16M limit
    bmp = io.BytesIO()
    Image.new("RGB", (8, 8)).save(bmp, "BMP")
    return {
        "corrupt": ("data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nnot really").decode(), "decode"),
        "not_base64": ("data:image/png;base64,@@@", "base64"),
        "remote": ("https://example.com/cat.png", "network"),
        "too_many_pixels": ("data:image/png;base64," + base64.b64encode(big.getvalue()).decode(), "pixels"),
        "bmp": ("data:image/bmp;base64," + base64.b64encode(bmp.getvalue()).decode(), "PNG"),
    }


@pytest.mark.parametrize("case", list(bad_images()))
def test_bad_images_are_400s_naming_the_part_in_both_apis(srv, case):
    url, phrase = bad_images()[case]
    oa = openai.OpenAI(base_url=srv.url + "/v1", api_key=srv.api_key, max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        oa.chat.completions.create(model=MODEL, max_completion_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image_url", "image_url": {"url": url}}]}])
    message = err.value.body["message"]
    assert "messages[0].content[1]" in message and phrase.lower() in message.lower(), message
    if url.startswith("data:"):
        media, data = url[5:].split(";base64,", 1)
        source = {"type": "base64", "media_type": media if media != "image/bmp" else "image/png", "data": data}
    else:
        source = {"type": "url", "url": url}
    an = anthropic.Anthropic(base_url=srv.url, api_key=srv.api_key, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as err:
        an.messages.create(model=MODEL, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image", "source": source}]}])
    message = err.value.body["error"]["message"]
    assert "messages[0].content[1]" in message, message
    assert srv.engine.metrics()["running"] == 0
