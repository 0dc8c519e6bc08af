"""Decode-time state accounting for V4 (pure Python: never imports torch)."""
from redknot.cache.block_manager import CacheLeakError, StateCacheManager
from redknot.cache.spec import CachePlan, CacheSpec, cdiv, plan_cache

__all__ = ["CacheLeakError", "CachePlan", "CacheSpec", "StateCacheManager", "cdiv", "plan_cache"]
