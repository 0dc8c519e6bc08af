"""The slice sum of a split-K weight stream inside the stream launch (``FUSE`` of ``splitk_mx._splitk_mm`` and
``stream_fp8._fp8_stream``), instead of a second launch (``splitk_mx.reduce_rows``).

Every program of a (row tile, column tile) stores its K slice's fp32 partial as before; then a barrier and one
acquire-release increment of the tile's counter (the partials released at GPU scope). The program that takes the
count to ``S - 1`` (every slice of the tile has stored its partial) zeroes the counter for the next launch and adds
the tile's partials in slice order 0..S-1 from L2, cast to the output dtype: the arithmetic of ``reduce_rows``
(``0 + p0 + p1 + ...`` in fp32), so the output has its bits whichever program comes last (no atomics touch a
value; the result is deterministic and, with the slice count a function of the weight shape, batch-invariant).
With one slice (``FUSE`` 2) the program stores ``0 + acc`` cast: no partial, no counter.

At decode batches the second launch costs a graph node (~4-6 us on an H100 replay) and a re-read of the partials
from HBM / L2 per linear; the V4.1 step at batch 32 / 128 runs 39 such dense linears. Not measured on the H200.
"""
from __future__ import annotations

import triton
import triton.language as tl

from redknot.kernels.triton._common import DeviceCounters

# FUSE values of the streams: 0 partials only (the caller runs ``reduce_rows``), 1 partials and the last slice's
# program sums them into ``out``, 2 one slice: ``out`` directly.
PARTIALS, LAST_SUMS, DIRECT = 0, 1, 2


@triton.jit
def _slice_sum_tail(acc, p_ptr, out_ptr, cnt_ptr, tile, rows, cols, omask, stride_ps, stride_pm, stride_om,
                    FUSE: tl.constexpr):
    """After a program's partial ``acc`` [BM, BN] (rows x cols) of slice ``program_id(2)``: ``FUSE`` 2 stores
    ``0 + acc`` into ``out``; ``FUSE`` 1 expects the partial stored at ``p`` and runs the module's last-program
    slice sum for tile ``tile``."""
    r64 = rows.to(tl.int64)
    if FUSE == 2:
        y = tl.zeros(acc.shape, tl.float32) + acc
        tl.store(out_ptr + r64[:, None] * stride_om + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        S = tl.num_programs(2)
        tl.debug_barrier()   # every thread's partial stored before the release
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == S - 1:
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")   # zero again for the next launch
            off = r64[:, None] * stride_pm + cols[None, :]
            y = tl.zeros(acc.shape, tl.float32)
            for s in range(S):   # slice order 0..S-1, as reduce_rows
                y += tl.load(p_ptr + s * stride_ps + off, mask=omask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + r64[:, None] * stride_om + cols[None, :], y.to(out_ptr.dtype.element_ty),
                     mask=omask)


# The tile counters of the launches with the slice sum inside (see DeviceCounters: two streams running fused
# launches at once would share them); 4096 cover every V4.1 decode launch (at most ~1024 output tiles).
counters = DeviceCounters(4096)
_COUNTERS = counters.sets
