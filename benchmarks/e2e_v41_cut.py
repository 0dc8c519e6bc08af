"""The DeepSeek-V4.1 real-dimension cut of ``benchmarks/e2e_v41.py``: its config (the five layers' roles, the
toy widths of ``--smoke``), random stored bytes per checkpoint tensor, the model, a multi-sequence driver over
its paged state (``Batch``), a synthetic filled state for decode without a prefill, and token ids."""
from __future__ import annotations

import math
import re

import torch

ROLES = {"compress_ratios": [2, 2, 1, 1, 1], "kv_source_layer_ids": [0, 2], "index_source_layer_ids": [0, 2, 4],
         "candidate_source_layer_id": 2, "engram_layer_ids": [0], "num_nextn_predict_layers": 0,
         "num_hidden_layers": 5}
SMOKE = {"hidden_size": 256, "moe_intermediate_size": 128, "num_attention_heads": 4, "head_dim": 64,
         "qk_rope_head_dim": 16, "q_lora_rank": 64, "o_lora_rank": 64, "o_groups": 2, "n_routed_experts": 8,
         "num_experts_per_tok": 2, "sliding_window": 16, "index_n_heads": 4, "index_head_dim": 64, "index_topk": 8,
         "candidate_topk_blocks": 3, "candidate_block_size": 4, "engram_n_heads": 2, "engram_head_dim": 32,
         "vocab_size": 2048}
ATTENTION_OPS = ("cache_insert_mx", "sparse_attention_mx", "indexer_topk_mx", "indexer_source_mx", "engram_gather_mx")


def cut_config(smoke: bool, engram_vocab: int):
    from redknot.models.deepseek_v41.config import V41Config

    over = dict(ROLES, engram_vocab_size=engram_vocab, engram_compressed_vocab_size=1027)
    if smoke:
        over.update(SMOKE)
    return V41Config().with_overrides(over)


def random_stored(cfg, device, include_draft: bool = False):
    """Random stored bytes per checkpoint tensor: FP8 e4m3 values with unit E8M0 scales (values ~1/sqrt(K)),
    MXFP4 random codes with a per-32 scale of the same spread (each layer's experts back to back in one
    stack, as the grouped kernel reads them), norms near 1, small mHC weights -> (backbone, draft) tensors
    (the draft empty unless ``include_draft``)."""
    from redknot.models.deepseek_v41.checkpoint import (
        BF16,
        ENGRAM,
        FP4,
        FP8,
        checkpoint_spec,
    )

    g = torch.Generator(device=device).manual_seed(0)
    main: dict[str, torch.Tensor] = {}
    draft: dict[str, torch.Tensor] = {}
    stacks: dict[str, torch.Tensor] = {}
    for spec in checkpoint_spec(cfg, include_draft=include_draft):
        out, shape, name = (draft if spec.draft else main), spec.shape, spec.name
        if spec.kind == FP4:
            key = re.sub(r"\.experts\.\d+\.", ".experts.*.", name)
            if key not in stacks:
                n = cfg.dspark_n_routed_experts if spec.draft else cfg.n_routed_experts
                stacks[key] = torch.randint(0, 256, (n, *spec.stored_shape), generator=g, device=device,
                                            dtype=torch.uint8)
                e = 127 - round(math.log2(2.9 * math.sqrt(shape[-1])))
                stacks[key + "s"] = torch.full((n, *spec.scale_shape), e, dtype=torch.uint8, device=device)
            out[name] = stacks[key][spec.expert]
            out[spec.scale_name] = stacks[key + "s"][spec.expert]
        elif spec.kind in (FP8, ENGRAM):
            std = shape[-1] ** -0.5 if spec.kind == FP8 else 1.0
            out[name] = (torch.randn(shape, generator=g, device=device) * std).to(torch.float8_e4m3fn)
            out[spec.scale_name] = torch.full(spec.scale_shape, 127, dtype=torch.uint8, device=device)
        else:
            v = torch.randn(shape, generator=g, device=device)
            if name.endswith(("norm.weight", "q_weight", "k_weight")):
                v = 1 + 0.1 * v
            elif "hc_" in name:
                v = (0.5 + 0.1 * v) if name.endswith("_scale") else 0.05 * v
            elif name.endswith("attn_sink"):
                pass
            elif name == "embed.weight":
                v = 0.5 * v
            elif len(shape) > 1:
                v = v / math.sqrt(shape[-1])
            else:
                v = 0.1 * v
            out[name] = v.to(torch.bfloat16 if spec.kind == BF16 else torch.float32)
    return main, draft


def random_tensors(cfg, device) -> dict[str, torch.Tensor]:
    """The backbone's tensors of :func:`random_stored`."""
    return random_stored(cfg, device)[0]


def build(cfg, tensors, numerics: str, ops, device):
    from redknot.models.deepseek_v41.model import DeepseekV41
    from redknot.models.deepseek_v41.ref_math import Numerics, Weights

    tmap = (torch.arange(cfg.vocab_size) * 7919) % cfg.engram_compressed_vocab_size
    w = Weights(dict(tensors), torch.bfloat16, keep=True)
    return DeepseekV41(cfg, w, tmap, int(tmap[cfg.engram_pad_id]), Numerics(numerics, torch.bfloat16),
                       device=device, ops=ops)


