"""Supervised training: next-token loss on what the model generates, with everything a run needs to
be stopped and resumed exactly.

One step: sample a batch from the `Mixture`, forward (optionally under bf16 autocast; images through
the vision encoder, which trains too), cross-entropy on the assistant tokens only, backward, clip the
gradient norm, AdamW at the step's learning rate (linear warm-up, then cosine down to
`min_lr_ratio` of the peak), then the MoE's auxiliary-loss-free bias update from the step's expert
loads (docs/design.md §1.3).

A checkpoint folder (`<out>/checkpoint`) is a normal Horizon checkpoint (config, weights,
tokenizer) plus `trainer_state/state.safetensors` (AdamW moments by parameter name, the torch RNG
state, the mixture sampler's generator state) and `trainer_state/state.json` (step, config, what the
data was built from, the log so far). No
pickles. Resuming restores all of it, so a stopped-and-resumed run reproduces the uninterrupted
run's losses exactly. The log is also written as `train_log.jsonl` and plotted to `train_curves.png`
at every checkpoint. With `eval_every`, the run also measures greedy held-out accuracy per task domain
(`horizon.eval.evaluate`, on a range of the held-out split apart from `horizon eval`'s) before its first
step and every `eval_every` steps, into `heldout.jsonl` and the curves.

Under torchrun the model comes in sharded (horizon.parallel.fsdp.shard_for_training) and N ranks take the
one-process step: every rank draws the same global batch and computes on its rows `rank::world`, losses
are divided by target counts summed over ranks, the logged numbers are sums over ranks (identical on
every rank), and only rank 0 writes files, from weights and optimiser state gathered to it, in the same
layout; the others wait for it at a barrier. Held-out validation decodes gathered, unsharded copies (rank 0
drives the engine, the others follow it).
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from horizon.checkpoint import save
from horizon.engine import Engine, EngineConfig
from horizon.eval import evaluate
from horizon.model.dsa import GatedDSA
from horizon.model.moe import balance_moe_bias
from horizon.model.options import ForwardOptions
from horizon.parallel import all_reduce, broadcast_object, fsdp
from horizon.parallel.group import rank, world_size
from horizon.train.data import Mixture, collate
from horizon.train.indexer import indexer_losses

STAGES = ("sft", "dense", "indexer-warmup", "sparse")
INDEXER_STAGES = ("indexer-warmup", "sparse")  # the stages that train the DSA indexers (the others: LM loss only)
TRAINER_STATE = "trainer_state"  # a subfolder: the checkpoint folder itself stays a plain model checkpoint
EVAL_ENGINE = EngineConfig(max_num_seqs=16, max_batch_tokens=2048)  # what held-out validation decodes with


@dataclass
class TrainConfig:
    steps: int = 200
    batch_size: int = 8
    max_len: int = 1024  # tokens per example (longer ones are cut)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    moe_bias_gamma: float = 1e-3  # the balancing bias step (0: off)
    bf16: bool = False  # autocast the forward to bf16 (weights and optimiser stay fp32)
    seed: int = 0
    log_every: int = 10
    save_every: int = 100  # also at the end
    stage: str = "sft"
    # held-out validation during the run: every eval_every steps (0: off), and once before the first step,
    # eval_n greedy tasks per task domain from seed eval_seed of the held-out split. The default range
    # starts far from `horizon eval`'s (seed 0), so the numbers a run is watched by are not its final test.
    eval_every: int = 0
    eval_n: int = 50
    eval_seed: int = 100_000
    eval_tier: str | None = "low"

    def validate(self) -> None:
        for name in ("steps", "batch_size", "max_len", "log_every", "save_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)!r}: must be an integer >= 1")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"TrainConfig: lr must be > 0 and min_lr_ratio in [0, 1], got {self.lr}, "
                             f"{self.min_lr_ratio}")
        if self.warmup_steps < 0 or self.grad_clip <= 0 or self.weight_decay < 0 or self.moe_bias_gamma < 0:
            raise ValueError("TrainConfig: warmup_steps, weight_decay, moe_bias_gamma must be >= 0 and grad_clip > 0")
        if self.stage not in STAGES:
            raise ValueError(f"TrainConfig.stage={self.stage!r}: allowed {', '.join(STAGES)}")
        if not isinstance(self.eval_every, int) or self.eval_every < 0 or not isinstance(self.eval_n, int) \
                or self.eval_n < 1 or not isinstance(self.eval_seed, int) or self.eval_seed < 0:
            raise ValueError(f"TrainConfig: eval_every must be an integer >= 0, eval_n >= 1 and eval_seed >= 0, got "
                             f"{self.eval_every!r}, {self.eval_n!r}, {self.eval_seed!r}")
        if self.eval_tier not in (None, "low", "high", "max"):
            raise ValueError(f"TrainConfig.eval_tier={self.eval_tier!r}: allowed low, high, max or None (thinking off)")

    def lr_at(self, step: int) -> float:
        """Learning rate of step `step` (0-based): linear warm-up, then cosine to lr * min_lr_ratio."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, self.steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_stage(model, stage: str) -> list:
    """Put the model's parameters in a training stage (docs/design.md §1.2): which of them train; returns
    its Gated DSA layers with an indexer. How the stage attends is per forward: `stage_options(stage)`.

    sft: everything trains, attention as configured (sparse past index_topk).
    dense: everything trains, attention dense at every length (the dense base model that the indexer
    stages start from, as DeepSeek-V3.2 starts from a densely trained model: an untrained indexer's
    top-k is an arbitrary subset, and the attention layers would learn around it).
    indexer-warmup: dense attention; every parameter but the indexers' frozen; the indexers learn the
    head-summed dense attention distribution (KL).
    sparse: top-k selection on; the model trains on the LM loss, the indexers on the KL over what they
    selected.
    """
    dsa = [m for m in model.modules() if isinstance(m, GatedDSA) and m.indexer is not None]
    if stage in INDEXER_STAGES and not dsa:
        raise ValueError(f"stage {stage!r} trains the DSA indexers, but this model has none")
    for name, p in model.named_parameters():
        p.requires_grad_(stage != "indexer-warmup" or ".indexer." in name)
    return dsa


