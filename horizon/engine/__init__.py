"""The inference engine: continuous batching, paged caches, sampling, thinking budgets, prefix reuse,
grammar-constrained decoding."""

from horizon.engine.constraints import ConstraintError, ConstraintSpec
from horizon.engine.engine import Engine, EngineConfig, Result
from horizon.engine.params import Event, FinishEvent, Request, SamplingParams, TokenEvent, Usage

__all__ = ["ConstraintError", "ConstraintSpec", "Engine", "EngineConfig", "Event", "FinishEvent", "Request",
           "Result", "SamplingParams", "TokenEvent", "Usage"]
