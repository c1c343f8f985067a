"""Joint reinforcement learning across task domains: GRPO-style, with per-domain reward normalisation
and a thinking-cost term.

One step:
  1. pick `prompts_per_step` training tasks, their domains drawn with the sampling ratios (fixed, or
     adapted toward domains whose running accuracy is neither ~0 nor ~1, where there is signal);
  2. for each, a group of `group_size` rollouts through the engine (the serving sampler) as agent
     episodes (multi-step tasks use their tools), each under a thinking tier drawn from `tiers`;
  3. reward = the domain's reward - thinking_cost * thinking tokens / the tier's budget; normalised
     per domain with running mean and variance (so a domain scored in hundreds does not drown one
     scored in [0, 1]); advantages = the normalised rewards minus their group mean, over the group's
     standard deviation;
  4. loss = -mean over rollouts of advantage * mean log-probability of the tokens the model generated
     (the rollout re-rendered exactly: the assistant mask), + kl_coef * the k3 estimate of KL to the
     initial policy (a frozen copy, kept only when kl_coef > 0), + the DSA indexers' sparse-stage KL;
     AdamW step, MoE bias balancing, as in supervised training.
The checkpoint adds the reward statistics, the sampler's ratios and the task counter to the
supervised trainer's state, so a run resumes exactly where it stopped.
"""

from __future__ import annotations

import copy
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from horizon.train.data import collate, render_chat, tool_specs
from horizon.train.trainer import TrainConfig, Trainer


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


@dataclass
class RLConfig:
    domains: list[str] = field(default_factory=lambda: ["arithmetic"])
    ratios: list[float] | None = None  # fixed sampling ratios (None: equal)
    adaptive: bool = False  # move the ratios toward domains with learning signal
    prompts_per_step: int = 4
    group_size: int = 4
    tiers: list[str | None] = field(default_factory=lambda: ["low"])
    thinking_cost: float = 0.0  # reward penalty per thinking token, as a share of the tier's budget
    kl_coef: float = 0.0
    temperature: float = 1.0
    max_episode_steps: int = 4
    max_tokens: int = 256  # per model call
    indexer_loss: bool = True  # keep training the DSA indexers (sparse stage) during RL


