"""Correctness checks of the Triton backend against the registry's reference ops.

Shared by the CPU tests (Triton interpreter, toy dimensions), the GPU tests and
``benchmarks/kernels_v4.py`` (real V4 dimensions): each check draws fresh random inputs
for one op over shapes that hit its edge cases, poisons the kernel's output buffers,
and returns :class:`CheckResult` rows (relative error against a tolerance stated per dtype).
"""
from redknot.kernels.triton.checks.common import REAL, TOY, CheckResult, Dims
from redknot.kernels.triton.checks.attention import check_sparse_attention
from redknot.kernels.triton.checks.indexer import check_indexer_topk
from redknot.kernels.triton.checks.dense import check_linear, check_mhc, check_moe, check_norms

ALL_CHECKS = {
    "sparse_attention": check_sparse_attention,
    "indexer_topk": check_indexer_topk,
    "moe": check_moe,
    "linear": check_linear,
    "rms_norm+rope": check_norms,
    "mhc": check_mhc,
}

__all__ = ["ALL_CHECKS", "CheckResult", "Dims", "REAL", "TOY", "check_indexer_topk", "check_linear", "check_mhc",
           "check_moe", "check_norms", "check_sparse_attention"]
