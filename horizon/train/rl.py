"""Joint reinforcement learning across task domains: GRPO-style, with per-domain reward normalisation
and a thinking-cost term.

One step:
  1. pick `prompts_per_step` training tasks, their domains drawn with the sampling ratios (fixed, or
     adapted toward domains whose running accuracy is neither ~0 nor ~1, where there is signal);
  2. for each, a group of `group_size` rollouts through the engine (the serving sampler) as agent
     episodes (multi-step tasks use their tools), each under a thinking tier drawn from `tiers`;
  3. the domain's reward, normalised per domain with running mean and variance (`RewardNormalizer`),
     minus the thinking cost, thinking_cost * thinking tokens / the tier's budget (so a whole budget
     costs `thinking_cost` standard deviations of the domain's reward); the advantage of a rollout is
     that minus its group's mean (`advantages`). With `guide`, each group also holds the task's reference
     trajectory (the one supervised training learns from) as one more member scored 1.0: off-policy
     guidance, as in LUFFY. A task the policy fails in every sample, which plain GRPO cannot learn from,
     then pushes the reference up and the policy's own failures down; a group that is all correct stays
     flat and costs nothing in the update. The group mean is the baseline for the task's
     difficulty; the per-domain scale makes one unit of advantage mean the same in every domain, so a
     domain scored in hundreds does not drown one scored in [0, 1]. (Dividing by the group's own
     standard deviation, as the original GRPO does, is an option, `group_std`: it makes the domain
     scale irrelevant too, but it also blows a group's tiny differences up to full size, e.g. a few
     thinking tokens' cost in a group that is all correct.) Advantages are clipped to +-`clip`;
  4. loss = -sum over generated tokens of advantage * log-probability / (rollouts * mean tokens per
     rollout), the log-probabilities at the sampling temperature (on-policy), of the tokens the model
     generated (the engine's own token ids, not a re-rendering: a model that writes a malformed call,
     or text a tokenizer would split differently, is trained on what it sampled), + kl_coef * the k3 estimate
     of KL to the initial policy (a frozen copy, kept only when kl_coef > 0), + the DSA indexers'
     sparse-stage KL; AdamW step, MoE bias balancing, as in supervised training.
The checkpoint adds the reward statistics, the sampler's ratios, the task counter and the checkpoint the
run started from (the KL's anchor, reloaded on resume) to the supervised trainer's state, so a run
resumes exactly where it stopped.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from horizon.agent import Agent, AgentConfig, fixed_policy
from horizon.agent.local import EngineClient
from horizon.chat.images import decode_conversation, image_parts
from horizon.checkpoint import open_model
from horizon.eval import reward_of, run_lockstep, task_tools
from horizon.model.options import ForwardOptions
from horizon.parallel import all_reduce, fsdp
from horizon.tasks import get_domain
from horizon.train.data import Example, collate, task_example
from horizon.train.indexer import indexer_losses
from horizon.train.trainer import TrainConfig, Trainer, image_inputs, stage_options


class RewardNormalizer:
    """Running mean and variance of the rewards per domain (Welford); normalise() = (r - mean) / std."""

    def __init__(self, eps: float = 1e-6):
        self.eps = eps
        self.stats: dict[str, list[float]] = {}  # domain -> [count, mean, M2]

    def update(self, domain: str, rewards: list[float]) -> None:
        n, mean, m2 = self.stats.get(domain, [0.0, 0.0, 0.0])
        for r in rewards:
            n += 1
            delta = r - mean
            mean += delta / n
            m2 += delta * (r - mean)
        self.stats[domain] = [n, mean, m2]

    def std(self, domain: str) -> float:
        n, _, m2 = self.stats.get(domain, [0.0, 0.0, 0.0])
        return math.sqrt(m2 / n) if n > 1 else 1.0

    def normalize(self, domain: str, reward: float) -> float:
        _, mean, _ = self.stats.get(domain, [0.0, 0.0, 0.0])
        return (reward - mean) / (self.std(domain) + self.eps)


def advantages(domains: list[str], groups: list[int], rewards: list[float], normalizer: RewardNormalizer | None,
               costs: list[float] | None = None, group_std: bool = False, clip: float = 5.0) -> list[float]:
    """One advantage per rollout: its reward normalised per domain (`normalizer`, already updated with
    these rewards; None: raw rewards) minus its cost, minus the mean of that over its group, optionally
    over the group's standard deviation, clipped to +-clip. A group whose values are all equal gets 0."""
    costs = costs or [0.0] * len(rewards)
    norm = [(normalizer.normalize(d, r) if normalizer else r) - c
            for d, r, c in zip(domains, rewards, costs, strict=True)]
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    out = [0.0] * len(norm)
    for idx in members.values():
        values = torch.tensor([norm[i] for i in idx], dtype=torch.float64)
        spread = float(values.std()) if len(idx) > 1 else 0.0
        if spread < 1e-8:
            continue
        centred = values - values.mean()
        if group_std:
            centred = centred / spread
        for i, a in zip(idx, centred.clamp(-clip, clip).tolist(), strict=True):
            out[i] = a
    return out


