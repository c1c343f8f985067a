"""Training examples: chats rendered to token ids with the loss mask on what the model generates.

Two sources, one shape (`Example`):
  * task domains (`horizon.tasks`): `task.chat()` (prompt + reference trajectory) with the tools the
    task uses, rendered under a thinking tier when the trajectory thinks;
  * a user's JSONL, one chat per line: `{"messages": [...], "tools": [...]?, "tier": "low"?}` in the
    OpenAI-style message format the server accepts (assistant `reasoning_content`, `tool_calls`).
The loss is on assistant tokens only (`Rendered.assistant_mask`: everything after each assistant
turn's prompt, through its end-of-turn token). Images are decoded and kept as pixels; the number of
placeholders each takes comes from the model's vision config.

`Mixture` samples examples from several sources with fixed ratios, from its own seeded generator
(its state is saved with a checkpoint, so a resumed run sees the same batches).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from horizon.chat.images import decode_conversation, render_with_images
from horizon.config import ModelConfig
from horizon.jsonl import jsonl_rows
from horizon.model.vision import num_image_tokens


@dataclass
class Example:
    ids: list[int]
    mask: list[bool]  # True: a generated token (the loss is on predicting it)
    images: list[torch.Tensor] = field(default_factory=list)  # RGB uint8 [H, W, 3], in placeholder order
    source: str = ""


def render_chat(tokenizer, cfg: ModelConfig, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                tier: str | None = None, source: str = "") -> Example:
    """One chat -> Example; ValueError (naming the message) for anything that cannot be rendered."""
    pixels = decode_conversation(messages)  # ImageError is a ValueError naming the part
    if pixels and not cfg.vision_layers:
        raise ValueError("the chat has images but the model has no vision encoder (vision_layers=0)")
    out, images = render_with_images(tokenizer, messages, pixels, lambda h, w: num_image_tokens(cfg, h, w),
                                     tools=tools, tier=tier, add_generation_prompt=False)
    if not any(out.assistant_mask):
        raise ValueError("the chat has no assistant turn: nothing to learn from")
    return Example(out.ids, out.assistant_mask, images, source)


def tool_specs(names: list[str]) -> list[dict[str, Any]] | None:
    """The OpenAI-style definitions of the named toolsets' tools (what a task's prompt offers)."""
    return list(_tool_specs(tuple(names))) if names else None


@functools.lru_cache(maxsize=64)
def _tool_specs(names: tuple[str, ...]) -> tuple[dict[str, Any], ...]:
    import tempfile

    from horizon.agent.registry import make_tools

    with tempfile.TemporaryDirectory() as root:  # files/shell need a root only to be built
        return tuple({"type": "function", "function": t.spec()} for t in make_tools(list(names), root))


def task_example(tokenizer, cfg: ModelConfig, task, tier: str = "low") -> Example:
    """A task's prompt + reference trajectory; rendered under `tier` when the trajectory thinks."""
    thinks = any(m.get("role") == "assistant" and m.get("reasoning_content") is not None for m in task.target)
    return render_chat(tokenizer, cfg, task.chat(), tool_specs(task.tools),
                       tier if thinks else None, source=task.domain)


def read_jsonl(path: str | Path, tokenizer, cfg: ModelConfig) -> list[Example]:
    """A user's chats, one JSON object per line; errors name the line."""
    examples = []
    for n, row in jsonl_rows(path):
        try:
            if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
                raise ValueError('each line must be an object with a "messages" list')
            examples.append(render_chat(tokenizer, cfg, row["messages"], row.get("tools"), row.get("tier"),
                                        source=Path(path).name))
        except ValueError as e:
            raise ValueError(f"{path}:{n}: {e}") from None
    if not examples:
        raise ValueError(f"{path}: no chats in the file")
    return examples


class Mixture:
    """Sources (name -> examples) sampled with ratios; deterministic from its generator's state."""

    def __init__(self, sources: dict[str, list[Example]], ratios: dict[str, float] | None = None, seed: int = 0):
        if not sources or any(not v for v in sources.values()):
            raise ValueError("every training source needs at least one example")
        ratios = ratios or {name: 1.0 for name in sources}
        unknown = set(ratios) - set(sources)
        if unknown or any(r < 0 for r in ratios.values()) or not sum(ratios.values()) > 0:
            raise ValueError(f"ratios must be >= 0 for the sources {sorted(sources)} with a positive sum, "
                             f"got {ratios}")
        self.names = list(sources)
        self.sources = sources
        self.weights = torch.tensor([float(ratios.get(n, 0.0)) for n in self.names])
        self.generator = torch.Generator().manual_seed(seed)

    def digest(self) -> str:
        """A hash of the sources, the ratios and the sampler's state: equal digests draw equal batches."""
        h = hashlib.sha256(repr((self.names, self.weights.tolist())).encode())
        h.update(self.generator.get_state().numpy().tobytes())
        for name in self.names:
            for ex in self.sources[name]:
                h.update(repr((name, ex.ids, ex.mask)).encode())
                for img in ex.images:
                    h.update(img.contiguous().numpy().tobytes())
        return h.hexdigest()

    def sample(self, n: int) -> list[Example]:
        picks = torch.multinomial(self.weights, n, replacement=True, generator=self.generator).tolist()
        out = []
        for k in picks:
            pool = self.sources[self.names[k]]
            out.append(pool[int(torch.randint(len(pool), (1,), generator=self.generator))])
        return out


def collate(examples: list[Example], max_len: int, cfg: ModelConfig, image_token_id: int) -> dict[str, Any]:
    """Right-padded ids [B, T], targets [B, T] (-100: no loss), lengths, and the image inputs.

    An example longer than max_len is cut to its first max_len tokens, or earlier, where an image's
    placeholder run would be cut (a run is never split).
    """
    rows, images, runs = [], [], []
    for ex in examples:
        positions = [i for i, t in enumerate(ex.ids) if t == image_token_id]
        keep, at, kept = min(len(ex.ids), max_len), 0, []
        for img in ex.images:
            n = num_image_tokens(cfg, img.shape[0], img.shape[1])
            run = positions[at: at + n]
            at += n
            if run[-1] >= keep:
                keep = min(keep, run[0])
                break
            kept.append((img, run))
        rows.append((ex.ids[:keep], ex.mask[:keep]))
        runs.append(kept)
    lens = [len(r) for r, _ in rows]
    if min(lens) < 2:
        raise ValueError(f"max_len={max_len} leaves an example with fewer than 2 tokens")
    T = max(lens)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    targets = torch.full((len(rows), T), -100, dtype=torch.long)
    image_mask = torch.zeros(len(rows), T, dtype=torch.bool)
    for b, (r, m) in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r)
        # position t predicts token t+1: it has a loss where t+1 was generated
        nxt = torch.tensor(r[1:])
        targets[b, : len(r) - 1] = torch.where(torch.tensor(m[1:]), nxt, -100)
        for img, run in runs[b]:
            image_mask[b, run] = True
            images.append(img)
    return {"ids": ids, "targets": targets, "lengths": torch.tensor(lens),
            "images": images, "image_mask": image_mask if images else None}
