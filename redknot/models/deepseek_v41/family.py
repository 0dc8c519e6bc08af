"""DeepSeek-V4.1-Flash as a model family (:class:`redknot.models.family.ModelFamily`).

Torch-free at import: each method imports the part of the V4.1 code it needs. The
config, schema, checkpoint reader/writer, cost model and memory plan live here
(``config``, ``checkpoint``, ``weights``, ``writer``, ``cost``); the forward pass,
its paged state and the model builder live in ``model`` / ``state`` /
``state_layout``.
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Sequence, Union

from redknot.models.family import DSPARK, ExpertRows, ModelFamily
from redknot.models.registry import family_entry


class DeepseekV41Family(ModelFamily):
    """V4.1-Flash: shared compressed caches in their trained byte formats, Engram, DSpark stages."""

    def parse_config(self, source: Union[str, os.PathLike, Mapping[str, Any]]):
        from redknot.models.deepseek_v41.config import V41Config

        if isinstance(source, Mapping):
            return V41Config.from_dict(dict(source))
        return V41Config.from_pretrained(os.fspath(source))

    def state_layout(self, cfg, *, block_size: int, max_backtrack: int, kv_bytes: int):
        from redknot.models.deepseek_v41.state_layout import create_state_layout

        return create_state_layout(cfg, block_size=block_size, max_backtrack=max_backtrack, kv_bytes=kv_bytes)

    def allocate_state(self, cfg, layout, *, num_slots: int, num_blocks: int, device, dtype):
        from redknot.models.deepseek_v41.state import allocate_state

        return allocate_state(cfg, layout, num_slots=num_slots, num_blocks=num_blocks, device=device, dtype=dtype)

    def build_model(self, model_cfg, hardware, cache_dir: str, *, kernels=None, device="cpu",
                    expert_rows: Optional[ExpertRows] = None):
        from redknot.models.deepseek_v41.model import build_v41_model

        return build_v41_model(model_cfg, hardware, cache_dir, kernels=kernels, device=device,
                               expert_rows=expert_rows)

    def load_tokenizer(self, model_cfg=None):
        # V4.1 ships the V4 vocabulary (129,280 entries, same special-token ids); the token map
        # check (engram_compressed_vocab_size) is what ties a tokenizer to a checkpoint.
        from redknot.models.deepseek_v4.tokenizer import load_tokenizer

        return load_tokenizer(model_cfg)

    def cost_model(self, cfg):
        from redknot.models.deepseek_v41.cost import CostModel

        return CostModel(cfg)

    def write_synthetic_checkpoint(self, model_cfg, cache_dir: str) -> str:
        from redknot.models.deepseek_v41.writer import write_synthetic_checkpoint

        return write_synthetic_checkpoint(model_cfg, cache_dir)

    def draft_models(self, model) -> Mapping[str, Any]:
        draft = getattr(model, "dspark", None)
        return {DSPARK: draft} if draft is not None else {}

    def varlen_forward(self, model, state, *, input_ids, positions, query_start_loc, seq_slots, block_tables):
        from redknot.models.deepseek_v41.tensor_step import TensorStep, tensor_forward

        model.num_forwards += 1  # as model.forward counts it: taps of this step are the current ones
        return tensor_forward(model, TensorStep(input_ids, positions, query_start_loc, seq_slots, block_tables),
                              state)

    def expert_layers(self, model) -> Sequence[Any]:
        from redknot.models.deepseek_v41.parallel import expert_layers

        return expert_layers(model)

    def arch_config(self, model_cfg):
        """The architecture a model config serves, without reading weights: ``model.path``'s
        config.json, else the synthetic architecture, else the released V4.1-Flash; cut to
        ``model.num_layers``."""
        from redknot.models.deepseek_v41.config import V41Config, synthetic_config

        path = getattr(model_cfg, "path", None)
        if path and os.path.isfile(os.path.join(path, "config.json")):
            return V41Config.from_pretrained(path, getattr(model_cfg, "num_layers", None))
        syn = getattr(model_cfg, "synthetic", None)
        cfg = synthetic_config(dict(syn.architecture), bool(syn.quantize_fp8)) if syn is not None \
            else V41Config.flash()
        return cfg.cut(getattr(model_cfg, "num_layers", None))

    def _plan(self, model_cfg, hardware, features, device_name: str, device_bytes: int):
        from redknot.models.deepseek_v41.cost import memory_plan

        par = features.parallel
        placement = getattr(par, "engram_placement", "sharded")
        return memory_plan(self.arch_config(model_cfg), ep=int(par.ep), dp=int(par.dp),
                           engram_placement=str(getattr(placement, "value", placement)),
                           device_bytes=device_bytes, device_name=device_name,
                           memory_utilization=float(hardware.memory_utilization),
                           include_draft=bool(features.dspark.enabled))

    def memory_plans(self, model_cfg, hardware, features, device_name: Optional[str] = None) -> Sequence[Any]:
        from redknot.models.deepseek_v41.cost import DEVICE_MEMORY

        names = [device_name] if device_name else list(getattr(hardware, "device_names", []) or [])
        plans = []
        for name in names:
            known = [k for k in DEVICE_MEMORY if k.lower() in str(name).lower()]
            if known:
                plans.append(self._plan(model_cfg, hardware, features, known[0], DEVICE_MEMORY[known[0]]))
        return plans

    def check_memory(self, model_cfg, hardware, features, *, device_bytes: int, device_name: str) -> None:
        from redknot.models.deepseek_v41.cost import check_fits

        check_fits(self._plan(model_cfg, hardware, features, device_name, device_bytes),
                   int(model_cfg.max_position))


FAMILY = DeepseekV41Family(family_entry("deepseek_v41"))