def rollout_examples(turns: list, images: list[torch.Tensor]) -> list[Example]:
    """The tokens an episode's model calls saw and sampled, as few sequences as possible: a step whose
    prompt starts with the previous step's prompt + its generated tokens (the usual case: rendering is
    prefix-stable) extends that sequence; one that does not (the model wrote something the template
    renders differently) starts a new one. The mask is on the sampled tokens only: not the prompts, and not
    a token the engine forced (the end of thinking once the budget is spent), which the policy did not
    choose; trained on, its log-probability, often tiny, would be pushed down by every over-long wrong
    rollout without end, and the KL estimate on it explodes."""
    out: list[Example] = []
    ids: list[int] = []
    mask: list[bool] = []
    for turn in turns:
        raw = turn.response if isinstance(turn.response, dict) else {}
        if "prompt_ids" not in raw:
            raise ValueError("RL rollouts need an in-process EngineClient (its replies carry the token ids)")
        prompt, gen = raw["prompt_ids"], raw["token_ids"]
        if ids and prompt[: len(ids)] == ids:
            mask += [False] * (len(prompt) - len(ids))
            ids = list(prompt)
        else:
            if ids:
                out.append(Example(ids, mask, images))
            ids, mask = list(prompt), [False] * len(prompt)
        forced = set(raw.get("forced", ()))
        ids += gen
        mask += [i not in forced for i in range(len(gen))]
    if ids and any(mask):
        out.append(Example(ids, mask, images))
    return out


KL_CLAMP = 10.0  # the most one token's k3 term may add to the KL penalty


def token_weights(adv: list[float], n_tokens: torch.Tensor) -> torch.Tensor:
    """The weight of every generated token of each rollout in the policy loss: adv / (mean tokens per
    rollout) / rollouts, one constant for all rollouts rather than each one's own length (Dr. GRPO). Then
    tokens a group's rollouts share (the same context, the same token: a templated opening, say) cancel
    exactly, as the group's advantages sum to 0, and the gradient comes from where the rollouts differ;
    per-rollout length normalisation leaves shared tokens pushed up or down by noise, and favours long
    wrong answers over short ones (a wrong answer's penalty is spread thinner the longer it is)."""
    return torch.tensor(adv, dtype=torch.float32) / max(1.0, float(n_tokens.float().mean())) / len(adv)


