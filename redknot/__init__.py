"""RedKnot: a long-context inference engine and benchmark harness for DeepSeek-V4."""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):
    # The engine pulls in torch; keep `import redknot` (and config composition) light.
    if name in ("LLM", "SamplingParams"):
        from redknot import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'redknot' has no attribute {name!r}")