class Batch:
    """``b`` sequences of one model on a private paged state (sequence i: slot i, its own blocks)."""

    def __init__(self, model, b: int, max_tokens: int, block_size: int = 256):
        from redknot.models.deepseek_v41.state import allocate_state
        from redknot.models.deepseek_v41.state_layout import create_state_layout

        self.model, self.b = model, b
        self.layout = create_state_layout(model.cfg, block_size=block_size, max_backtrack=0)
        self.per = self.layout.blocks_for(max_tokens)
        # One spare slot and block last (the tensor-only step's padding target, as in the engine).
        self.state = allocate_state(model.cfg, self.layout, num_slots=b + 1, num_blocks=b * self.per + 1,
                                    device=model.device, dtype=torch.bfloat16)
        self.blocks = [list(range(i * self.per, (i + 1) * self.per)) for i in range(b)]
        self.lens = [0] * b

    def step(self, ids: list[list[int]], seqs=None) -> torch.Tensor:
        """New token ids of sequences ``seqs`` (default: all) -> pre-head rows."""
        from redknot.step.metadata import StepMetadata

        seqs = list(range(self.b)) if seqs is None else seqs
        n = sum(len(x) for x in ids)
        meta = StepMetadata.build([list(x) for x in ids], [self.lens[s] for s in seqs], seqs,
                                  [self.blocks[s] for s in seqs], list(range(n)), device=self.model.device)
        x = self.model.forward(meta, self.state)
        for s, x_ in zip(seqs, ids):
            self.lens[s] += len(x_)
        return x

    def clone_first(self) -> None:
        """Every sequence becomes a copy of sequence 0 (a batch of equal contexts without b prefills)."""
        for i in range(1, self.b):
            copy_sequence(self.state, i, 0, self.blocks[i], self.blocks[0])
            self.lens[i] = self.lens[0]

    def global_cache_bytes(self, seq: int = 0) -> int:
        """Bytes of compressed entries + index keys in the pages sequence ``seq`` has filled."""
        blocks = self.layout.blocks_for(self.lens[seq])
        per_block = sum(src.entries[0].numel() + src.keys[0].numel() for src in self.state.sources.values())
        return blocks * per_block


def copy_sequence(st, dst: int, src: int, dst_blocks, src_blocks) -> None:
    """Slot ``dst`` with its pages ``dst_blocks`` becomes a copy of slot ``src`` with ``src_blocks``: window
    rings, compressed entries and index keys, ratio-2 carry-over rows and Engram look-back ids."""
    for win in st.windows:
        win[dst] = win[src]
    for s in st.sources.values():
        s.entries[dst_blocks] = s.entries[src_blocks]
        s.keys[dst_blocks] = s.keys[src_blocks]
        if s.kv_rows is not None:
            s.kv_rows[dst] = s.kv_rows[src]
            s.gate_rows[dst] = s.gate_rows[src]
    if st.engram_ids is not None:
        st.engram_ids[dst] = st.engram_ids[src]


def fill_synthetic(b: Batch, ctx: int, seed: int = 0, pool: int = 4096) -> None:
    """Every sequence of ``b`` at length ``ctx`` on caches of valid random bytes: rows packed from normal
    values by the stored formats' own packers (no NaN or out-of-range scale), tiled over every window slot
    and page; ratio-2 carry-over rows and Engram look-back ids random too. A decode step's work depends on
    the lengths and shapes, not on the values, so its timing equals a prefilled state's without the prefill
    (the indexer's selections differ, their cost does not)."""
    from redknot.kernels import mx_formats as mx

    cfg, dev = b.model.cfg, b.model.device
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rows(pack, dim):
        return pack(torch.randn(pool, dim, generator=g)).to(dev)

    def tile(dst: torch.Tensor, src: torch.Tensor) -> None:
        flat = dst.view(-1, dst.shape[-1])
        for s in range(0, flat.shape[0], 1 << 22):
            n = min(1 << 22, flat.shape[0] - s)
            flat[s:s + n] = src[torch.arange(s, s + n, device=dev) % pool]

    win = rows(mx.pack_window_rows, cfg.head_dim)
    ent = rows(mx.pack_compressed_entries, cfg.head_dim)
    key = rows(mx.pack_index_keys, cfg.index_head_dim)
    st = b.state
    for w in st.windows:
        tile(w, win)
    for src in st.sources.values():
        tile(src.entries, ent)
        tile(src.keys, key)
        for carry in (src.kv_rows, src.gate_rows):
            if carry is not None:
                carry.copy_(torch.randn(carry.shape, generator=g, dtype=carry.dtype))
    if st.engram_ids is not None:
        hi = int(b.model.token_map.max().item()) + 1 if b.model.token_map is not None else cfg.vocab_size
        st.engram_ids.copy_(torch.randint(0, hi, st.engram_ids.shape, generator=g))
    b.lens = [ctx] * b.b


def distinct_ids(base: int, n: int, vocab: int) -> list[int]:
    """``n`` different token ids from ``base``: every sequence of a decode batch feeds its own token, so the
    rows route to the experts independent rows would (one token for all cloned sequences would give
    identical rows routed to the same k experts, and a step that reads k experts' weights, not the distinct
    experts of the batch that the floor counts)."""
    return [(base + 7919 * i) % (vocab - 3) + 3 for i in range(n)]


def distinct_rows(base: int, n: int, vocab: int) -> list[list[int]]:
    return [[x] for x in distinct_ids(base, n, vocab)]


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab - 3, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
