"""Where a V4.1 prefill chunk spends its time, and how a chunk's time grows with the context.

``region_shares`` times one call (a prefill chunk) by *region*: every registry op, and the PyTorch parts
of the engine path by function (mHC mixes / collapse / expand, norms, RoPE, the linears by weight, the
compressor, the indexer's and the window's index building, the grouped output, the router, the shared
expert, Engram's gather / projection / gate, the hashes). Each region is bracketed by CUDA events (wall
time on a CPU); a region's *self* time is its time less the regions called inside it, so the rows add
up to the chunk's wall time, the rest ("(between regions)": the embedding, Python between calls and
launch gaps outside every region) included. The regions are installed by wrapping the functions in the
model modules' namespaces for the duration of the call only.

``ChunkFit`` fits a prefill's per-chunk times to ``a + b * start`` (start: the chunk's first position):
everything but the indexer costs the same per chunk, and the indexer scores every visible entry, so a
chunk's time grows linearly with its start and the whole prefill quadratically. The fit predicts a
longer context's prefill from a shorter one (the benchmark's budget projection) and says which part
grows.

``cache_bytes`` reports the global cache bytes per token a prefill filled, against the cut's expected
value and scaled to V4.1-Flash's four kv sources (890 B/token expected).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

# (module, function name) pairs wrapped as regions; a wrapped name is looked up in that module's
# namespace at call time, so the model's own calls go through the wrapper.
MODEL_FUNCTIONS = (
    ("redknot.models.deepseek_v41.model", ("engram_forward", "hc_collapse", "collapse", "rms_norm", "moe_forward",
                                           "moe_post")),
    ("redknot.models.deepseek_v41.attention", ("linear", "plain_linear", "rms_norm", "apply_rope", "index_qdq",
                                               "attend_spans", "index_spans", "grouped_output")),
    ("redknot.models.deepseek_v41.moe", ("route", "swiglu_expert", "swiglu_act", "linear")),
    ("redknot.models.deepseek_v41.engram", ("table_rows", "linear", "engram_gate")),
    # the attention row epilogues (norms, RoPE, the indexer query's FP4 grid), fused or PyTorch
    ("redknot.models.deepseek_v41.fused_rows", ("norm", "norm_rope", "rope")),
)
METHODS = (("redknot.models.deepseek_v41.attention", "AttentionLayer", ("__call__", "_compress", "_index")),
           ("redknot.models.deepseek_v41.model", "DeepseekV41", ("_hashes",)),
           # the mHC sites (mixes + lagged collapse + norm; post mix): fused kernels or the PyTorch math
           ("redknot.models.deepseek_v41.tensor_step", "_SiteFused", ("pre", "post")),
           ("redknot.models.deepseek_v41.tensor_step", "_SiteTorch", ("pre", "post")))
SHORT = {"redknot.models.deepseek_v41.model": "model", "redknot.models.deepseek_v41.attention": "attention",
         "redknot.models.deepseek_v41.moe": "moe", "redknot.models.deepseek_v41.engram": "engram",
         "redknot.models.deepseek_v41.tensor_step": "mhc", "redknot.models.deepseek_v41.fused_rows": "rows"}
LINEARS = ("linear", "plain_linear")


class _Timer:
    """Nested regions: a stack of open regions; each closed region keeps (label, start, end, children)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.stack: List[list] = []
        self.closed: List[Tuple[str, object, object, list]] = []

    def _mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def wrap(self, label: str, fn, name_arg: Optional[int] = None):
        def call(*args, **kw):
            lab = label
            if name_arg is not None and len(args) > name_arg and isinstance(args[name_arg], str):
                lab = f"{label} {_weight_label(args[name_arg])}"
            frame = [lab, self._mark(), []]
            self.stack.append(frame)
            try:
                return fn(*args, **kw)
            finally:
                self.stack.pop()
                end = self._mark()
                self.closed.append((frame[0], frame[1], end, frame[2]))
                if self.stack:
                    self.stack[-1][2].append((frame[1], end))
        return call

    def elapsed_ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def self_times(self) -> Dict[str, List[float]]:
        """label -> [self ms, calls]."""
        out: Dict[str, List[float]] = {}
        for label, a, b, children in self.closed:
            ms = self.elapsed_ms(a, b) - sum(self.elapsed_ms(x, y) for x, y in children)
            row = out.setdefault(label, [0.0, 0])
            row[0] += ms
            row[1] += 1
        return out


