"""The inference engine: continuous batching, paged caches, sampling, thinking budgets, prefix reuse,
grammar-constrained decoding."""

from horizon.engine.constraints import ConstraintError, ConstraintSpec
from horizon.engine.engine import Engine, EngineClosed, EngineConfig, QueueFull, Result
from horizon.engine.params import Event, FinishEvent, Request, SamplingParams, TokenEvent, Usage

__all__ = ["ConstraintError", "ConstraintSpec", "Engine", "EngineClosed", "EngineConfig", "Event", "FinishEvent",
           "QueueFull", "Request", "Result", "SamplingParams", "TokenEvent", "Usage"]
