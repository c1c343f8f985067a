"""Training: examples from task domains and user chats, the supervised trainer, resumable state."""

from horizon.train.data import Example, Mixture, collate, read_jsonl, render_chat, task_example
from horizon.train.trainer import TrainConfig, Trainer

__all__ = ["Example", "Mixture", "TrainConfig", "Trainer", "collate", "read_jsonl", "render_chat", "task_example"]