def stage_options(stage: str) -> ForwardOptions:
    """A training forward's options in `stage`: dense attention in the dense and warm-up stages, and the
    indexers' training inputs (indexer_taps, for horizon.train.indexer) in the stages that train them.
    A fresh object per forward: the taps it collects belong to that forward."""
    return ForwardOptions(selection="dense" if stage in ("dense", "indexer-warmup") else "indexer",
                          indexer_inputs=stage in INDEXER_STAGES)


def image_inputs(model, batch: dict[str, Any]) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(image embeddings, image mask) for a collated batch's forward. With `idle_image` (FSDP: another rank
    encodes images in this forward and this one has none) it encodes that image and uses none of it (no
    rows, no positions), so every rank runs the same collectives in the same order and this rank's vision
    encoder gradient is zero (horizon.parallel.fsdp)."""
    if batch["images"]:
        return torch.cat(model.encode_images(batch["images"])), batch["image_mask"]
    if batch.get("idle_image") is not None:
        return model.encode_images([batch["idle_image"]])[0][:0], torch.zeros_like(batch["ids"], dtype=torch.bool)
    return None, batch["image_mask"]


def _no_decay(name: str, p: torch.Tensor) -> bool:
    """Norms, biases, embeddings' position tables and 1-D scalars are not decayed."""
    return p.dim() < 2 or "norm" in name or name.endswith(".bias")


