"""kvserve's engine: scheduler, KV blocks, model runner. `from engine import LLM, SamplingParams`."""
from engine.request import RequestError, RequestOutput, SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "RequestError"]


def __getattr__(name):
    # Lazy: importing the scheduler or request types must not import torch.
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    if name == "LLMEngine":
        from engine.engine import LLMEngine
        return LLMEngine
    if name == "EngineConfig":
        from engine.config import EngineConfig
        return EngineConfig
    raise AttributeError(name)