def _weight_label(name: str) -> str:
    """'layers.3.attn.indexer.wq_b.weight' -> 'indexer.wq_b'; expert / shared weights keep their role."""
    parts = name.split(".")
    if parts[-1] == "weight":
        parts = parts[:-1]
    if len(parts) > 2 and parts[0] == "layers":
        parts = parts[3:] if parts[2] in ("attn", "ffn", "engram") else parts[2:]
    return ".".join(parts) or name


@contextmanager
def installed(timer: _Timer, ops=None, model=None):
    """Wrap the region functions (and the registry ops of ``ops``) while the block runs."""
    import importlib

    saved = []
    try:
        for mod_name, names in MODEL_FUNCTIONS:   # a name a module does not (or no longer) use is skipped
            mod = importlib.import_module(mod_name)
            for n in names:
                fn = getattr(mod, n, None)
                if fn is None:
                    continue
                saved.append((mod, n, fn))
                setattr(mod, n, timer.wrap(f"{SHORT[mod_name]}.{n}", fn, 2 if n in LINEARS else None))
        for mod_name, cls_name, names in METHODS:
            cls = getattr(importlib.import_module(mod_name), cls_name, None)
            for n in names:
                fn = None if cls is None else cls.__dict__.get(n)
                if fn is None:
                    continue
                saved.append((cls, n, fn))
                setattr(cls, n, timer.wrap(f"{SHORT[mod_name]}.{cls_name}.{n}", fn))
        if ops is not None:
            from redknot.models.deepseek_v41.kernel_ops import OPS

            for op in OPS:
                impl = getattr(ops, op)
                if impl is not None:
                    saved.append((ops, op, impl))
                    setattr(ops, op, timer.wrap(f"op {op}", impl))
        yield timer
    finally:
        for obj, n, fn in reversed(saved):
            setattr(obj, n, fn)


def region_shares(fn, device, ops=None) -> List[dict]:
    """Self time of one call of ``fn`` per region, largest first, then "(between regions)" and the
    step's wall time (see the module docstring). Shares are of the wall time."""
    cuda = device.type == "cuda"
    timer = _Timer(cuda)
    with installed(timer, ops):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        total = (time.perf_counter() - t) * 1e3
    rows = [{"region": k, "ms": v[0], "share": v[0] / total, "calls": v[1]} for k, v in timer.self_times().items()]
    rows.sort(key=lambda r: -r["ms"])
    rest = total - sum(r["ms"] for r in rows)
    rows.append({"region": "(between regions)", "ms": rest, "share": rest / total, "calls": 0})
    rows.append({"region": "(step, wall)", "ms": total, "share": 1.0, "calls": 1})
    return rows


def rows_ab(fn, device, repeats: int = 3) -> dict:
    """Mean ms of ``fn`` (a warmed prefill chunk) with the prefill row fusions (``fused_rows.PREFILL_ROWS``)
    all off, the default ones on (``fused_ms``), and per fusion the default set without it (a default-on
    one) or with it added (a default-off one, listed in ``off_by_default``): ``saving_ms`` is the time
    without that fusion minus the time with it (negative: slower than the path it replaces), each run once
    untimed first."""
    from redknot.models.deepseek_v41 import fused_rows

    saved = dict(fused_rows.PREFILL_ROWS)
    names = sorted(k for k, v in saved.items() if v)
    extra = sorted(k for k, v in saved.items() if not v)

    def timed(on) -> float:
        for k in fused_rows.PREFILL_ROWS:
            fused_rows.PREFILL_ROWS[k] = k in on
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(repeats):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t) / repeats * 1e3

    try:
        out = {"unfused_ms": timed(()), "fused_ms": timed(names), "fusions": names}
        out["saving_ms"] = {k: timed([x for x in names if x != k]) - out["fused_ms"] for k in names}
        out["saving_ms"].update({k: out["fused_ms"] - timed(names + [k]) for k in extra})
        out["off_by_default"] = extra
    finally:
        fused_rows.PREFILL_ROWS.update(saved)
    return out


