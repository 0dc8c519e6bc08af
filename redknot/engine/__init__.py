"""The RedKnot engine: LLM facade and its factory, scheduler, model runner, sampler glue, typed role messages.

``SamplingParams`` (defined in :mod:`redknot.sample.params`, re-exported here) and the output
types are pure Python; ``LLM`` and ``build_engine`` (torch) are imported on first use so the
pure-Python roles stay importable without torch.
"""
from redknot.engine.outputs import EngineStats, RequestMetrics, RequestOutput
from redknot.sample.params import SamplingParams

__all__ = ["LLM", "EngineStats", "RequestMetrics", "RequestOutput", "SamplingParams", "build_engine"]


def __getattr__(name):
    if name == "LLM":
        from redknot.engine.llm import LLM
        return LLM
    if name == "build_engine":
        from redknot.engine.factory import build_engine
        return build_engine
    raise AttributeError(f"module 'redknot.engine' has no attribute {name!r}")
