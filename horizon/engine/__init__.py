"""The inference engine: continuous batching, paged caches, sampling, thinking budgets, prefix reuse."""

from horizon.engine.engine import Engine, EngineConfig, Result
from horizon.engine.params import Event, FinishEvent, Request, SamplingParams, TokenEvent, Usage

__all__ = ["Engine", "EngineConfig", "Event", "FinishEvent", "Request", "Result", "SamplingParams", "TokenEvent",
           "Usage"]