class Trainer:
    def __init__(self, model, tokenizer, mixture: Mixture, config: TrainConfig, out_dir: str | Path,
                 generation_config: dict[str, Any] | None = None):
        config.validate()
        self.model, self.tokenizer, self.mixture, self.config = model, tokenizer, mixture, config
        # FSDP (a model sharded by horizon.parallel.fsdp): this rank's place; rank 0 alone writes and prints
        self.sharded = fsdp.is_sharded(model)
        self.rank, self.world = (rank(), world_size()) if self.sharded else (0, 1)
        self.writer = self.rank == 0
        if config.batch_size < self.world:
            raise ValueError(f"--batch-size {config.batch_size} is smaller than the {self.world} ranks: every rank "
                             f"needs at least one row of the global batch")
        if self.sharded and config.stage in INDEXER_STAGES:
            raise ValueError(f"--stage {config.stage} does not run under FSDP (WORLD_SIZE={self.world}): the indexer's "
                             f"objective recomputes attention outside the layers' forward, where FSDP holds only "
                             f"shards of their weights; run the indexer stages in one process")
        if self.sharded:  # every rank draws the global batch itself: they must hold the same data
            fsdp.check_same_on_every_rank(mixture.digest(), "the training data")
        self.dsa = set_stage(model, config.stage)
        self.out = Path(out_dir)
        self.generation_config = generation_config
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        params = dict(model.named_parameters())
        decay = [params[n] for n in self.names if not _no_decay(n, params[n])]
        plain = [params[n] for n in self.names if _no_decay(n, params[n])]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": config.weight_decay}, {"params": plain, "weight_decay": 0.0}],
            lr=config.lr, betas=(config.beta1, config.beta2), foreach=False)
        self.step_idx = 0
        self.parts: dict[str, float] = {}  # the last step's loss terms and indexer statistics
        self.step_loss = math.nan  # the last step's loss as logged (under FSDP: summed over the ranks)
        self.log: list[dict[str, Any]] = []
        self.heldout: list[dict[str, Any]] = []  # the validation evaluations (config.eval_every)
        self._engine = None  # built on the first validation
        self.sources_spec: dict[str, Any] | None = None  # what the data was built from (checked on resume)
        torch.manual_seed(config.seed)

    # --- one step ----------------------------------------------------------------------------------
    def loss(self, batch: dict[str, Any]) -> tuple[torch.Tensor, int]:
        """The batch's loss to backpropagate and its number of target tokens. Under FSDP: this rank's share
        of the global batch's loss (the ranks' losses add up to it) and the global count; self.step_loss
        and self.parts are then the global values."""
        model, stage = self.model, self.config.stage
        targets = batch["targets"]
        n = int(self._sum_over_ranks(int((targets != -100).sum()))[0])
        embeds, image_mask = image_inputs(model, batch)
        options = stage_options(stage)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.config.bf16):
            logits = model(batch["ids"], lengths=batch["lengths"], image_embeds=embeds, image_mask=image_mask,
                           options=options)
            if stage in INDEXER_STAGES:  # under the forward's autocast, as the layers' own projections ran
                indexer, stats = indexer_losses(self.dsa, options.indexer_taps)
        lm = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
        lm = lm / max(n, 1)
        self.step_loss = self._sum_over_ranks(lm.item())[0]
        self.parts = {"lm_loss": self.step_loss}
        if stage not in INDEXER_STAGES:
            return lm, n
        # (one process only: the Trainer refuses these stages under FSDP)
        self.parts["indexer_kl"] = indexer.item()
        if stats:  # query-weighted over the DSA layers
            q = sum(st["queries"] for st in stats)
            self.parts["indexer_recall"] = sum(st["recall"] * st["queries"] for st in stats) / q
            self.parts["recent_recall"] = sum(st["recent_recall"] * st["queries"] for st in stats) / q
        # warm-up: only the indexer learns (everything else is frozen); sparse: the LM loss trains the model
        # and the KL the indexer (its inputs are detached, and top-k selection passes no gradient)
        loss = indexer if stage == "indexer-warmup" else lm + indexer
        self.step_loss = loss.item()
        return loss, n

    def _sum_over_ranks(self, *values: float) -> list[float]:
        """Each value summed over the FSDP ranks (one all-reduce, float64: counts stay exact); as they are in
        one process."""
        if not self.sharded:
            return list(values)
        return all_reduce(torch.tensor(values, dtype=torch.float64)).tolist()

    def step(self) -> dict[str, Any]:
        cfg, model = self.config, self.model
        model.train()
        t0 = time.perf_counter()
        batch = self.rank_batch(self.mixture.sample(cfg.batch_size))
        lr = self.begin_update()
        loss, n_targets = self.loss(batch)
        grad_norm = self.apply_update(loss)
        dt = time.perf_counter() - t0  # this rank's clock (rank 0's is the one written)
        tokens = int(self._sum_over_ranks(int(batch["lengths"].sum()))[0])
        entry = {"step": self.step_idx, "loss": self.step_loss, **self.parts, "lr": lr, "grad_norm": float(grad_norm),
                 "tokens": tokens, "target_tokens": n_targets, "tokens_per_s": tokens / dt, "seconds": dt}
        self.log.append(entry)
        return entry

    def rank_batch(self, examples: list) -> dict[str, Any]:
        """The collated batch this rank computes on: all of `examples` in one process; under FSDP, where every
        rank drew the same global batch, its rows rank::world."""
        batch = collate(fsdp.rank_rows(examples, self.rank, self.world), self.config.max_len, self.model.config,
                        self.tokenizer.special.image)
        if self.sharded and not batch["images"]:  # an image another rank encodes, for loss(): see there
            batch["idle_image"] = next((img for ex in examples for img in ex.images), None)
        return batch

    def begin_update(self) -> float:
        """Set this step's learning rate and clear the gradients; returns the rate."""
        lr = self.config.lr_at(self.step_idx)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        return lr

    def apply_update(self, loss: torch.Tensor | None) -> float:
        """Backward (None: the gradients are already accumulated), clip, AdamW step, the MoE bias update;
        returns the gradient norm before clipping."""
        cfg, model = self.config, self.model
        if loss is not None:
            loss.backward()
        # under FSDP the gradients are DTensor shards and the norm is the global one (a replicated DTensor)
        grad_norm = fsdp.replicated(torch.nn.utils.clip_grad_norm_(
            [p for p in model.parameters() if p.grad is not None], cfg.grad_clip))
        self.optimizer.step()
        if cfg.moe_bias_gamma:
            balance_moe_bias(model, cfg.moe_bias_gamma)
        self.step_idx += 1
        return float(grad_norm)

    def train(self, progress: bool = True, max_minutes: float | None = None) -> list[dict[str, Any]]:
        """Steps until config.steps, or until max_minutes of wall clock have passed (a compute budget: runs
        compared "for the same compute" stop at the same time); checkpoints every save_every steps and at
        the end."""
        cfg = self.config
        deadline = time.perf_counter() + 60 * max_minutes if max_minutes else math.inf
        bar = None
        if progress and self.writer:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            bar = Progress(TextColumn("[bold]train"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                           TextColumn("loss {task.fields[loss]}"), TimeRemainingColumn())
            task = bar.add_task("train", total=cfg.steps, completed=self.step_idx, loss="-")
            bar.start()
        saved = False  # the last thing the loop did was a checkpoint, which also wrote the log
        try:
            if cfg.eval_every and not self.heldout and self.step_idx < cfg.steps:
                self.validate_heldout()  # where the run starts from
            while self.step_idx < cfg.steps:
                entry = self.step()
                if bar is not None:
                    bar.update(task, completed=self.step_idx, loss=f"{entry['loss']:.3f}")
                elif self.writer and (self.step_idx % cfg.log_every == 0 or self.step_idx == cfg.steps):  # for logs
                    print(f"step {self.step_idx}/{cfg.steps} " + " ".join(
                        f"{k} {v:.4g}" for k, v in entry.items() if k != "step" and isinstance(v, float)),
                        file=sys.stderr, flush=True)
                out_of_time = time.perf_counter() >= deadline
                if self.sharded and max_minutes:
                    out_of_time = broadcast_object(out_of_time)  # rank 0's clock decides for all, or they part ways
                if cfg.eval_every and (self.step_idx % cfg.eval_every == 0 or self.step_idx == cfg.steps
                                       or out_of_time):
                    self.validate_heldout()
                saved = self.step_idx % cfg.save_every == 0 or self.step_idx == cfg.steps or out_of_time
                if saved:
                    self.save()
                if out_of_time:
                    if self.writer:
                        print(f"stopped at step {self.step_idx}/{cfg.steps}: the {max_minutes:g}-minute budget is "
                              f"spent", file=sys.stderr, flush=True)
                    break
        finally:
            if bar is not None:
                bar.stop()
        if not saved:
            self.write_log()
        return self.log

    # --- held-out validation -----------------------------------------------------------------------
    def heldout_domains(self) -> list[str]:
        """The task domains validated on: the mixture's (a --data source has no held-out split)."""
        return [name for name in self.mixture.names if name != "data"]

    def eval_engine(self):
        """The engine validation decodes with (the RL trainer has its own: the one that rolls out)."""
        if self._engine is None:
            self._engine = Engine(self.model, self.tokenizer, EVAL_ENGINE, generation_config=self.generation_config)
        return self._engine

    def eval_limits(self) -> dict[str, int]:
        """evaluate()'s max_steps / max_tokens in validation; none given: its defaults, `horizon eval`'s."""
        return {}

    def validate_heldout(self) -> dict[str, Any]:
        """Greedy held-out accuracy (Wilson 95% interval) and thinking tokens per domain, as `horizon eval`
        measures them, on config.eval_n tasks from config.eval_seed; appended to self.heldout, written to
        heldout.jsonl and plotted. Its time counts toward max_minutes: it is part of the run's compute.

        Under FSDP an engine must not decode through the sharded modules (ranks running different numbers of
        forwards would wait on each other's all-gathers): every rank gathers an unsharded copy, and the
        engine runs over them as it does under tensor parallelism, rank 0 driving (it evaluates) and the others
        following step by step, so no rank waits on another for longer than a step; rank 0's numbers are
        then kept on every rank."""
        cfg = self.config
        domains = self.heldout_domains()
        if not domains:
            raise ValueError("eval_every: the run has no task domain to validate on (--data has no held-out split)")
        t0 = time.perf_counter()
        self.model.eval()
        if self.sharded:
            engine = Engine(fsdp.gathered_model(self.model, everywhere=True), self.tokenizer, EVAL_ENGINE,
                            generation_config=self.generation_config)
            if not self.writer:
                engine.follow()  # until rank 0's engine stops
                entry = broadcast_object(None)
                self.heldout.append(entry)
                return entry
        else:
            engine = self.eval_engine()
        engine.clear_prefix_cache()  # the weights changed since any cached state was computed
        try:
            result = evaluate(engine, self.tokenizer, domains, n=cfg.eval_n, tier=cfg.eval_tier,
                              seed=cfg.eval_seed, **self.eval_limits())
        finally:
            if self.sharded:
                engine.stop()  # the followers' follow() returns
        entry = {"step": self.step_idx, "seconds": time.perf_counter() - t0,
                 "domains": {name: {k: r[k] for k in ("accuracy", "ci95", "thinking_tokens", "n")}
                             for name, r in result.items()}}
        if self.sharded:
            broadcast_object(entry)
        self.heldout.append(entry)
        print(f"held-out at step {self.step_idx}: " + ", ".join(
            f"{name} {r['accuracy']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]" for name, r in result.items()),
            file=sys.stderr, flush=True)
        return entry

    def plot_heldout(self, ax) -> None:
        """Held-out accuracy per domain with its 95% interval, on `ax`."""
        names = sorted({name for e in self.heldout for name in e["domains"]})
        for k, name in enumerate(names):
            pts = [(e["step"], e["domains"][name]) for e in self.heldout if name in e["domains"]]
            steps = [s for s, _ in pts]
            ax.plot(steps, [d["accuracy"] for _, d in pts], "o-", color=f"C{k}", label=name)
            ax.fill_between(steps, [d["ci95"][0] for _, d in pts], [d["ci95"][1] for _, d in pts],
                            color=f"C{k}", alpha=0.15)
        ax.set(xlabel="step", title=f"held-out accuracy (greedy, {self.config.eval_n} per domain)")
        ax.legend()

    # --- state -------------------------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> Path:
        return self.out / "checkpoint"

    def save(self) -> Path:
        """Weights (a loadable Horizon checkpoint) + optimiser, RNG and sampler state, atomically replaced.

        Under FSDP every rank takes part (weights and optimiser state are gathered to rank 0), rank 0 writes
        the one-process layout, and the others wait for it at a barrier: no rank goes on (and none can read
        the checkpoint) before it is complete."""
        final, tmp = self.checkpoint_dir, self.out / "checkpoint.tmp"
        self.model.eval()
        model = fsdp.gathered_model(self.model) if self.sharded else self.model
        optimizer_state = self.optimizer_state()
        if self.writer:
            self._write_checkpoint(model, optimizer_state, tmp, final)
        if self.sharded:
            dist.barrier()
        return final

    def _write_checkpoint(self, model, optimizer_state: dict[str, dict[str, torch.Tensor]], tmp: Path,
                          final: Path) -> None:
        if tmp.exists():
            _rmtree(tmp)
        save(model, tmp, tokenizer=self.tokenizer, generation_config=self.generation_config)
        tensors = {"rng.torch": torch.get_rng_state(), "rng.mixture": self.mixture.generator.get_state()}
        for name in self.names:
            state = optimizer_state.get(name, {})
            for key, value in state.items():
                tensors[f"optim.{name}.{key}"] = value.detach().clone().reshape(-1) if value.dim() == 0 else value
        (tmp / TRAINER_STATE).mkdir()
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / TRAINER_STATE / "state.safetensors")
        meta = {"step": self.step_idx, "config": asdict(self.config), "sources": self.sources_spec, "log": self.log,
                "heldout": self.heldout, "extra": self.extra_state()}
        (tmp / TRAINER_STATE / "state.json").write_text(json.dumps(meta, indent=1))
        if final.exists():
            _rmtree(final)
        tmp.rename(final)
        self.write_log()  # so a running job's log and curves are never further behind than its checkpoint

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """AdamW's state by parameter name, whole (under FSDP gathered to rank 0; {} on the other ranks)."""
        if self.sharded:
            return fsdp.full_optimizer_state(self.model, self.optimizer)
        params = dict(self.model.named_parameters())
        return {name: self.optimizer.state[params[name]] for name in self.names
                if params[name] in self.optimizer.state}

    def restore(self, folder: str | Path | None = None) -> None:
        """Continue from a checkpoint written by save() (weights must already be loaded into the model)."""
        folder = Path(folder) if folder is not None else self.checkpoint_dir
        meta = json.loads((folder / TRAINER_STATE / "state.json").read_text())
        tensors = load_file(folder / TRAINER_STATE / "state.safetensors")
        state = {}
        for name in self.names:
            keys = {k.rsplit(".", 1)[-1]: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == f"optim.{name}"}
            if keys:
                state[name] = {k: (v.reshape(()) if k == "step" else v) for k, v in keys.items()}
        if self.sharded:  # every rank read the whole state and keeps its shards
            fsdp.load_optimizer_state(self.model, self.optimizer, state)
        else:
            params = dict(self.model.named_parameters())
            for name, entry in state.items():
                self.optimizer.state[params[name]] = entry
        torch.set_rng_state(tensors["rng.torch"])
        self.mixture.generator.set_state(tensors["rng.mixture"])
        self.step_idx, self.log = int(meta["step"]), list(meta["log"])
        self.heldout = list(meta.get("heldout", []))
        self.load_extra_state(meta.get("extra") or {})

    def extra_state(self) -> dict[str, Any]:
        """JSON state a subclass adds to checkpoints (the RL trainer: reward statistics, task counters)."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    log_name, plot_name = "train_log.jsonl", "train_curves.png"

    def write_log(self) -> None:
        """The log as JSONL (log_name) and its curves (plot_name, matplotlib); rank 0 only under FSDP."""
        if not self.writer:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.out / self.log_name, "w") as f:
            for entry in self.log:
                f.write(json.dumps(entry) + "\n")
        if self.heldout:
            with open(self.out / "heldout.jsonl", "w") as f:
                for entry in self.heldout:
                    f.write(json.dumps(entry) + "\n")
        if not self.log:
            return
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt

        fig = self.plot(plt)
        fig.tight_layout()
        fig.savefig(self.out / self.plot_name, dpi=100)
        plt.close(fig)

    def plot(self, plt):
        """Loss and throughput per step; held-out accuracy when the run validated."""
        steps = [e["step"] for e in self.log]
        fig, axes = plt.subplots(1, 3 if self.heldout else 2, figsize=(15 if self.heldout else 10, 3.5))
        a, b = axes[:2]
        if self.heldout:
            self.plot_heldout(axes[2])
        a.plot(steps, [e["loss"] for e in self.log])
        a.set(xlabel="step", ylabel="loss (assistant tokens)", title="training loss")
        b.plot(steps, [e["tokens_per_s"] for e in self.log])
        b.set(xlabel="step", ylabel="tokens / s", title="throughput")
        return fig


def config_from_dict(d: dict[str, Any]) -> TrainConfig:
    known = {f.name for f in fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in d.items() if k in known})


def _rmtree(path: Path) -> None:
    shutil.rmtree(path)
