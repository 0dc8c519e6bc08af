"""DeepSeek-V4 (V4-Flash) in PyTorch: config, model math, state, checkpoint I/O, tiny model.

The engine reaches it through :data:`redknot.models.deepseek_v4.family.FAMILY` (registered as
``deepseek_v4`` in :mod:`redknot.models.registry`).

Names are resolved lazily so that torch-free users (the family's state layout and
config parser, :class:`StateLayout` and :class:`V4Config`) never import torch.
"""
from __future__ import annotations

from redknot._lazy import lazy_getattr

_EXPORTS = {
    "V4Config": "redknot.models.deepseek_v4.config",
    "StateLayout": "redknot.models.deepseek_v4.state_layout",
    "load_tokenizer": "redknot.models.deepseek_v4.tokenizer",
    "V4Tokenizer": "redknot.models.deepseek_v4.tokenizer",
    "V4State": "redknot.models.deepseek_v4.state",
    "DeepseekV4": "redknot.models.deepseek_v4.model",
    "SingleSequence": "redknot.models.deepseek_v4.single",
    "build_model": "redknot.models.deepseek_v4.build",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
