"""Load a native V4 checkpoint (sharded safetensors + ``model.safetensors.index.json``).

The whole checkpoint is checked against :func:`checkpoint_spec` from the shard
headers before any tensor is read: every missing, unexpected, mis-shaped or
wrongly typed tensor is reported in one :class:`CheckpointError`. Tensors are
then streamed shard by shard (an FP8/FP4 weight waits only for its scale) and
either dequantised into the model dtype or kept quantised, as the model's
parameters were built.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from safetensors import safe_open

from redknot.kernels.ref_quant import dequantize
from redknot.models.deepseek_v4.params import FP4, FP8, FP32, FLOAT, INT, TensorSpec, checkpoint_spec, stored_shapes

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_ALLOWED = {FP8: {"F8_E4M3"}, FP4: {"I8", "U8"}, FLOAT: {"BF16", "F16", "F32"}, FP32: {"F32", "BF16", "F16"},
            INT: {"I32", "I64"}}
_SCALE_DTYPES = {"F8_E8M0", "U8", "F32"}


class CheckpointError(ValueError):
    """A checkpoint does not match the model config; lists every offending tensor."""


@dataclass(frozen=True)
class _Expect:
    spec: TensorSpec
    is_scale: bool
    shape: Tuple[int, ...]
    dtypes: frozenset


def read_weight_map(path: str) -> Dict[str, str]:
    """Tensor name -> shard file (absolute) from the index file, or the single-file checkpoint."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            wm = json.load(f).get("weight_map")
        if not isinstance(wm, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        return {k: os.path.join(path, v) for k, v in wm.items()}
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        with _open_shard(single) as f:
            return {k: single for k in f.keys()}
    raise FileNotFoundError(f"checkpoint {path!r} has neither {INDEX_FILE} nor {SINGLE_FILE}")


class _open_shard:
    """``safe_open`` whose failures (a truncated or corrupt shard) name the file."""

    def __init__(self, file: str, device: str = "cpu"):
        self.file, self.device, self.handle = file, device, None

    def __enter__(self):
        try:
            self.handle = safe_open(self.file, framework="pt", device=self.device)
            return _Shard(self.handle.__enter__(), self.file)
        except CheckpointError:
            raise
        except Exception as err:  # safetensors' SafetensorError, OSError
            raise CheckpointError(f"shard {self.file} cannot be read ({type(err).__name__}: {err}); the file is "
                                  f"truncated or corrupt: download it again") from None

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc) if self.handle is not None else False


class _Shard:
    """A shard handle whose tensor reads name the file and tensor when they fail (data cut short)."""

    def __init__(self, handle, file: str):
        self.handle, self.file = handle, file

    def keys(self):
        return self.handle.keys()

    def get_slice(self, name: str):
        return self.handle.get_slice(name)

    def get_tensor(self, name: str):
        try:
            return self.handle.get_tensor(name)
        except Exception as err:
            raise CheckpointError(f"shard {self.file}: tensor {name} cannot be read ({type(err).__name__}: {err}); "
                                  f"the file is truncated or corrupt: download it again") from None


def infer_quantization(path: str) -> Optional[dict]:
    """A ``quantization_config`` for a checkpoint whose config.json has none but whose tensors are FP8
    (e4m3) with ``.scale`` siblings, as the released checkpoints store them; None otherwise."""
    weight_map = read_weight_map(path)
    found = _headers(weight_map)
    fp8 = [n for n, (_, dtype) in found.items()
           if dtype == "F8_E4M3" and n.endswith(".weight") and n[:-len("weight")] + "scale" in found]
    if not fp8:
        return None
    experts = [n for n in found if ".experts." in n and n.endswith(".weight") and n[:-len("weight")] + "scale" in found]
    fp4 = any(found[n][1] in ("I8", "U8") for n in experts)
    return {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128],
            "activation_scheme": "dynamic", "expert_dtype": "fp4" if fp4 else "fp8"}


def _expectations(specs: List[TensorSpec]) -> Dict[str, _Expect]:
    out: Dict[str, _Expect] = {}
    for s in specs:
        w_shape, s_shape = stored_shapes(s.fmt, s.shape)
        out[s.name] = _Expect(s, False, w_shape, frozenset(_ALLOWED[s.fmt]))
        if s.scale_name:
            out[s.scale_name] = _Expect(s, True, s_shape, frozenset(_SCALE_DTYPES))
    return out


