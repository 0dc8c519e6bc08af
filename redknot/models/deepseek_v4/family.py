"""DeepSeek-V4 as a model family (:class:`redknot.models.family.ModelFamily`).

Torch-free at import: each method imports the part of the V4 code it needs, so
the harness can load the tokenizer (``mode=prepare``) without torch.
"""
from __future__ import annotations

import os
import weakref
from typing import Any, Mapping, Optional, Sequence, Union

from redknot.models.family import DSPARK, MTP, ContextParallelHooks, ExpertRows, ModelFamily
from redknot.models.registry import family_entry


# model -> its DSpark draft (kept beside the model, not inside it: the draft is not part of its weights).
_DSPARK_DRAFTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class DeepseekV4Family(ModelFamily):
    """V4-Flash: SWA + CSA/HCA state (:class:`StateLayout`, :class:`V4State`); one classic MTP layer
    (June release) or three DSpark draft stages (-0731)."""

    def parse_config(self, source: Union[str, os.PathLike, Mapping[str, Any]]):
        from redknot.models.deepseek_v4.config import V4Config

        if isinstance(source, Mapping):
            return V4Config.from_hf_dict(dict(source))
        return V4Config.from_pretrained(os.fspath(source))

    def state_layout(self, cfg, *, block_size: int, max_backtrack: int, kv_bytes: int):
        from redknot.models.deepseek_v4.state_layout import StateLayout

        return StateLayout.create(cfg, block_size=block_size, max_backtrack=max_backtrack, kv_bytes=kv_bytes)

    def allocate_state(self, cfg, layout, *, num_slots: int, num_blocks: int, device, dtype):
        from redknot.models.deepseek_v4.state import V4State

        return V4State.allocate(cfg, layout, num_slots, num_blocks, device=device, dtype=dtype)

    def build_model(self, model_cfg, hardware, cache_dir: str, *, kernels=None, device="cpu",
                    expert_rows: Optional[ExpertRows] = None):
        from redknot.models.deepseek_v4.build import build_model, checkpoint_path
        from redknot.models.deepseek_v4.dspark_draft import load_draft

        net = build_model(model_cfg, hardware, cache_dir, kernels=kernels, device=device, expert_rows=expert_rows)
        draft = load_draft(net, checkpoint_path(model_cfg, cache_dir), hardware, device)
        if draft is not None:
            _DSPARK_DRAFTS[net] = draft
        return net

    def load_tokenizer(self, model_cfg=None):
        from redknot.models.deepseek_v4.tokenizer import load_tokenizer

        return load_tokenizer(model_cfg)

    def cost_model(self, cfg):
        from redknot.models.deepseek_v4.cost import CostModel

        return CostModel(cfg)

    def write_synthetic_checkpoint(self, model_cfg, cache_dir: str) -> str:
        from redknot.models.deepseek_v4.synthetic import write_synthetic_checkpoint

        return write_synthetic_checkpoint(model_cfg, cache_dir)

    def draft_models(self, model) -> Mapping[str, Any]:
        # The June V4-Flash carries one classic MTP layer (num_nextn_predict_layers=1); the model
        # runs it itself (``mtp_forward``) over the state's MTP ring. V4-Flash-0731 carries DSpark
        # stages under mtp.* instead (dspark_draft.py), built and loaded with the model.
        found: dict = {MTP: model} if len(model.mtp) else {}
        draft = _DSPARK_DRAFTS.get(model)
        if draft is not None:
            found[DSPARK] = draft
        return found

    def varlen_forward(self, model, state, *, input_ids, positions, query_start_loc, seq_slots, block_tables):
        from redknot.models.deepseek_v4.varlen_step import varlen_forward

        return varlen_forward(model, state, input_ids=input_ids, positions=positions,
                              query_start_loc=query_start_loc, seq_slots=seq_slots, block_tables=block_tables)

    def expert_layers(self, model) -> Sequence[Any]:
        return [layer.ffn for layer in model.layers]

    def context_parallel(self) -> Optional[ContextParallelHooks]:
        from redknot.models.deepseek_v4 import context_parallel

        return ContextParallelHooks(attention=context_parallel.attention, idle=context_parallel.idle)


FAMILY = DeepseekV4Family(family_entry("deepseek_v4"))
