"""File plumbing shared by the model families' checkpoint writers: safetensors shards with their
index, and a directory published once under a content key.

Both DeepSeek families write the same Hugging Face layout (``model-0000i-of-0000N.safetensors``,
``model.safetensors.index.json``, ``config.json``) and cache seeded checkpoints the same way, so the
file handling lives here once; what goes into the tensors and the config stays in each family.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any, Callable, Dict, Iterable, List, Mapping, Tuple

import torch


def write_shards(out_dir: str, tensors: Iterable[Tuple[str, torch.Tensor]], max_shard_bytes: int,
                 index_file: str, config: Mapping[str, Any]) -> List[str]:
    """Write ``tensors`` into shards of at most ``max_shard_bytes`` (a larger tensor gets a shard of
    its own), the index ``index_file`` and ``config.json``; returns the shard file names.

    Shards are written as ``.partial`` first and renamed once their count is known (the final names
    carry it), so ``tensors`` may be a generator consumed exactly once."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    groups: List[List[str]] = []
    current: Dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal current, size
        if current:
            save_file(current, os.path.join(out_dir, f"model-{len(groups) + 1:05d}.partial"), metadata={"format": "pt"})
            groups.append(list(current))
        current, size = {}, 0

    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_shard_bytes:
            flush()
        current[name] = t
        size += nbytes
        total += nbytes
    flush()
    weight_map, files = {}, []
    for i, names in enumerate(groups):
        final = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        os.replace(os.path.join(out_dir, f"model-{i + 1:05d}.partial"), os.path.join(out_dir, final))
        files.append(final)
        weight_map.update({k: final for k in names})
    with open(os.path.join(out_dir, index_file), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1, sort_keys=True)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(dict(config), f, indent=1)
    return files


def publish_once(root: str, name: str, final: str, index_file: str, write: Callable[[str], None],
                 manifest: Mapping[str, Any]) -> str:
    """Directory ``final`` (under ``root``), produced by ``write(tmp_dir)`` plus a ``synthetic.json``
    holding ``manifest`` on first use.

    The directory counts as present once it holds ``index_file``. It is built in a temporary sibling
    and renamed into place, so a reader never sees half a checkpoint; when another process renamed
    its copy first, that copy is kept and this one dropped."""
    if os.path.isfile(os.path.join(final, index_file)):
        return final
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=root, prefix=f".{name}.tmp-")
    try:
        write(tmp)
        with open(os.path.join(tmp, "synthetic.json"), "w", encoding="utf-8") as f:
            json.dump(dict(manifest), f, indent=1)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isfile(os.path.join(final, index_file)):  # not a concurrent writer's result
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def synthetic_args(model_cfg: Any) -> Tuple[str, Dict[str, Any], int, bool]:
    """(name, architecture, seed, quantize_fp8) of the seeded checkpoint ``model.synthetic`` describes;
    a clear error when the model config has none."""
    syn = model_cfg.synthetic
    if syn is None:
        raise ValueError(f"model {model_cfg.name!r}: model.synthetic is not set (no seeded checkpoint to write)")
    return model_cfg.name, dict(syn.architecture), int(syn.seed), bool(syn.quantize_fp8)


def check_model_keys(model_cfg: Any, max_position_embeddings: int, sliding_window: int) -> None:
    """``model.max_position`` and ``model.sliding_window`` against the checkpoint's config: a longer
    context than the checkpoint's, or another window, is a ValueError naming both values."""
    if model_cfg.max_position > max_position_embeddings:
        raise ValueError(f"model.max_position={model_cfg.max_position} exceeds the checkpoint's "
                         f"max_position_embeddings={max_position_embeddings}")
    window = getattr(model_cfg, "sliding_window", None)
    if window is not None and window != sliding_window:
        raise ValueError(f"model.sliding_window={window} disagrees with the checkpoint's "
                         f"sliding_window={sliding_window}")