def _ignorable(name: str, keep_layers: int, source_layers: Optional[int], with_mtp: bool) -> bool:
    """Tensors a cut model or a model built without MTP leaves unread on purpose."""
    if name.startswith("mtp.") and not with_mtp:
        return True
    m = re.match(r"layers\.(\d+)\.", name)
    return bool(m and source_layers and keep_layers <= int(m.group(1)) < source_layers)


def _headers(weight_map: Dict[str, str]) -> Dict[str, Tuple[Tuple[int, ...], str]]:
    found: Dict[str, Tuple[Tuple[int, ...], str]] = {}
    by_file: Dict[str, List[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        if not os.path.isfile(file):
            raise CheckpointError(f"shard {file} named by the index does not exist")
        with _open_shard(file) as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise CheckpointError(f"index maps {name} to {os.path.basename(file)}, which lacks it")
                sl = f.get_slice(name)
                found[name] = (tuple(sl.get_shape()), sl.get_dtype())
    return found


def check_checkpoint(path: str, specs: List[TensorSpec], keep_layers: int, source_layers: Optional[int],
                     with_mtp: bool, prefix: Optional[str] = None) -> Dict[str, str]:
    """Validate names, shapes and dtypes from the headers; returns the weight map. With ``prefix``
    only the tensors whose names start with it are checked (and returned)."""
    weight_map = read_weight_map(path)
    if prefix is not None:
        weight_map = {k: v for k, v in weight_map.items() if k.startswith(prefix)}
    expect = _expectations(specs)
    found = _headers(weight_map)
    problems: List[str] = []
    for name in sorted(set(expect) - set(found)):
        e = expect[name]
        problems.append(f"  missing     {name}: expected shape {list(e.shape)} ({'/'.join(sorted(e.dtypes))})")
    for name in sorted(set(found) - set(expect)):
        if not _ignorable(name, keep_layers, source_layers, with_mtp):
            shape, dtype = found[name]
            problems.append(f"  unexpected  {name}: found shape {list(shape)} {dtype}")
    for name in sorted(set(found) & set(expect)):
        (shape, dtype), e = found[name], expect[name]
        if shape != e.shape or dtype not in e.dtypes:
            problems.append(f"  mis-shaped  {name}: expected shape {list(e.shape)} "
                            f"({'/'.join(sorted(e.dtypes))}), found shape {list(shape)} {dtype}")
    if problems:
        raise CheckpointError(f"checkpoint {path} does not match the model config "
                              f"({len(problems)} tensors):\n" + "\n".join(problems))
    return weight_map


def _scale_to_float(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.uint8:  # raw ue8m0 exponent bytes
        return torch.exp2(t.float() - 127.0)
    return t.float()


class _Target:
    """Where a spec's values go in the model, and how they are converted."""

    def __init__(self, model: torch.nn.Module, spec: TensorSpec, num_experts: int):
        self.spec, self.num_experts = spec, num_experts
        owner, _, leaf = spec.param.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        self.param = getattr(module, leaf)
        scale_leaf = "scale" if leaf == "weight" else f"{leaf}_scale"
        self.scale = getattr(module, scale_leaf, None) if spec.fmt in (FP8, FP4) else None
        # Rows of a stacked expert tensor this expert goes to: none when expert parallel keeps it on
        # another rank, several for replicas (``Experts.logical_ids``).
        ids = getattr(module, "logical_ids", None) if spec.expert is not None else None
        self.rows = [spec.expert] if ids is None else [i for i, e in enumerate(ids) if e == spec.expert]

    def _dsts(self, t: torch.Tensor) -> List[torch.Tensor]:
        return [t] if self.spec.expert is None else [t[r] for r in self.rows]

    def store(self, weight: torch.Tensor, scale: Optional[torch.Tensor]) -> None:
        for i, dst in enumerate(self._dsts(self.param)):
            self._store_one(dst, None if self.scale is None else self._dsts(self.scale)[i], weight, scale)

    def _store_one(self, dst: torch.Tensor, dst_scale: Optional[torch.Tensor], weight: torch.Tensor,
                   scale: Optional[torch.Tensor]) -> None:
        if self.spec.fmt == INT:
            if weight.numel() and (int(weight.min()) < 0 or int(weight.max()) >= self.num_experts):
                raise CheckpointError(f"{self.spec.name}: expert ids must be in [0, {self.num_experts})")
            dst.copy_(weight.to(dst.dtype))
        elif dst_scale is not None:  # kept quantised
            dst.copy_(weight.view(dst.dtype))
            dst_scale.copy_(_scale_to_float(scale))
        else:
            s = None if scale is None else _scale_to_float(scale)
            dst.copy_(dequantize(weight, s, torch.float32) if s is not None else weight)


def load_checkpoint(model, path: str, progress: bool = True) -> None:
    """Fill every parameter of ``model`` (a DeepseekV4) from the checkpoint at ``path``."""
    cfg = model.cfg
    with_mtp = len(model.mtp) > 0
    specs = checkpoint_spec(cfg, include_mtp=with_mtp)
    weight_map = check_checkpoint(path, specs, cfg.num_layers, cfg.source_num_layers, with_mtp)
    load_tensors(model, path, specs, weight_map, cfg.n_routed_experts, progress)


# Tensor names of a classic MTP layer: a checkpoint whose mtp.* holds them has no DSpark stages.
_CLASSIC_MTP = re.compile(r"^mtp\.\d+\.(e_proj|h_proj|eh_proj|enorm|hnorm)\.")


def load_draft_checkpoint(draft, path: str, specs: List[TensorSpec], num_experts: int, progress: bool = False) -> None:
    """Fill a DSpark draft (``mtp.*`` stages) from the checkpoint at ``path``: every ``mtp.*`` tensor
    is checked against ``specs`` first; classic MTP tensors are refused by name."""
    classic = sorted(n for n in read_weight_map(path) if _CLASSIC_MTP.match(n))
    if classic:
        more = ", ..." if len(classic) > 4 else ""
        raise CheckpointError(f"checkpoint {path}: config.json declares DSpark stages (dspark_block_size) but mtp.* "
                              f"holds classic MTP tensors ({', '.join(classic[:4])}{more}); the checkpoint's config "
                              f"and tensors disagree")
    weight_map = check_checkpoint(path, specs, 0, None, True, prefix="mtp.")
    load_tensors(draft, path, specs, weight_map, num_experts, progress)


def load_tensors(model, path: str, specs: List[TensorSpec], weight_map: Dict[str, str], num_experts: int,
                 progress: bool) -> None:
    """Stream the tensors of ``specs`` from the (checked) ``weight_map`` into ``model``."""
    targets = {s.name: _Target(model, s, num_experts) for s in specs}
    scale_of = {s.scale_name: s.name for s in specs if s.scale_name}
    by_file: Dict[str, List[str]] = {}
    for name, file in weight_map.items():
        owner = name if name in targets else scale_of.get(name)
        if owner is not None and targets[owner].rows:  # experts held by other ranks are not read
            by_file.setdefault(file, []).append(name)
    pending: Dict[str, torch.Tensor] = {}  # weights or scales waiting for their partner in a later shard
    with _progress(progress, path, by_file) as advance:
        for file in sorted(by_file):
            with _open_shard(file) as f:
                for name in sorted(by_file[file]):
                    _load_one(f, name, targets, scale_of, pending, model.device)
            advance(file)
    if pending:
        raise CheckpointError(f"checkpoint {path}: unpaired quantised tensors {sorted(pending)}")


def _load_one(f, name: str, targets, scale_of, pending, device) -> None:
    t = f.get_tensor(name).to(device)
    if name in scale_of:
        weight_name = scale_of[name]
        if weight_name in pending:
            targets[weight_name].store(pending.pop(weight_name), t)
        else:
            pending[name] = t
        return
    target = targets[name]
    scale_name = target.spec.scale_name
    if scale_name is None:
        target.store(t, None)
    elif scale_name in pending:
        target.store(t, pending.pop(scale_name))
    else:
        pending[name] = t


class _progress:
    """A rich progress bar over shards (bytes), or nothing."""

    def __init__(self, enabled: bool, path: str, by_file: Dict[str, List[str]]):
        self.enabled, self.path, self.files = enabled, path, by_file
        self.bar = None

    def __enter__(self):
        if not self.enabled:
            return lambda file: None
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
        self.bar = Progress(TextColumn("loading {task.description}"), BarColumn(), DownloadColumn(),
                            TimeRemainingColumn(), transient=True)
        total = sum(os.path.getsize(f) for f in self.files)
        task = self.bar.add_task(os.path.basename(self.path.rstrip("/")), total=total)
        self.bar.start()
        return lambda file: self.bar.advance(task, os.path.getsize(file))

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
        return False
