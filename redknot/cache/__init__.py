"""Decode-time state accounting: slots and paged blocks of a model family's state.

Pure Python: never imports torch.
"""
from redknot.cache.block_manager import CacheLeakError, StateCacheManager
from redknot.cache.spec import CachePlan, CacheSpec, cdiv, plan_cache

__all__ = ["CacheLeakError", "CachePlan", "CacheSpec", "StateCacheManager", "cdiv", "plan_cache"]
