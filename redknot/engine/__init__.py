"""The RedKnot engine: LLM facade, scheduler, model runner, sampler glue, typed role messages.

``SamplingParams`` (defined in :mod:`redknot.sample.params`, re-exported here) and the output
types are pure Python; ``LLM`` (torch) is imported on first use so the pure-Python roles stay
importable without torch.
"""
from redknot.engine.outputs import EngineStats, RequestMetrics, RequestOutput
from redknot.sample.params import SamplingParams

__all__ = ["LLM", "EngineStats", "RequestMetrics", "RequestOutput", "SamplingParams"]


def __getattr__(name):
    if name == "LLM":
        from redknot.engine.llm import LLM
        return LLM
    raise AttributeError(f"module 'redknot.engine' has no attribute {name!r}")