def group_regions(rows: Sequence[dict]) -> List[dict]:
    """Region rows -> coarse groups (registry ops, mHC, norms, RoPE, linears outside the ops, compressor,
    indexer / window index building, router, Engram, the rest)."""
    groups: Dict[str, float] = {}
    total = next(r["ms"] for r in rows if r["region"] == "(step, wall)")
    for r in rows:
        name = r["region"]
        if name == "(step, wall)":
            continue
        if name.startswith("op "):
            g = "registry ops"
        elif ".hc_" in name or "._Site" in name or name == "model.collapse":
            g = "mHC sites (mixes, lagged collapse + norm, post mix)"
        elif name.endswith("rms_norm") or name == "rows.norm":
            g = "RMS norms"
        elif name.endswith(("apply_rope", "index_qdq")) or name.startswith("rows."):
            g = "RoPE (+ norms) of q, kv, output, and the indexer query's FP4 grid"
        elif "linear" in name or "swiglu" in name or "grouped_output" in name:
            g = "linears outside the registry (wo_a einsum, bf16/fp32 projections, SwiGLU glue)"
        elif "_compress" in name:
            g = "compressor (pooling, ring, index keys)"
        elif "attend_spans" in name or "index_spans" in name or "_index" in name:
            g = "attention / indexer index building and key gathers"
        elif "route" in name or "moe_forward" in name or "moe_post" in name:
            g = "router and MoE glue"
        elif "engram" in name or "table_rows" in name or "_hashes" in name:
            g = "Engram (hashes, rows, gate)"
        else:
            g = "rest (layer bodies, between regions)"
        groups[g] = groups.get(g, 0.0) + r["ms"]
    out = [{"group": g, "ms": ms, "share": ms / total} for g, ms in groups.items()]
    out.sort(key=lambda r: -r["ms"])
    return out


@dataclass
class ChunkFit:
    """Least-squares ``seconds = a + b * start`` over the chunks of prefills (start: first position)."""
    a: float = 0.0
    b: float = 0.0
    n: int = 0

    @classmethod
    def fit(cls, points: Sequence[Tuple[int, float]]) -> "ChunkFit":
        n = len(points)
        if n == 0:
            return cls()
        if n == 1 or len({p for p, _ in points}) == 1:
            return cls(sum(s for _, s in points) / n, 0.0, n)
        mx = sum(p for p, _ in points) / n
        my = sum(s for _, s in points) / n
        sxx = sum((p - mx) ** 2 for p, _ in points)
        b = sum((p - mx) * (s - my) for p, s in points) / sxx
        b = max(b, 0.0)
        return cls(my - b * mx, b, n)

    def chunk(self, start: int) -> float:
        return self.a + self.b * start

    def prefill(self, ctx: int, chunk: int) -> float:
        """Predicted seconds of a prefill of ``ctx`` tokens in chunks of ``chunk`` (the last one partial)."""
        total = 0.0
        for s in range(0, ctx, chunk):
            total += self.chunk(s) * min(chunk, ctx - s) / chunk
        return total

    def as_dict(self) -> dict:
        return {"a_s": self.a, "b_s_per_token": self.b, "chunks": self.n}


def cache_bytes(state, layout, filled_tokens: int, cut_cfg) -> dict:
    """Global cache bytes per token one sequence of ``filled_tokens`` holds (pages it filled), the cut's
    expected value, and V4.1-Flash's (its four kv sources) scaled by the measured page overhead."""
    from redknot.models.deepseek_v41.config import V41Config
    from redknot.models.deepseek_v41.cost import global_kv_bytes_per_token

    blocks = layout.blocks_for(filled_tokens)
    per_block = sum(src.entries[0].numel() + src.keys[0].numel() for src in state.sources.values())
    measured = blocks * per_block / max(filled_tokens, 1)
    expected = global_kv_bytes_per_token(cut_cfg)
    flash = V41Config()
    full = global_kv_bytes_per_token(flash)
    row = {src_layer: src.entries.shape[-1] + src.keys.shape[-1] for src_layer, src in state.sources.items()}
    real_rows = (cut_cfg.head_dim, cut_cfg.index_head_dim) == (flash.head_dim, flash.index_head_dim)
    return {"measured_bytes_per_token": measured, "expected_cut_bytes_per_token": expected,
            # V4.1-Flash's four sources with the measured page overhead (only meaningful at real widths)
            "v41_flash_bytes_per_token": full * measured / expected if expected and real_rows else None,
            "v41_flash_expected": full, "row_bytes_per_source": row}