class RLTrainer(Trainer):
    def __init__(self, model, tokenizer, engine, config: TrainConfig, rl: RLConfig, out_dir, generation_config=None):
        from horizon.agent.local import EngineClient
        from horizon.tasks import get_domain

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
        config.stage = "sparse" if rl.indexer_loss else "sft"
        super().__init__(model, tokenizer, self, config, out_dir, generation_config)
        self.engine = engine
        self.client = EngineClient(engine, tokenizer)
        self.budgets = engine.budgets
        self.reference = None
        if rl.kl_coef > 0:
            from horizon.train.trainer import set_stage

            self.reference = copy.deepcopy(model).eval()
            set_stage(self.reference, "sft")  # no indexer losses in the reference's forwards
            for p in self.reference.parameters():
                p.requires_grad_(False)

    # --- rollouts --------------------------------------------------------------------------------------
    def _domain_weights(self) -> torch.Tensor:
        w = [self.ratios[d] * (max(0.05, 4 * self.accuracy[d] * (1 - self.accuracy[d])) if self.rl.adaptive else 1)
             for d in self.rl.domains]
        return torch.tensor(w)

    def rollouts(self) -> list[dict[str, Any]]:
        """prompts_per_step tasks x group_size episodes, run in lockstep; one record per episode."""
        from horizon.agent import Agent, AgentConfig, fixed_policy
        from horizon.eval import reward_of, run_lockstep, task_tools

        rl = self.rl
        picks = torch.multinomial(self._domain_weights(), rl.prompts_per_step, replacement=True,
                                  generator=self.generator).tolist()
        rng = random.Random(int(torch.randint(2**31, (1,), generator=self.generator)))
        runs = []
        for k in picks:
            name = rl.domains[k]
            task = self.domains[name].generate(self.next_seed, "train")
            self.next_seed += 1
            for _ in range(rl.group_size):
                tier = rng.choice(rl.tiers)
                tools = task_tools(task, str(self.out))
                agent = Agent(self.client, tools, fixed_policy(tier),
                              AgentConfig(max_steps=rl.max_episode_steps, max_tokens_per_step=rl.max_tokens,
                                          temperature=rl.temperature, seed=rng.randrange(2**31)))
                episode = agent.episode(task.messages[-1]["content"], task.messages[:-1] or None)
                runs.append({"task": task, "group": len(runs) // rl.group_size, "tier": tier, "tools": tools,
                             "episode": episode})
        self.model.eval()
        self.engine.clear_prefix_cache()  # the weights changed since the cached states were computed
        run_lockstep(self.client, [r["episode"] for r in runs])
        for r in runs:
            result = r["episode"].finish()
            task = r["task"]
            r["result"] = result
            r["reward"] = reward_of(self.domains[task.domain], task, r["tools"], result.answer)
            budget = self.budgets[r["tier"]] if r["tier"] else 1
            r["thinking"] = result.usage.reasoning_tokens
            r["total"] = r["reward"] - self.rl.thinking_cost * r["thinking"] / budget
        return runs

    # --- one step --------------------------------------------------------------------------------------
    def step(self) -> dict[str, Any]:
        cfg, rl, model = self.config, self.rl, self.model
        t0 = time.perf_counter()
        runs = self.rollouts()
        by_domain: dict[str, list[dict]] = {}
        for r in runs:
            by_domain.setdefault(r["task"].domain, []).append(r)
        for name, rs in by_domain.items():
            self.normalizer.update(name, [r["total"] for r in rs])
            acc = sum(r["reward"] for r in rs) / len(rs)
            self.accuracy[name] = 0.9 * self.accuracy[name] + 0.1 * acc
        for r in runs:
            r["norm"] = self.normalizer.normalize(r["task"].domain, r["total"])
        for g in {r["group"] for r in runs}:
            group = [r for r in runs if r["group"] == g]
            values = torch.tensor([r["norm"] for r in group])
            std = float(values.std()) if len(group) > 1 else 0.0
            for r in group:
                r["advantage"] = (r["norm"] - float(values.mean())) / (std + 1e-6) if std > 1e-8 else 0.0
        examples = [render_chat(self.tokenizer, model.config, r["result"].messages,
                                tool_specs(r["task"].tools), r["tier"]) for r in runs]
        batch = collate(examples, cfg.max_len, model.config, self.tokenizer.special.image)
        lr = self.begin_update()
        model.train()
        logp, mask = self._token_logprobs(model, batch)
        n_tokens = mask.sum(-1).clamp_min(1)
        adv = torch.tensor([r["advantage"] for r in runs])
        pg = -(adv * (logp * mask).sum(-1) / n_tokens).mean()
        loss, kl = pg, torch.zeros(())
        if self.reference is not None:
            with torch.no_grad():
                ref, _ = self._token_logprobs(self.reference, batch)
            d = (ref - logp) * mask
            kl = ((d.exp() - d - 1) * mask).sum() / mask.sum().clamp_min(1)  # k3: >= 0, unbiased
            loss = loss + rl.kl_coef * kl
        if self.dsa and rl.indexer_loss:
            loss = loss + sum(m.indexer_loss for m in self.dsa if m.indexer_loss is not None) / len(self.dsa)
        grad_norm = self.apply_update(loss)
        entry = {"step": self.step_idx, "loss": loss.item(), "pg_loss": pg.item(), "kl": kl.item(), "lr": lr,
                 "grad_norm": float(grad_norm), "seconds": time.perf_counter() - t0,
                 "domains": {name: {"reward": sum(r["reward"] for r in rs) / len(rs),
                                    "accuracy": sum(r["reward"] >= 1.0 for r in rs) / len(rs),
                                    "normalized": sum(r["norm"] for r in rs) / len(rs),
                                    "thinking_tokens": sum(r["thinking"] for r in rs) / len(rs),
                                    "rollouts": len(rs)} for name, rs in by_domain.items()}}
        self.log.append(entry)
        return entry

    @staticmethod
    def _token_logprobs(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probability of each next token [B, T], 1.0 where it was generated) for a collated batch."""
        embeds = torch.cat(model.encode_images(batch["images"])) if batch["images"] else None
        logits = model(batch["ids"], lengths=batch["lengths"], image_embeds=embeds, image_mask=batch["image_mask"])
        targets = batch["targets"]
        mask = (targets != -100).float()
        logp = torch.gather(F.log_softmax(logits.float(), -1), -1, targets.clamp_min(0)[..., None])[..., 0]
        return logp * mask, mask

    # --- state -----------------------------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        return {"normalizer": self.normalizer.stats, "accuracy": self.accuracy, "next_seed": self.next_seed}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.normalizer.stats = {k: list(v) for k, v in state.get("normalizer", {}).items()}
        self.accuracy.update(state.get("accuracy", {}))
        self.next_seed = int(state.get("next_seed", self.next_seed))

    log_name, plot_name = "rl_log.jsonl", "rl_curves.png"

    def plot(self, plt):
        """Reward, accuracy and thinking tokens per domain, and the KL to the initial policy."""
        fig, axes = plt.subplots(1, 4, figsize=(16, 3.5))
        for name in self.rl.domains:
            pts = [(e["step"], e["domains"][name]) for e in self.log if name in e["domains"]]
            for ax, key in zip(axes[:3], ("reward", "accuracy", "thinking_tokens"), strict=True):
                ax.plot([s for s, _ in pts], [d[key] for _, d in pts], label=name)
        axes[3].plot([e["step"] for e in self.log], [e["kl"] for e in self.log])
        for ax, title in zip(axes, ("reward", "accuracy", "thinking tokens", "KL to the initial policy"), strict=True):
            ax.set(xlabel="step", title=title)
        axes[0].legend()
        return fig
