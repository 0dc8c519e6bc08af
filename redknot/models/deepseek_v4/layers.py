"""Small parameter-holding building blocks; their math goes through the kernel set ``ks``."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from redknot.kernels.ref_quant import FP8_BLOCK
from redknot.models.deepseek_v4.params import FLOAT, ParamFactory


class Linear(nn.Module):
    """y = x · Wᵀ; W is stored as the factory decides (float, or FP8/FP4 with ``scale``)."""

    def __init__(self, f: ParamFactory, out_features: int, in_features: int, fmt: str = FLOAT):
        super().__init__()
        self.weight, scale = f.weight((out_features, in_features), fmt)
        if scale is not None:
            self.scale = scale
        else:
            self.register_parameter("scale", None)

    def forward(self, ks, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        return ks.linear(x.reshape(-1, x.shape[-1]), self.weight, self.scale).view(*lead, -1)


class Norm(nn.Module):
    """Weighted RMSNorm; the weight is kept in fp32."""

    def __init__(self, f: ParamFactory, dim: int, eps: float):
        super().__init__()
        self.weight = f.fp32(dim)
        self.eps = eps

    def forward(self, ks, x: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        y = ks.rms_norm(x, self.weight, self.eps)
        return y if out_dtype is None else y.to(out_dtype)


class Embedding(nn.Module):
    """Token embedding table [vocab, D]."""

    def __init__(self, f: ParamFactory, vocab: int, dim: int):
        super().__init__()
        self.weight = f.plain(vocab, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]


class LinearGroup(nn.Module):
    """Linears that read the same input, run as one ``ks.linear`` per storage format once :meth:`fuse` has
    concatenated their weights along N (and their scales' rows, where each member's rows fill whole scale rows).

    After :meth:`fuse` each member's ``weight`` (and ``scale``) keeps its Parameter but views its rows of the
    concatenation: checkpoint names, the state dict and in-place loads are unchanged. A member whose storage no
    longer views the concatenation (its ``.data`` replaced, the model moved with ``.to``) makes the group run its
    members one by one, as before :meth:`fuse`. ``max_rows``: inputs with more rows run the members one by one
    (wide outputs whose column slices the next ops would copy)."""

    def __init__(self, members: Sequence[Linear], max_rows: Optional[int] = None):
        super().__init__()
        self._members: List[Linear] = list(members)   # a plain list: the owners register the members
        self.max_rows = max_rows
        self._parts: List[Tuple[List[int], List[int]]] = []   # (member indices, their N) per fused buffer

    def fuse(self) -> int:
        """Concatenate the members' weights per storage format; returns the launches a call saves."""
        groups: dict = {}
        for i, m in enumerate(self._members):
            w, s = m.weight, m.scale
            if w.device.type == "meta":
                return 0
            if s is not None and w.shape[0] != (FP8_BLOCK if w.dtype == torch.float8_e4m3fn else 1) * s.shape[0]:
                continue  # its last scale row covers fewer weight rows (N % 128): the next member's would shift
            sig = (w.dtype, tuple(w.shape[1:]), None if s is None else (s.dtype, tuple(s.shape[1:])))
            groups.setdefault(sig, []).append(i)
        self._parts = []
        for name in [n for n, _ in self.named_buffers(recurse=False)]:
            delattr(self, name)
        for idx in groups.values():
            if len(idx) < 2:
                continue
            k = len(self._parts)
            members = [self._members[i] for i in idx]
            weight = torch.cat([m.weight.detach() for m in members])
            self.register_buffer(f"weight{k}", weight, persistent=False)
            scale = None
            if members[0].scale is not None:
                scale = torch.cat([m.scale.detach() for m in members])
                self.register_buffer(f"scale{k}", scale, persistent=False)
            r0 = s0 = 0
            for m in members:
                n = m.weight.shape[0]
                m.weight.data = weight[r0:r0 + n]
                r0 += n
                if scale is not None:
                    ns = m.scale.shape[0]
                    m.scale.data = scale[s0:s0 + ns]
                    s0 += ns
            self._parts.append((idx, [self._members[i].weight.shape[0] for i in idx]))
        return sum(len(idx) - 1 for idx, _ in self._parts)

    def _fused(self, k: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        return getattr(self, f"weight{k}"), getattr(self, f"scale{k}", None)

    def _still_viewed(self) -> bool:
        for k, (idx, _) in enumerate(self._parts):
            for buf, attr in zip(self._fused(k), ("weight", "scale")):
                if buf is None:
                    continue
                at, step = buf.data_ptr(), buf.stride(0) * buf.element_size()
                for i in idx:
                    t = getattr(self._members[i], attr)
                    if t is None or t.data_ptr() != at:
                        return False
                    at += t.shape[0] * step
        return True

    def forward(self, ks, x: torch.Tensor) -> List[torch.Tensor]:
        """Every member's output, in member order."""
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if not self._parts or (self.max_rows is not None and rows > self.max_rows) or not self._still_viewed():
            return [m(ks, x) for m in self._members]
        lead, x2 = x.shape[:-1], x.reshape(-1, x.shape[-1])
        out: List[Optional[torch.Tensor]] = [None] * len(self._members)
        for k, (idx, sizes) in enumerate(self._parts):
            y = ks.linear(x2, *self._fused(k))
            for i, piece in zip(idx, y.split(sizes, dim=-1)):
                out[i] = piece if len(lead) == 1 else piece.reshape(*lead, -1)
        return [o if o is not None else m(ks, x) for o, m in zip(out, self._members)]