def per_tier(rollouts: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """A step's rollouts of one domain, by tier: mean reward, thinking tokens, thinking cost and count."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rollouts:
        out.setdefault(r["tier"], []).append(r)
    return {t: {"reward": sum(r["reward"] for r in rs) / len(rs), "thinking_tokens": sum(r["thinking"] for r in rs)
                / len(rs), "cost": sum(r["cost"] for r in rs) / len(rs), "rollouts": len(rs)}
            for t, rs in sorted(out.items())}


@dataclass
class RLConfig:
    domains: list[str] = field(default_factory=lambda: ["arithmetic"])
    ratios: list[float] | None = None  # fixed sampling ratios (None: equal)
    adaptive: bool = False  # move the ratios toward domains with learning signal
    prompts_per_step: int = 4
    group_size: int = 4
    tiers: list[str | None] = field(default_factory=lambda: ["low"])
    thinking_cost: float = 0.0  # what a whole thinking budget costs, in standard deviations of the domain's reward
    # one tier per group (drawn per task) instead of per rollout: the group's baseline then compares rollouts
    # under the same tier and budget, so what the advantage rewards is the thinking, not the tier drawn
    tier_per_group: bool = False
    kl_coef: float = 0.0
    temperature: float = 1.0
    max_episode_steps: int = 4
    max_tokens: int = 256  # per model call
    indexer_loss: bool = True  # keep training the DSA indexers (sparse stage) during RL
    group_std: bool = False  # also divide advantages by the group's standard deviation (original GRPO)
    clip: float = 5.0  # advantages are clipped to +-clip
    micro_batch: int = 8  # sequences per forward/backward in the update (gradients accumulate)
    train_flat: bool = False  # also update on rollouts with advantage 0 (same policy gradient; KL/indexer see them)
    guide: bool = False  # add each task's reference trajectory to its group, scored 1.0 (off-policy guidance)

    def validate(self) -> None:
        if not self.domains:
            raise ValueError("RLConfig.domains: give at least one task domain")
        for name in ("prompts_per_step", "group_size", "max_episode_steps", "max_tokens", "micro_batch"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"RLConfig.{name}={getattr(self, name)!r}: must be an integer >= 1")
        bad = [t for t in self.tiers if t not in (None, "low", "high", "max")]
        if not self.tiers or bad:
            raise ValueError(f"RLConfig.tiers={self.tiers!r}: allowed none, low, high, max")
        if self.thinking_cost < 0 or self.kl_coef < 0 or not self.temperature > 0 or not self.clip > 0:
            raise ValueError("RLConfig: thinking_cost and kl_coef must be >= 0, temperature and clip > 0 (got "
                             f"{self.thinking_cost}, {self.kl_coef}, {self.temperature}, {self.clip})")


class RLTrainer(Trainer):
    def __init__(self, model, tokenizer, engine, config: TrainConfig, rl: RLConfig, out_dir, generation_config=None,
                 init: str | None = None):
        """init: the checkpoint the run started from ("bundled" or a folder), recorded in its state: the KL's
        anchor is a copy of `model` now, and restore() reloads it from there, not from the resumed weights."""
        rl.validate()
        self.rl = rl
        self.domains = {name: get_domain(name) for name in rl.domains}
        ratios = rl.ratios or [1.0] * len(rl.domains)
        if len(ratios) != len(rl.domains) or any(r < 0 for r in ratios) or not sum(ratios) > 0:
            raise ValueError(f"ratios must be one value >= 0 per domain {rl.domains} with a positive sum, got {ratios}")
        self.ratios = dict(zip(rl.domains, map(float, ratios), strict=True))
        self.accuracy = {name: 0.5 for name in rl.domains}  # running, for adaptive ratios
        # this trainer is its own "mixture": Trainer.save/restore keep self.mixture.generator
        self.generator = torch.Generator().manual_seed(config.seed)
        self.normalizer = RewardNormalizer()
        self.next_seed = config.seed * 1_000_003
        if fsdp.is_sharded(model):
            if engine.model is model or engine.ranks > 1:
                raise ValueError("horizon rl under FSDP: each rank rolls out its own groups, so its engine must "
                                 "decode an unsharded copy (horizon.parallel.fsdp.gathered_model(model, "
                                 "everywhere=True)) alone (EngineConfig(lockstep=False))")
            if rl.indexer_loss:
                raise ValueError(f"horizon rl under FSDP (WORLD_SIZE={dist.get_world_size()}): the DSA indexer loss "
                                 f"recomputes attention outside the layers' forward, where FSDP holds only shards of "
                                 f"their weights; pass --no-indexer-loss, or run in one process")
        config.stage = "sparse" if rl.indexer_loss else "sft"
        super().__init__(model, tokenizer, self, config, out_dir, generation_config)
        self.engine = engine
        self.client = EngineClient(engine, tokenizer)
        self.budgets = engine.budgets
        self.init = init
        self.reference = None
        if rl.kl_coef > 0:
            # a frozen plain copy (under FSDP every rank holds it whole: it only runs forwards, no collectives);
            # its forwards take the default options: no indexer taps
            self.reference = (fsdp.gathered_model(model, everywhere=True) if self.sharded
                              else copy.deepcopy(model)).eval()
            for p in self.reference.parameters():
                p.requires_grad_(False)

    def digest(self) -> str:
        """What every rank must hold alike to draw the same steps (checked under FSDP): the RL settings, the
        task counter and the sampler's state."""
        h = hashlib.sha256(json.dumps([asdict(self.rl), self.next_seed], sort_keys=True).encode())
        h.update(self.generator.get_state().numpy().tobytes())
        return h.hexdigest()

    # --- rollouts --------------------------------------------------------------------------------------
    def _domain_weights(self) -> torch.Tensor:
        w = [self.ratios[d] * (max(0.05, 4 * self.accuracy[d] * (1 - self.accuracy[d])) if self.rl.adaptive else 1)
             for d in self.rl.domains]
        return torch.tensor(w)

    def rollouts(self) -> list[dict[str, Any]]:
        """prompts_per_step tasks x group_size episodes, run in lockstep; one record per episode, with its
        `index` in the step's global order (group by group, then each group's guide). Under FSDP this rank
        runs the groups g with g % world == rank, on its unsharded copy of the current weights; every rank
        draws the whole step's plan (tasks, tiers, seeds) in the same order, so a rollout is the same
        whatever the number of ranks."""
        rl = self.rl
        picks = torch.multinomial(self._domain_weights(), rl.prompts_per_step, replacement=True,
                                  generator=self.generator).tolist()
        rng = random.Random(int(torch.randint(2**31, (1,), generator=self.generator)))
        runs = []
        for g, k in enumerate(picks):
            name = rl.domains[k]
            task = self.domains[name].generate(self.next_seed, "train")
            self.next_seed += 1
            group_tier = rng.choice(rl.tiers) if rl.tier_per_group else None
            for m in range(rl.group_size):
                tier, seed = rng.choice(rl.tiers), rng.randrange(2**31)  # drawn either way: one stream of seeds
                if rl.tier_per_group:
                    tier = group_tier
                if g % self.world != self.rank:
                    continue
                tools = task_tools(task, str(self.out))
                agent = Agent(self.client, tools, fixed_policy(tier),
                              AgentConfig(max_steps=rl.max_episode_steps, max_tokens_per_step=rl.max_tokens,
                                          temperature=rl.temperature, seed=seed))
                episode = agent.episode(task.messages[-1]["content"], task.messages[:-1] or None)
                runs.append({"index": g * rl.group_size + m, "task": task, "group": g, "tier": tier,
                             "tools": tools, "episode": episode})
        if self.sharded:  # the engine decodes a plain copy (FSDP modules must not run in an engine)
            fsdp.copy_weights(self.model, self.engine.model)
        self.model.eval()
        self.engine.clear_prefix_cache()  # the weights changed since the cached states were computed
        run_lockstep(self.client, [r["episode"] for r in runs])
        for r in runs:
            result = r["episode"].finish()
            task = r["task"]
            r["result"] = result
            r["reward"] = reward_of(self.domains[task.domain], task, r["tools"], result.answer)
            r["thinking"] = result.usage.reasoning_tokens
            pixels = decode_conversation(result.messages)  # the task's images, in placeholder order
            r["images"] = [pixels[id(part)] for _, part in image_parts(result.messages)]
            r["cost"] = self._thinking_cost(r["tier"], r["thinking"])
        if rl.guide:
            first = {}
            for r in runs:
                first.setdefault(r["group"], r)
            runs += [{**self._guide(r), "index": len(picks) * rl.group_size + g} for g, r in first.items()]
        return runs

    def _guide(self, first: dict[str, Any]) -> dict[str, Any]:
        """The reference member of `first`'s group: the task's reference trajectory, rendered as supervised
        training renders it under the group's first tier, scored 1.0 (every domain's generator builds its
        reference to solve the task), its thinking charged like a rollout's."""
        task, tier = first["task"], first["tier"]
        example = task_example(self.tokenizer, self.model.config, task, tier)
        thinking = sum(len(self.tokenizer.encode(m["reasoning_content"])) for m in task.target
                       if m.get("role") == "assistant" and m.get("reasoning_content"))
        return {"task": task, "group": first["group"], "tier": tier, "guide": example, "reward": 1.0,
                "thinking": thinking, "cost": self._thinking_cost(tier, thinking), "images": example.images}

    def _thinking_cost(self, tier: str | None, thinking: int) -> float:
        """thinking_cost per whole budget of the tier (a rollout without a tier: per token)."""
        return self.rl.thinking_cost * thinking / (self.budgets[tier] if tier else 1)

    def _everyones(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Every rank's records (small dicts with an `index`), in index order: the whole step as one process
        sees it. In one process: the records, sorted."""
        if self.sharded:
            everyone: list[list[dict[str, Any]] | None] = [None] * self.world
            dist.all_gather_object(everyone, records)
            records = [r for part in everyone for r in part]
        return sorted(records, key=lambda r: r["index"])

    # --- one step --------------------------------------------------------------------------------------
    def step(self) -> dict[str, Any]:
        """One step. Under FSDP each rank rolls out and trains on its own groups; the per-rollout numbers the
        statistics and advantages need (domain, reward, cost, tokens) are gathered, so every rank computes
        the whole step's normalisation, advantages and token weights as one process does, and the ranks'
        losses add up to the one-process loss (FSDP sums the gradients)."""
        cfg, rl, model = self.config, self.rl, self.model
        t0 = time.perf_counter()
        runs = self.rollouts()
        t_rollout = time.perf_counter() - t0
        # this rank's sequences: the tokens of each rollout it ran (its guides: the reference)
        seqs = [(r["index"], ex) for r in runs
                for ex in ([r["guide"]] if "guide" in r else rollout_examples(r["episode"].turns, r["images"]))]
        tokens: dict[int, int] = {}  # rollout index -> its trained tokens
        sequences: dict[int, int] = {}  # rollout index -> its sequences
        for i, ex in seqs:
            tokens[i] = tokens.get(i, 0) + sum(ex.mask[1:])
            sequences[i] = sequences.get(i, 0) + 1
        every = self._everyones([{"index": r["index"], "domain": r["task"].domain, "group": r["group"],
                                  "tier": r["tier"] or "none",
                                  "reward": r["reward"], "cost": r["cost"], "thinking": r["thinking"],
                                  "guide": "guide" in r, "tokens": tokens.get(r["index"], 0),
                                  "sequences": sequences.get(r["index"], 0)} for r in runs])
        by_domain: dict[str, list[dict]] = {}  # the policy's own rollouts: what the statistics describe
        for r in every:
            if not r["guide"]:
                by_domain.setdefault(r["domain"], []).append(r)
        for name, rs in by_domain.items():
            self.normalizer.update(name, [r["reward"] for r in rs])
            acc = sum(r["reward"] for r in rs) / len(rs)
            self.accuracy[name] = 0.9 * self.accuracy[name] + 0.1 * acc
        adv = advantages([r["domain"] for r in every], [r["group"] for r in every], [r["reward"] for r in every],
                         self.normalizer, [r["cost"] for r in every], rl.group_std, rl.clip)
        position = {r["index"]: k for k, r in enumerate(every)}  # a rollout's index -> its row in `every`
        for r, a in zip(every, adv, strict=True):
            r["norm"], r["advantage"] = self.normalizer.normalize(r["domain"], r["reward"]), a
        n_tokens = torch.tensor([float(r["tokens"]) for r in every])
        weight = token_weights(adv, n_tokens)  # over all rollouts, so dropping the flat ones changes no weight
        seqs = [(position[i], ex) for i, ex in seqs]
        seqs.sort(key=lambda s: len(s[1].ids))  # similar lengths share a micro-batch: little padding
        if not rl.train_flat:
            # a rollout with advantage 0 (its group all scored alike) adds nothing to the policy gradient, and
            # near the ceiling most groups do: skipping their forwards and backwards makes the step several
            # times cheaper with the same policy gradient; the KL and indexer terms then see the rest only
            seqs = [(i, ex) for i, ex in seqs if adv[i] != 0.0]
        trained = [k for k, r in enumerate(every) if r["sequences"] and (rl.train_flat or adv[k] != 0.0)]
        lr = self.begin_update()
        model.train()
        pg_total, kl_sum, indexer_total = 0.0, 0.0, 0.0
        kl_tokens = max(1.0, float(n_tokens[trained].sum()))
        chunks = [seqs[k: k + rl.micro_batch] for k in range(0, len(seqs), rl.micro_batch)]
        if self.sharded:
            # FSDP: every rank runs as many forwards and backwards (each all-gathers and reduce-scatters):
            # a rank with fewer micro-batches runs idle ones, a 2-token sequence weighted 0
            most = torch.tensor([len(chunks)])
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            chunks += [[] for _ in range(int(most) - len(chunks))]
        for chunk in chunks:
            owners = torch.tensor([i for i, _ in chunk], dtype=torch.long)
            batch = collate([ex for _, ex in chunk] or [self._idle_example()], cfg.max_len, model.config,
                            self.tokenizer.special.image)
            if self.sharded:  # another rank encodes images in this micro-batch: so does this one (trainer)
                anyone = all_reduce(torch.tensor([int(bool(batch["images"]))]))
                if int(anyone) and not batch["images"]:
                    batch["idle_image"] = self._idle_image()
            options = stage_options(cfg.stage)  # "sparse": the indexers' inputs too; "sft": the defaults
            logp, mask = self._token_logprobs(model, batch, rl.temperature, options)
            if not chunk:  # an idle micro-batch: weight 0 and no token in the KL, but the same collectives
                logp, mask = logp * 0.0, mask * 0.0
            pg = -((weight[owners] if chunk else 0.0) * logp.sum(-1)).sum()
            loss = pg
            if self.reference is not None:
                with torch.no_grad():
                    ref, _ = self._token_logprobs(self.reference, batch, rl.temperature)
                d = (ref - logp) * mask
                # k3: >= 0, unbiased; per token at most KL_CLAMP, since exp(d) of a token the policy has all but
                # ruled out (d ~ 15) would be millions and its gradient would swamp the whole step
                kl = ((d.exp() - d - 1).clamp(max=KL_CLAMP) * mask).sum()
                loss = loss + rl.kl_coef * kl / kl_tokens
                kl_sum += kl.item()
            if self.dsa and rl.indexer_loss:  # (one process only: refused under FSDP)
                indexer, _ = indexer_losses(self.dsa, options.indexer_taps)
                loss = loss + indexer / len(chunks)
                indexer_total += indexer.item() / len(chunks)
            loss.backward()
            pg_total += pg.item()
        grad_norm = self.apply_update(None)
        pg_total, kl_sum, indexer_total, n_seqs = self._sum_over_ranks(pg_total, kl_sum, indexer_total, len(seqs))
        kl_mean = kl_sum / kl_tokens
        entry = {"step": self.step_idx, "loss": pg_total + rl.kl_coef * kl_mean + indexer_total, "pg_loss": pg_total,
                 "kl": kl_mean, "indexer_kl": indexer_total, "lr": lr, "grad_norm": float(grad_norm),
                 "sequences": int(n_seqs), "trained_rollouts": len(trained), "tokens": int(n_tokens.sum()),
                 "guided_groups": sum(adv[k] > 0 for k, r in enumerate(every) if r["guide"]),
                 "rollout_seconds": t_rollout,
                 "seconds": time.perf_counter() - t0,
                 "domains": {name: {"reward": sum(r["reward"] for r in rs) / len(rs),
                                    "accuracy": sum(r["reward"] >= 1.0 for r in rs) / len(rs),
                                    "normalized": sum(r["norm"] for r in rs) / len(rs),
                                    "advantage_abs": sum(abs(r["advantage"]) for r in rs) / len(rs),
                                    "thinking_tokens": sum(r["thinking"] for r in rs) / len(rs),
                                    "rollouts": len(rs), "tiers": per_tier(rs)} for name, rs in by_domain.items()}}
        self.log.append(entry)
        return entry

    def _idle_example(self) -> Example:
        """An FSDP rank's idle micro-batch: two tokens, one target, weighted 0."""
        return Example([self.tokenizer.special.end_of_text] * 2, [False, True], [])

    def _idle_image(self) -> torch.Tensor:
        """A blank image of one image token, for a micro-batch where another rank encodes images."""
        side = self.model.config.vision_patch_size * self.model.config.vision_merge
        return torch.zeros(side, side, 3, dtype=torch.uint8)

    @staticmethod
    def _token_logprobs(model, batch, temperature: float = 1.0,
                        options: ForwardOptions | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probability of each next token [B, T], 0 where it was not generated; the mask) for a batch,
        under the sampling temperature: the policy the rollouts were drawn from, so the update is on-policy.
        options: the forward's (the training stage's: stage_options; None: the defaults)."""
        embeds, image_mask = image_inputs(model, batch)
        logits = model(batch["ids"], lengths=batch["lengths"], image_embeds=embeds, image_mask=image_mask,
                       options=options).float()
        if temperature != 1.0:
            logits = logits / temperature
        targets = batch["targets"]
        mask = (targets != -100).float()
        logp = -F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100,
                                reduction="none").view_as(targets)  # 0 where ignored
        return logp, mask

    def heldout_domains(self) -> list[str]:
        return list(self.rl.domains)

    def eval_engine(self):
        return self.engine

    def eval_limits(self) -> dict[str, int]:
        """Validation runs under the rollouts' limits: the policy as it is trained, decoded greedily."""
        return {"max_steps": self.rl.max_episode_steps, "max_tokens": self.rl.max_tokens}

    # --- state -----------------------------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        return {"normalizer": self.normalizer.stats, "accuracy": self.accuracy, "next_seed": self.next_seed,
                "rl": asdict(self.rl), "init": self.init}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.normalizer.stats = {k: list(v) for k, v in state.get("normalizer", {}).items()}
        self.accuracy.update(state.get("accuracy", {}))
        self.next_seed = int(state.get("next_seed", self.next_seed))
        self.init = state.get("init")
        if self.reference is not None:  # the KL anchor is the run's initial policy, not the resumed weights
            if self.init is None:
                print("horizon rl: warning: the run's state does not record the checkpoint it started from; the "
                      "KL penalty is measured to the resumed weights from here on", file=sys.stderr)
            else:
                self.reference.load_state_dict(open_model(self.init, dtype=torch.float32).model.state_dict())

    log_name, plot_name = "rl_log.jsonl", "rl_curves.png"

    def plot(self, plt, window: int = 10):
        """Per domain: reward, accuracy, thinking tokens and mean |advantage| (the weight the domain gets in
        the gradient); and the KL to the initial policy. Faint: each step; solid: a rollout-weighted
        moving average over `window` steps (a step holds only a few tasks per domain). With several tiers,
        thinking tokens are drawn per domain (colour) and tier (line style). With validation
        (eval_every), a sixth panel: greedy held-out accuracy, the number the sampled accuracy only hints at."""
        keys = ("reward", "accuracy", "thinking_tokens", "advantage_abs")
        panels = 6 if self.heldout else 5
        fig, axes = plt.subplots(1, panels, figsize=(4 * panels, 3.5))
        if self.heldout:
            self.plot_heldout(axes[5])
        tiers = [t or "none" for t in self.rl.tiers]
        styles = dict(zip(("none", "low", "high", "max"), (":", "-", "--", "-."), strict=True))
        for k, name in enumerate(self.rl.domains):
            pts = [(e["step"], e["domains"][name]) for e in self.log if name in e["domains"]]
            for ax, key in zip(axes[:4], keys, strict=True):
                if key == "thinking_tokens" and len(tiers) > 1:
                    for tier in tiers:
                        sub = [(s, d["tiers"][tier]) for s, d in pts if tier in d.get("tiers", {})]
                        _curve(ax, sub, key, window, f"C{k}", f"{name} {tier}", styles[tier])
                else:
                    _curve(ax, pts, key, window, f"C{k}", name, "-")
        axes[4].plot([e["step"] for e in self.log], [e["kl"] for e in self.log])
        titles = ("reward", "accuracy", "thinking tokens", "mean |advantage|", "KL to the initial policy")
        for ax, title in zip(axes[:5], titles, strict=True):
            ax.set(xlabel="step", title=title)
        axes[0].legend()
        if len(tiers) > 1:
            axes[2].legend(fontsize="x-small", ncol=2)
        return fig


def _curve(ax, points: list[tuple[int, dict[str, Any]]], key: str, window: int, color: str, label: str,
           style: str) -> None:
    """One series of the RL plot: each step faint, and a rollout-weighted moving average over `window` steps."""
    steps = [s for s, _ in points]
    values = [d.get(key, 0.0) for _, d in points]
    weights = [d["rollouts"] for _, d in points]
    smooth = []
    for i, s in enumerate(steps):
        near = [j for j in range(i + 1) if steps[j] > s - window]
        smooth.append(sum(values[j] * weights[j] for j in near) / sum(weights[j] for j in near))
    ax.plot(steps, values, color=color, alpha=0.25, linestyle=style)
    ax.plot(steps, smooth, color=color, label=label, linestyle=style)
