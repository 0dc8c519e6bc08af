"""Two-level V4.1 indexer over FP4 index keys (68-byte rows: packed e2m1 + E8M0 per 32), §3.5(d).

``I[t, s] = Σ_h w[t, h] · relu(q[t, h] · k[s])`` is computed by Triton kernels that decode key bytes
in registers (``BLOCK_T`` tokens share each key block: one tensor-core dot of ``[BLOCK_T·Hi, Di] x
[Di, BLOCK_N]``). Uses:

* ``indexer_topk_mx`` without candidates: every visible entry competes (index sources 2/8/14/20). With
  a power-of-two ``topk`` the selection streams: no score matrix is written. Each token keeps a
  thresholded candidate buffer of packed (score, id) keys, cut back to ``topk`` by a bitonic top-k
  when it fills (the V4 indexer's scheme, ``triton/indexer.py``, whose packing, compaction and
  split merge it reuses); ties go to the lower entry id, the model's rule. Few tokens (decode) split
  their entries over several programs and a second kernel merges the lists.
* ``indexer_topk_mx`` with candidate blocks: only the ``NB·bs`` entries of the token's candidate blocks
  are scored, so layers 24/28/32/36 never score the whole cache: streamed through the same thresholded
  buffer over each token's candidate list (one token per program, no score matrix; the default), or
  scored in a gathered launch into a chunk of scores selected by ``torch.topk``.
* ``indexer_candidates_mx``: the kernel reduces each block of ``bs`` entries to its max in registers and
  writes only block scores (``N/bs`` per token); the newest visible block is pinned, top blocks kept.
* ``indexer_source_mx`` (layer 20): one streamed pass gives its top-k and writes the max score of every
  candidate block as it goes (``[T, N/bs]`` fp32, token-chunked), so the whole cache is scored once per
  chunk, not twice; while no row sees more than ``num_blocks`` blocks (16,384 entries on V4.1-Flash) the
  candidates are every held block and nothing is written. With a ``topk`` that is not a power of two,
  one scoring pass into a chunk of scores gives both.

Token chunks bound every score scratch to ``max_scratch_bytes``. The Triton kernels are in
``indexer_kernels_mx``; this module sizes, tunes and launches them.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Dict, Hashable, Optional

import torch

from redknot.kernels.triton._common import ConfigTuner, cdiv, next_pow2, sm_count
from redknot.kernels.triton.indexer import _indexer_merge
from redknot.kernels.triton.indexer_kernels_mx import _expand_keys, _index_scores, _index_stream, _index_stream_x
from redknot.kernels.triton.radix_select import RadixSelectConfig, radix_topk

MAX_SCRATCH_BYTES = 1 << 30
log = logging.getLogger(__name__)



@dataclass(frozen=True)
class StreamConfig:
    block_t: int = 2     # tokens sharing each decoded key block (1 when a token's entries are split)
    block_n: int = 64    # entries per step of the stream
    num_warps: int = 4
    num_splits: int = 0  # 0: chosen from the problem size (enough programs for the device)
    decode: str = "registers"   # "scaled": the key bytes through tl.dot_scaled (see _index_stream);
    #                             "expanded": keys decoded once per call to bf16, then _index_stream_x
    prefetch: bool = False      # the next block's key bytes loaded before this block's work (not with CAND)
    num_stages: int = 0         # "expanded": key tiles in flight in the software-pipelined loop (0: 3)
    head_sum: str = ""          # "expanded" with bf16 scores: "mma" sums the heads' terms by a second MMA
    cut: str = ""               # "expanded": "select" cuts the buffer by counting (``_kth_largest``), not by sorting
    max_regs: int = 0           # "expanded": registers a thread at most (ptxas ``.maxnreg``; 0: the compiler's choice)
    late_keys: bool = False     # "expanded" without block maxima: keys packed only in blocks a score may enter

    def __repr__(self) -> str:
        """The stored tuning choices name configurations by this text: without ``prefetch`` / ``num_stages``
        it stays the text of the shapes that predate them."""
        text = (f"StreamConfig(block_t={self.block_t}, block_n={self.block_n}, num_warps={self.num_warps}, "
                f"num_splits={self.num_splits}, decode={self.decode!r}")
        text += ", prefetch=True" if self.prefetch else ""
        text += f", num_stages={self.num_stages}" if self.num_stages else ""
        text += f", head_sum={self.head_sum!r}" if self.head_sum else ""
        text += f", cut={self.cut!r}" if self.cut else ""
        text += f", max_regs={self.max_regs}" if self.max_regs else ""
        return text + (", late_keys=True)" if self.late_keys else ")")


# More tokens per program decode each key block for more query rows, and the ``scaled`` decode makes
# that decode cheap (the decode of FP4 key bytes, not the MMA, bounds the stream at two tokens: 57 TFLOP/s
# at 1M entries against 117 for the score pass tuned up to eight); the first entry is the untuned default
# (CPU, interpreter, graph capture). Few entries: each one is a compile in the first chunk. Tokens per
# program barely moved the prefill stream (8192 tokens at 40-73K entries: 40-65 ms for every shape), which
# points at a step's latency rather than its work: ptxas gives every shape 230-255 registers a thread (one
# or two programs an SM) and the loop's loads are not software-pipelined. The 128-entry shape halves the
# steps per token; the ``prefetch`` shapes load the next block's key bytes before a step's own work.
# The ``expanded`` shapes decode every key once per call (bf16, 256 B an entry, one pass over the cache)
# and stream plain bf16 tiles through a software-pipelined loop with the entries on the MMA's M axis:
# no decode in the loop, fewer live registers, the load latency hidden by the stages in flight (not
# measured on the H200 yet; the tuner keeps them only where they measure faster). The tuner's stored
# name carries a version so that a tuning store filled before these shapes existed times them again.
# The 128-entry expanded shape (two warpgroups, one program an SM by shared memory) halves the steps per
# tile. The ``cut="select"`` shapes cut the buffer by counting (``_kth_largest``: 64 row sums against a bitonic
# sort of the 2048-key buffer, whose unrolled code made the kernel 48K SASS lines against 3.6K; a token is cut
# about five times in a long stream, and once more at its end). The ``max_regs=168`` shape with two stages fits
# three programs an SM (70 KB of shared memory, 168 registers and 72 B of spill a thread for sm_90a) against
# two. H100, 8192 queries at 65536 / 262144 entries (2026-12-06): 4x64 MMA head sum 22.1 / 68.2 ms, with the
# counting cut 17.6 / 59.9, and at 168 registers 15.7 / 53.9 (321 TFLOP/s); 4x128 25.4 / 78.9. A stored class
# that has not timed a candidate is timed again (``tuning_cache``), so these are measured where they are new.
STREAM_TUNER = ConfigTuner("indexer_stream_mx.2", [
    StreamConfig(2, 64, 4), StreamConfig(4, 64, 8, decode="scaled"), StreamConfig(8, 64, 8, decode="scaled"),
    StreamConfig(8, 64, 8), StreamConfig(2, 128, 8), StreamConfig(2, 64, 4, prefetch=True),
    StreamConfig(4, 64, 8, decode="scaled", prefetch=True),
    StreamConfig(4, 64, 4, decode="expanded", num_stages=3), StreamConfig(2, 64, 4, decode="expanded", num_stages=3),
    StreamConfig(8, 64, 8, decode="expanded", num_stages=3),
    StreamConfig(4, 64, 4, decode="expanded", num_stages=3, head_sum="mma"),
    StreamConfig(2, 64, 4, decode="expanded", num_stages=3, head_sum="mma"),
    StreamConfig(4, 128, 8, decode="expanded", num_stages=3, head_sum="mma"),
    StreamConfig(4, 64, 4, decode="expanded", num_stages=3, head_sum="mma", cut="select"),
    StreamConfig(4, 64, 4, decode="expanded", num_stages=2, head_sum="mma", cut="select", max_regs=168),
    # keys, keep masks and their store layouts only in blocks where a score reaches a bar's high word
    # (``_stream_x_rows``' LATE_KEYS; the same keys kept; with block maxima it is the shape above)
    StreamConfig(4, 64, 4, decode="expanded", num_stages=2, head_sum="mma", cut="select", max_regs=168,
                 late_keys=True),
])
# Tuning classes: token counts from 1024 up share one (prefill chunks and their sub-chunks), entry counts
# above 65536 share one; each class is measured at its first, smallest problem (the per-block work is
# alike), so a long prefill never times candidates at a million entries.
STREAM_TUNE_TOKENS, STREAM_TUNE_ENTRIES = 1 << 10, 1 << 16


SCALED_CHECKED: Dict[Hashable, bool] = {}   # tuning class -> the scaled decode selected what registers did


def _check_scaled(key, config: StreamConfig, q, weights, index_keys, visible, topk, bf16_scores, block_scores,
                  block_size, cand_blocks) -> StreamConfig:
    """First use of a ``scaled`` choice in a tuning class: its selections (and block maxima) must equal the
    fastest register-decode shape's on the same inputs, bit for bit (both decodes are exact); otherwise
    the class falls back to that shape for good (a lowering of ``tl.dot_scaled`` that disagrees)."""
    regs = [c for c, _ in sorted(STREAM_TUNER.timings.get(key, []), key=lambda r: r[1]) if c.decode == "registers"]
    fallback = regs[0] if regs else STREAM_TUNER.candidates[0]
    outs = []
    for cfg in (config, fallback):
        bm = None if block_scores is None else torch.full_like(block_scores, float("-inf"))
        outs.append((stream_topk(q, weights, index_keys, visible, topk, bf16_scores, cfg, bm, block_size,
                                 cand_blocks), bm))
    (a, bma), (b, bmb) = outs
    same = torch.equal(a, b) and (bma is None or torch.equal(bma, bmb))
    SCALED_CHECKED[key] = same
    if not same:
        log.warning("indexer_stream_mx %s: the scaled key decode selected differently from the register decode; "
                    "using %s", key, fallback)
        STREAM_TUNER.choices[key] = fallback
        return fallback
    return config


EXPAND_BLOCK = 64   # entries per program of the key expansion


def _native_bf16() -> bool:
    """Kernels compiled for a device (not run by Triton's CPU interpreter, whose bf16 arithmetic is not IEEE)."""
    return os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def expand_keys(index_keys: torch.Tensor, dim: int) -> torch.Tensor:
    """Index-key rows uint8 [N, dim/2 + dim/32] -> their exact values, bf16 [N, dim] (one pass)."""
    n = index_keys.shape[0]
    out = torch.empty(n, dim, dtype=torch.bfloat16, device=index_keys.device)
    if n:
        _expand_keys[(cdiv(n, EXPAND_BLOCK),)](index_keys, out, n, index_keys.stride(0), DI=dim,
                                              BLOCK=EXPAND_BLOCK, num_warps=4)
    return out


def stream_topk(q: torch.Tensor, weights: torch.Tensor, index_keys: torch.Tensor, visible: torch.Tensor, topk: int,
                bf16_scores: bool = False, config: Optional[StreamConfig] = None,
                block_scores: Optional[torch.Tensor] = None, block_size: int = 8,
                cand_blocks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Top-``topk`` (a power of two) entry ids per token, ascending then -1, without a score matrix.
    Equal scores go to the lower id. q [T, Hi, Di], weights [T, Hi], index_keys uint8 [N, bytes],
    visible [T] int32 (contiguous). ``block_scores`` (fp32 [T, NB], filled with -inf by the caller):
    the same pass also writes the max score of every ``block_size``-entry block a token sees.
    ``cand_blocks`` (int32 [T, NB], distinct block ids per row, -1 pads): only the entries of those blocks
    compete, one token per program (no score matrix either). ``config=None``: the launch shape is measured
    per problem class on a GPU."""
    T, HI, DI = q.shape
    if topk & (topk - 1):
        raise ValueError(f"stream_topk: topk={topk} must be a power of two")
    out = torch.empty(T, topk, dtype=torch.int32, device=q.device)
    if T == 0:
        return out
    n = index_keys.shape[0]
    sms = sm_count(q)
    if config is None:
        width = n if cand_blocks is None else cand_blocks.shape[1] * block_size
        key = (min(next_pow2(T), STREAM_TUNE_TOKENS), T >= 2 * sms, HI, DI, topk,
               min(next_pow2(max(width, 1)), STREAM_TUNE_ENTRIES), bf16_scores,
               block_scores is not None, cand_blocks is not None)
        config = STREAM_TUNER.pick(key, lambda cfg: stream_topk(q, weights, index_keys, visible, topk, bf16_scores,
                                                               cfg, block_scores, block_size, cand_blocks), q.device)
        if config.decode == "scaled" and key not in SCALED_CHECKED:
            config = _check_scaled(key, config, q, weights, index_keys, visible, topk, bf16_scores, block_scores,
                                   block_size, cand_blocks)
    if config.decode not in ("registers", "scaled", "expanded"):
        raise ValueError(f"stream_topk: decode={config.decode!r} must be 'registers', 'scaled' or 'expanded'")
    if block_scores is not None and cand_blocks is not None:
        raise ValueError("stream_topk: block_scores and cand_blocks are exclusive")
    if block_scores is not None and config.block_n % block_size:
        raise ValueError(f"stream_topk: block_size={block_size} must divide the stream's block_n={config.block_n}")
    width = n if cand_blocks is None else cand_blocks.shape[1] * block_size
    nsplit = config.num_splits or (1 if T >= 2 * sms else max(1, min(cdiv(2 * sms, T),
                                                                     cdiv(width, 8 * config.block_n), 32)))
    bt = 1 if nsplit > 1 or cand_blocks is not None else config.block_t
    cap = max(2 * topk, next_pow2(topk + config.block_n))
    if config.decode == "expanded":   # room for segments of several blocks between buffer cuts
        cap = max(4 * topk, next_pow2(topk + 4 * config.block_n))
    buf = torch.empty(T * nsplit, cap, dtype=torch.int64, device=q.device)
    cand = torch.empty(T * nsplit, topk, dtype=torch.int64, device=q.device)
    bm = block_scores if block_scores is not None else visible
    cb = cand_blocks if cand_blocks is not None else visible
    nb = bm.shape[-1] if block_scores is not None else (cb.shape[-1] if cand_blocks is not None else 0)
    if config.decode == "expanded":
        _index_stream_x[(cdiv(T, bt), nsplit)](
            q, weights, expand_keys(index_keys, DI), visible, buf, cand, bm, cb, T, nsplit, nb, n,
            q.stride(0), q.stride(1), weights.stride(0), bm.stride(0), cb.stride(0),
            HI=HI, HP=max(next_pow2(HI), cdiv(16, bt)), DI=DI, K=topk, CAP=cap, BLOCK_T=bt,
            BLOCK_N=config.block_n, BF16=bf16_scores, BLOCKMAX=block_scores is not None, BS=block_size,
            CAND=cand_blocks is not None, STAGES=config.num_stages or 3, BF16_MUL=_native_bf16(),
            HSUM_MMA=config.head_sum == "mma" and bf16_scores and bt <= 16, CUT_SELECT=config.cut == "select",
            LATE_KEYS=config.late_keys and block_scores is None,
            num_warps=config.num_warps, **({"maxnreg": config.max_regs} if config.max_regs else {}))
    else:
        _index_stream[(cdiv(T, bt), nsplit)](
            q, weights, index_keys, visible, buf, cand, bm, cb, T, nsplit, nb, n,
            q.stride(0), q.stride(1), weights.stride(0), index_keys.stride(0), bm.stride(0), cb.stride(0),
            HI=HI, HP=max(next_pow2(HI), cdiv(16, bt)), DI=DI, K=topk, CAP=cap, BLOCK_T=bt,
            BLOCK_N=config.block_n, BF16=bf16_scores, BLOCKMAX=block_scores is not None, BS=block_size,
            CAND=cand_blocks is not None, SCALED=config.decode == "scaled",
            PREFETCH=config.prefetch and cand_blocks is None, num_warps=config.num_warps)
    # one split: its list goes straight to ids (the expanded stream leaves rows of K keys or fewer unsorted; the sort
    # by id below makes the order moot)
    _indexer_merge[(T,)](cand, buf, out, out.stride(0), nsplit, K=topk, CAP=cap, ONE_SPLIT=nsplit == 1,
                         SORT=False, num_warps=4)
    big = torch.iinfo(torch.int32).max
    ids = torch.where(out < 0, big, out).sort(1).values       # score order -> ascending ids, -1 last
    return torch.where(ids == big, -1, ids)


@dataclass(frozen=True)
class IndexMxConfig:
    block_t: int = 2    # tokens sharing each decoded key block (1 with candidates: entries differ per token)
    block_n: int = 128  # entries per program
    num_warps: int = 4


INDEX_MX_TUNER = ConfigTuner("indexer_mx", [
    IndexMxConfig(2, 128, 4), IndexMxConfig(4, 128, 8), IndexMxConfig(8, 64, 8), IndexMxConfig(4, 64, 4),
    IndexMxConfig(8, 128, 8), IndexMxConfig(1, 128, 4),
])


def _scores(q, weights, keys, visible, ncols, cand=None, bs=8, blockmax=False, bf16=False,
            config: Optional[IndexMxConfig] = None) -> torch.Tensor:
    T, HI, DI = q.shape
    n = keys.shape[0]
    out = torch.empty(T, ncols, dtype=torch.float32, device=q.device)
    if T == 0 or ncols == 0:
        return out.fill_(float("-inf"))
    if config is None:
        key = (min(next_pow2(T), 1024), HI, DI, min(next_pow2(n), STREAM_TUNE_ENTRIES), cand is not None, blockmax,
               bf16)   # entry counts above 65536 share a class, as in the stream's
        config = INDEX_MX_TUNER.pick(key, lambda cfg: _scores(q, weights, keys, visible, ncols, cand, bs, blockmax,
                                                              bf16, cfg), q.device)
    block_n = max(config.block_n, bs)
    bt = 1 if cand is not None else config.block_t
    width = n if cand is None else ncols
    _index_scores[(cdiv(T, bt), cdiv(width, block_n))](
        q, weights, keys, visible, cand if cand is not None else visible, out, T, n, ncols,
        q.stride(0), q.stride(1), weights.stride(0), keys.stride(0), cand.stride(0) if cand is not None else 0,
        out.stride(0), HI=HI, DI=DI, BLOCK_T=bt, BLOCK_N=block_n, CAND=cand is not None, BS=bs,
        BLOCKMAX=blockmax, BF16=bf16, num_warps=config.num_warps)
    return out


SELECT_BYTES = 16   # per score of a chunk: the fp32 score, its packed int64 key, the int32 bits


def _select(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Top-k ids per row of scores [T, N] (-inf: not selectable): valid ids ascending, then -1; equal
    scores go to the lower id (the model's rule; ``torch.topk`` leaves ties open). The top-k runs on
    keys packing the score's order-preserving bits over the inverted id, so every key is unique."""
    k = min(topk, scores.shape[1])
    t, n = scores.shape
    if n == 0 or t == 0:
        return torch.full((t, topk), -1, dtype=torch.int32, device=scores.device)
    bits = torch.where(scores == 0, 0.0, scores).contiguous().view(torch.int32)   # -0.0 ties with 0.0
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long() << 32
    key |= 2147483647 - torch.arange(n, device=scores.device)
    ids = torch.topk(key, k, dim=-1).indices
    big = torch.iinfo(torch.int32).max
    ids = torch.where(scores.gather(1, ids) > float("-inf"), ids, big).sort(dim=-1).values
    ids = torch.where(ids == big, -1, ids).to(torch.int32)
    if k < topk:
        ids = torch.cat([ids, ids.new_full((t, topk - k), -1)], 1)
    return ids


CHUNK_ALIGN = 16   # token chunks are multiples of this: Triton specialises integer arguments divisible by 16


def _chunks(t: int, per_token_bytes: int, limit: int):
    """Token ranges of at most ``limit // per_token_bytes`` tokens (one at least) covering ``t``, of nearly
    equal sizes that are multiples of ``CHUNK_ALIGN`` (the last also takes ``t``'s own remainder): a long
    prefill's chunk splits into pieces like its first, whole chunks do, so they keep the kernels' tuning
    class (token counts above 512 share one) and compiled specialisation (a count divisible by 16), and a
    chunk's start never triggers a compile or a tuning pass that its warm-up did not see. Plain steps of
    ``limit // per_token_bytes`` tokens leave a remainder of any size (2, 126, 249, 482 tokens of the
    candidate source's chunks at 262K-778K entries in a 1M-token V4.1 prefill), each a new class."""
    step = max(1, min(t, limit // max(per_token_bytes, 1)))
    if step >= t:
        return [(0, t)]
    if step < CHUNK_ALIGN:
        return [(t0, min(t, t0 + step)) for t0 in range(0, t, step)]
    step -= step % CHUNK_ALIGN
    pieces = cdiv(t, step)
    units, tail = divmod(t, CHUNK_ALIGN)
    base, extra = divmod(units, pieces)   # base + 1 <= step // CHUNK_ALIGN whenever extra > 0
    out, t0 = [], 0
    for i in range(pieces):
        size = (base + (i < extra)) * CHUNK_ALIGN + (tail if i == pieces - 1 else 0)
        if size:
            out.append((t0, t0 + size))
            t0 += size
    return out


# How the layers that re-index inside candidate blocks select: streamed over each token's candidate list
# (the default: the same scoring work without the [T, NB·bs] score matrix, its int64 keys and a
# torch.topk over them), or the scores written in token chunks and selected by torch.topk ("scores").
CAND_PATH = "stream"


def _cand_topk(q, weights, index_keys, visible, topk, cand, block_size, bf16_scores, max_scratch_bytes,
               path: str) -> torch.Tensor:
    if path == "stream":
        return stream_topk(q, weights, index_keys, visible, topk, bf16_scores, block_size=block_size,
                           cand_blocks=cand)
    out = torch.empty(q.shape[0], topk, dtype=torch.int32, device=q.device)
    ncols = cand.shape[1] * block_size
    for t0, t1 in _chunks(q.shape[0], (SELECT_BYTES + 4) * ncols, max_scratch_bytes):
        c = cand[t0:t1, :, None]
        ids = torch.where(c >= 0, c * block_size + torch.arange(block_size, device=c.device, dtype=c.dtype), -1)
        ids = ids.flatten(1).contiguous()  # [t, NB*bs] entry ids of the candidate blocks (-1: none)
        s = _scores(q[t0:t1], weights[t0:t1], index_keys, visible[t0:t1], ncols, cand=ids, bs=block_size,
                    bf16=bf16_scores)
        pos = _select(s, topk)  # positions in the candidate list
        ent = ids.gather(1, pos.clamp(min=0).long()).long()
        ent = torch.where(pos >= 0, ent, torch.full_like(ent, torch.iinfo(torch.int32).max))
        ent = torch.sort(ent, dim=-1).values
        out[t0:t1] = torch.where(ent == torch.iinfo(torch.int32).max, -1, ent).to(torch.int32)
    return out


def indexer_topk_mx(q: torch.Tensor, weights: torch.Tensor, index_keys: torch.Tensor, visible: torch.Tensor,
                    topk: int, cand_blocks: Optional[torch.Tensor] = None, block_size: int = 8,
                    bf16_scores: bool = False, max_scratch_bytes: int = MAX_SCRATCH_BYTES,
                    cand_path: Optional[str] = None) -> torch.Tensor:
    """See ``ref_v41.indexer_topk_mx`` (a row's candidate blocks are distinct, as the model publishes them).
    ``cand_path`` ("stream" / "scores"; None: ``CAND_PATH``): how rows with candidate blocks select."""
    q, weights = q.contiguous(), weights.contiguous()
    visible = visible.to(torch.int32).contiguous()
    n = index_keys.shape[0]
    out = torch.empty(q.shape[0], topk, dtype=torch.int32, device=q.device)
    if cand_blocks is None and not topk & (topk - 1):
        return stream_topk(q, weights, index_keys, visible, topk, bf16_scores)
    if cand_blocks is None:
        for t0, t1 in _chunks(q.shape[0], SELECT_BYTES * n, max_scratch_bytes):
            s = _scores(q[t0:t1], weights[t0:t1], index_keys, visible[t0:t1], n, bf16=bf16_scores)
            out[t0:t1] = _select(s, topk)
        return out
    cand = cand_blocks.to(torch.int32).contiguous()
    args = (q, weights, index_keys, visible, topk, cand, block_size, bf16_scores, max_scratch_bytes)
    if cand_path not in (None, "stream", "scores"):
        raise ValueError(f"indexer_topk_mx: cand_path={cand_path!r} must be 'stream', 'scores' or None")
    if topk & (topk - 1):
        cand_path = "scores"   # the stream's buffer cut needs a power of two
    return _cand_topk(*args, cand_path or CAND_PATH)


# How the candidate source and ``indexer_candidates_mx`` keep a row's best ``num_blocks`` of its [T, N/bs] block
# maxima: "radix" (``radix_select.radix_topk``: one Triton selection a row by an exact threshold, ids written
# ascending as it goes; two launches past BLOCK_SELECT_SEG blocks a row) or "torch" (``_select``: int64 keys
# packing score and inverted id, ``torch.topk`` over them, then a sort of the kept ids). Same rule, same ids.
BLOCK_SELECT = "radix"
BLOCK_SELECTS = ("radix", "torch")
# The radix form's launches: segments of BLOCK_SELECT_SEG blocks, each re-read per pass (no segment kept resident),
# so every row wider than that runs the same two launch shapes at any context, and every narrower row (the source
# selects only past 2048 blocks) the same one: a 1M-token prefill compiles nothing its 128K warm-up did not. The
# rows are a chunk's tokens, thousands, so the launch is not tuned (the radix tuner's candidates differ for few rows).
BLOCK_SELECT_SEG = 4096
BLOCK_SELECT_CONFIG = RadixSelectConfig(resident_max=0)


def _select_scratch(nb: int) -> int:
    """Bytes of scratch a row of ``nb`` block maxima needs in ``_pin_and_select``: none past the output for the
    radix form, the int64 keys and bits of ``_select`` for the torch form."""
    return 0 if BLOCK_SELECT == "radix" else SELECT_BYTES * nb


def _pin_and_select(bscore: torch.Tensor, visible: torch.Tensor, num_blocks: int, block_size: int,
                    how: Optional[str] = None) -> torch.Tensor:
    """Pin each row's newest visible block to +inf (in place), then keep the best ``num_blocks`` (int32 ids
    ascending, then -1). ``how``: "radix" / "torch" (None: ``BLOCK_SELECT``)."""
    how = how or BLOCK_SELECT
    if how not in BLOCK_SELECTS:
        raise ValueError(f"block selection: how={how!r} must be one of {BLOCK_SELECTS}")
    vis = visible.long()
    newest = ((vis - 1) // block_size).clamp(min=0, max=max(bscore.shape[1] - 1, 0))
    pin = torch.where(vis > 0, torch.full_like(vis, 1).float() * float("inf"),
                      bscore.gather(1, newest[:, None]).squeeze(1))
    bscore.scatter_(1, newest[:, None], pin[:, None])
    if how == "radix":
        return radix_topk(bscore, num_blocks, seg=BLOCK_SELECT_SEG, config=BLOCK_SELECT_CONFIG).to(torch.int32)
    return _select(bscore, num_blocks)


def held_blocks(visible: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    """Candidate blocks when a row sees at most ``num_blocks`` blocks: every block holding a visible
    entry (each has a finite max, the newest is pinned), ascending, then -1 -> int32 [T, num_blocks]."""
    held = (visible.long() + block_size - 1) // block_size
    b = torch.arange(num_blocks, device=visible.device)[None]
    return torch.where(b < held[:, None], b, -1).to(torch.int32)


def indexer_source_mx(q: torch.Tensor, weights: torch.Tensor, index_keys: torch.Tensor, visible: torch.Tensor,
                      topk: int, num_blocks: int = 2048, block_size: int = 8, bf16_scores: bool = False,
                      max_scratch_bytes: int = MAX_SCRATCH_BYTES):
    """See ``ref_v41.indexer_source_mx``. With a power-of-two ``topk``: one streamed pass gives the top-k
    and, when some row sees more than ``num_blocks`` blocks, the block maxima (token chunks bound the
    [tokens, blocks] fp32 block scores to ``max_scratch_bytes``); below that the candidates are every
    held block without scoring. Otherwise one scoring pass into a chunk of scores gives both."""
    q, weights = q.contiguous(), weights.contiguous()
    visible = visible.to(torch.int32).contiguous()
    n = index_keys.shape[0]
    nb = cdiv(n, block_size)
    if not topk & (topk - 1) and all(not c.block_n % block_size for c in STREAM_TUNER.candidates):
        if nb <= num_blocks:
            return (stream_topk(q, weights, index_keys, visible, topk, bf16_scores),
                    held_blocks(visible, num_blocks, block_size))
        t = q.shape[0]
        idx = torch.empty(t, topk, dtype=torch.int32, device=q.device)
        blocks = torch.empty(t, num_blocks, dtype=torch.int32, device=q.device)
        select_bytes = _select_scratch(nb)
        for t0, t1 in _chunks(t, 4 * nb, max_scratch_bytes):
            bscore = torch.full((t1 - t0, nb), float("-inf"), dtype=torch.float32, device=q.device)
            idx[t0:t1] = stream_topk(q[t0:t1], weights[t0:t1], index_keys, visible[t0:t1], topk, bf16_scores,
                                     block_scores=bscore, block_size=block_size)
            for s0, s1 in _chunks(t1 - t0, select_bytes, max_scratch_bytes):
                blocks[t0 + s0:t0 + s1] = _pin_and_select(bscore[s0:s1], visible[t0 + s0:t0 + s1], num_blocks,
                                                          block_size)
            del bscore
        return idx, blocks
    idx = torch.empty(q.shape[0], topk, dtype=torch.int32, device=q.device)
    blocks = torch.empty(q.shape[0], num_blocks, dtype=torch.int32, device=q.device)
    for t0, t1 in _chunks(q.shape[0], SELECT_BYTES * n, max_scratch_bytes):
        s = _scores(q[t0:t1], weights[t0:t1], index_keys, visible[t0:t1], n, bf16=bf16_scores)
        idx[t0:t1] = _select(s, topk)
        padded = torch.nn.functional.pad(s, (0, nb * block_size - n), value=float("-inf"))
        blocks[t0:t1] = _pin_and_select(padded.view(t1 - t0, nb, block_size).amax(-1), visible[t0:t1], num_blocks,
                                        block_size)
    return idx, blocks


def indexer_candidates_mx(q: torch.Tensor, weights: torch.Tensor, index_keys: torch.Tensor,
                          visible: torch.Tensor, num_blocks: int = 2048, block_size: int = 8,
                          bf16_scores: bool = False, max_scratch_bytes: int = MAX_SCRATCH_BYTES) -> torch.Tensor:
    """See ``ref_v41.indexer_candidates_mx``."""
    q, weights = q.contiguous(), weights.contiguous()
    visible = visible.to(torch.int32).contiguous()
    n = index_keys.shape[0]
    nb = cdiv(n, block_size)
    out = torch.empty(q.shape[0], num_blocks, dtype=torch.int32, device=q.device)
    if 128 % block_size:
        raise ValueError(f"indexer_candidates_mx: block_size={block_size} must divide 128")
    for t0, t1 in _chunks(q.shape[0], SELECT_BYTES * nb, max_scratch_bytes):
        s = _scores(q[t0:t1], weights[t0:t1], index_keys, visible[t0:t1], nb, bs=block_size, blockmax=True,
                    bf16=bf16_scores)
        out[t0:t1] = _pin_and_select(s, visible[t0:t1], num_blocks, block_size)
    return out
