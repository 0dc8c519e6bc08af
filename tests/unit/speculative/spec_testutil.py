"""Helpers of the DSpark / compact-replay tests: the test models, an engine factory, drivers."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from llm_testutil import run_all as run_requests

from redknot.config.schema import (Accelerator, DType, EngineConfig, FeaturesConfig, HardwareConfig, ModelConfig,
                                   SchedulerConfig, SwaReplayMode, SyntheticModelConfig)

WINDOW = 16
MAX_DRAFT = 4
# Every layer type (SWA, CSA m=4, HCA m=8, CSA) at toy width; window 16 so short prompts leave it.
ARCH = dict(vocab_size=4096, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=32,
            qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=32, index_n_heads=4, index_head_dim=16,
            index_topk=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_hash_layers=1,
            compress_ratios=[0, 4, 8, 4, 0], compress_rate_hca=8, sliding_window=WINDOW,
            max_position_embeddings=4096)
# The same with a window-only top layer (compact replay then also skips that layer's early rows).
ARCH_TAIL = dict(ARCH, compress_ratios=[0, 4, 8, 0, 0])
# V4-0731 layout: three DSpark stages tapping the last three (compressed) layers, no classic MTP;
# a 64-token vocabulary so that a rank-64 Markov head can hold any next-token map (make_dspark_agree).
DSPARK_VOCAB = 64
ARCH_DSPARK = dict(ARCH, vocab_size=DSPARK_VOCAB, compress_ratios=[0, 4, 8, 4, 0, 0, 0], dspark_block_size=5,
                   dspark_target_layer_ids=[1, 2, 3], dspark_markov_rank=DSPARK_VOCAB,
                   dspark_noise_token_id=DSPARK_VOCAB - 1, n_mtp_layers=3)
# A tapped window-only top layer: compact SWA replay would leave its early rows' taps uncomputed.
ARCH_DSPARK_TAIL = dict(ARCH_DSPARK, compress_ratios=[0, 4, 8, 0, 0, 0, 0])
ARCHES = {"main": ARCH, "tail": ARCH_TAIL, "dspark": ARCH_DSPARK, "dspark_tail": ARCH_DSPARK_TAIL}


def model_config(arch: Dict, name: str, max_len: int = 512) -> ModelConfig:
    return ModelConfig(name=name, max_position=max_len, sliding_window=WINDOW,
                       synthetic=SyntheticModelConfig(seed=0, architecture=dict(arch)))


@torch.no_grad()
def make_mtp_agree(model, eps: float = 0.005, head_scale: float = 6.0) -> None:
    """Shape a random model so that its MTP layer mostly drafts what the target will emit.

    Attention and MoE outputs are scaled by ``eps`` (they still move the logits, so state
    bugs still show), which makes the target's next token nearly a function of the current
    one; the MTP layer is made to compute that same function of its next-token input
    (identity ``e_proj``, unit ``enorm``, the target's final norm, small ``h_proj``). The head
    is sharpened so confidences spread over (0, 1).
    """
    d = model.cfg.hidden_size
    for layer in list(model.layers) + list(model.mtp):
        layer.attn.wo_b.weight.mul_(eps)
        layer.ffn.experts.w2.mul_(eps)
        layer.ffn.shared_experts.w2.weight.mul_(eps)
    for mtp in model.mtp:
        mtp.h_proj.weight.mul_(eps)
        mtp.e_proj.weight.copy_(torch.eye(d, dtype=mtp.e_proj.weight.dtype))
        mtp.enorm.weight.fill_(1.0)
        mtp.norm.weight.copy_(model.norm.weight)
    model.head.weight.mul_(head_scale)


@torch.no_grad()
def make_dspark_agree(model, draft, eps: float = 0.005, head_scale: float = 6.0, bias: float = 30.0) -> None:
    """Shape a random model so that its DSpark stages mostly draft what the target will emit.

    As in ``make_mtp_agree`` the target's attention and MoE outputs are scaled by ``eps`` (state
    bugs still show), so its next token is nearly a function g of the current one, read off the
    embedding path; the Markov head is set to W1 = I, W2[g(x), x] = ``bias``, so each draft is
    g(previous), except after every 4th token id (a wrong guess there), so blocks are accepted in part.
    """
    for layer in list(model.layers):
        layer.attn.wo_b.weight.mul_(eps)
        layer.ffn.experts.w2.mul_(eps)
        layer.ffn.shared_experts.w2.weight.mul_(eps)
    model.head.weight.mul_(head_scale)
    vocab = model.cfg.vocab_size
    ids = torch.arange(vocab, device=model.device)
    streams = model.embed(ids).unsqueeze(1).expand(-1, model.cfg.hc_mult, -1).contiguous()
    g = model.compute_logits(streams).argmax(dim=-1)  # [V]
    g = torch.where(ids % 4 == 0, (g + 1) % vocab, g)  # a wrong guess after every 4th token: partial acceptance
    markov = draft.mtp[-1].markov_head
    markov.markov_w1.weight.copy_(torch.eye(vocab, dtype=markov.markov_w1.weight.dtype))
    w2 = torch.zeros_like(markov.markov_w2.weight)
    w2[g, ids] = bias
    markov.markov_w2.weight.copy_(w2)


def features(dspark: bool = True, max_draft: int = MAX_DRAFT, adaptive: bool = False, compact: bool = False,
             keep_tokens: int = WINDOW + MAX_DRAFT + 1, batch_invariant: bool = False, verification: str = "token",
             budget_source: str = "fixed", budget_tokens: int = 6, method: str = "auto",
             draft_sampling: str = "greedy", budget_file=None, sts_path=None, block_attention: str = "bidirectional",
             confidence_activation: str = "sigmoid") -> FeaturesConfig:
    f = FeaturesConfig(async_scheduling=False)
    f.dspark.method = method if dspark else "none"
    f.dspark.max_draft, f.dspark.adaptive = max_draft, adaptive
    f.dspark.verification, f.dspark.draft_sampling = verification, draft_sampling
    f.dspark.budget, f.dspark.budget_tokens, f.dspark.budget_file = budget_source, budget_tokens, budget_file
    f.dspark.sts_path = sts_path
    f.dspark.block_attention, f.dspark.confidence_activation = block_attention, confidence_activation
    f.swa_replay.mode = SwaReplayMode.compact if compact else SwaReplayMode.off
    f.swa_replay.keep_tokens = keep_tokens
    f.batch_invariant.enabled = batch_invariant
    return f


class EngineFactory:
    """LLMs built once per configuration (the model shaped by ``make_mtp_agree`` unless ``agree=False``)."""

    def __init__(self, cache_dir: str) -> None:
        self.cache_dir = cache_dir
        self._engines: Dict[tuple, object] = {}

    def __call__(self, *, arch: str = "main", agree: bool = True, budget: int = 256, chunk: int = 64,
                 max_num_seqs: int = 8, num_cache_blocks: Optional[int] = None, max_len: int = 512, tag: str = "",
                 cuda: bool = False, **feat):
        """``tag`` tells apart otherwise identical engines (two runs in lockstep)."""
        key = (arch, agree, budget, chunk, max_num_seqs, num_cache_blocks, max_len, tag, cuda,
               tuple(sorted(feat.items())))
        if key not in self._engines:
            from redknot.engine import LLM
            sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                    long_prefill_chunk=chunk, block_size=16, num_cache_blocks=num_cache_blocks)
            engine = EngineConfig(scheduler=sched, seed=0, cache_dir=self.cache_dir)
            model = model_config(ARCHES[arch], f"spec-{arch}", max_len)
            hardware = HardwareConfig()
            if cuda:  # float32 on the GPU, so equalities hold to fp32 rounding as on the CPU
                hardware = HardwareConfig(name="cuda-test", accelerator=Accelerator.cuda, dtype=DType.float32,
                                          kv_cache_dtype=DType.float32, cuda_graphs=False, memory_utilization=0.5)
            llm = LLM(model, hardware, features(**feat), engine)
            if agree and arch.startswith("dspark"):
                from redknot.models.family import DSPARK
                make_dspark_agree(llm.runner.model, llm.runner.family.draft_models(llm.runner.model)[DSPARK])
            elif agree:
                make_mtp_agree(llm.runner.model)
            self._engines[key] = llm
        return self._engines[key]

    def check_idle(self) -> None:
        for llm in self._engines.values():
            assert not llm.has_unfinished_requests()
            llm.scheduler.check_invariants()
            llm.scheduler.cache.assert_empty()
            spec = llm.runner.speculator
            if spec is not None:
                spec.draft_hook = None

    def close(self) -> None:
        for llm in self._engines.values():
            llm.close()


class BlockSpy:
    """Records what the verifier returned per request and step (the emitted blocks)."""

    def __init__(self, llm) -> None:
        self.spec = llm.runner.speculator
        self.blocks: Dict[str, List[List[int]]] = {}
        self.logits: Dict[str, List[torch.Tensor]] = {}
        self._real = self.spec.verifier.verify_request
        self.spec.verifier.verify_request = self._verify_request
        self._rid = None

    def _verify_request(self, logits, rows, drafts):
        tokens = self._real(logits, rows, drafts)
        rid = rows[0].req_id
        self.blocks.setdefault(rid, []).append(list(tokens))
        self.logits.setdefault(rid, []).append(logits[:len(tokens)].clone())
        return tokens

    def close(self) -> None:
        del self.spec.verifier.verify_request


def run_all(llm, prompts: Dict[str, List[int]], params) -> Dict[str, object]:
    """add_request + step until done -> {req_id: final RequestOutput}."""
    return run_requests(llm, prompts, params)[0]


def checkpoint_tensors(path) -> Dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, read by name from its safetensors files (not through
    the model or its loader), for references that must not share the code under test."""
    from safetensors import safe_open

    params: Dict[str, torch.Tensor] = {}
    for shard in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                params[name] = f.get_tensor(name)
    return params


def lockstep(spec, ref, req_id: str) -> Iterator[int]:
    """Step ``spec`` until ``req_id`` finishes; after each step advance ``ref`` to the same number of
    computed tokens and yield it (the caller compares the two states there). ``ref`` is run to the
    end once ``spec`` is done."""
    while spec.has_unfinished_requests():
        if any(o.finished for o in spec.step()):
            break
        length = spec.scheduler.requests[req_id].num_computed_tokens
        while ref.scheduler.requests[req_id].num_computed_tokens < length:
            ref.step()
        yield length
    while ref.has_unfinished_requests():
        ref.step()


def record_logits(llm, prompts, params):
    """Run with the runner recording logits: ({req_id: output}, {req_id: logits row per output token})."""
    llm.runner.record_logits = True
    rows: Dict[str, List[torch.Tensor]] = {}
    real = llm.runner.execute

    def spy(batch):
        out = real(batch)
        for rid, lg in (out.logits or {}).items():
            keep = len(out.sampled_token_ids.get(rid, []))
            rows.setdefault(rid, []).extend(lg[:keep])
        return out
    llm.runner.execute = spy
    try:
        done = run_all(llm, prompts, params)
    finally:
        llm.runner.record_logits = False
        del llm.runner.execute
    return done, {rid: torch.stack(v) for rid, v in rows.items()}


def live_locations(llm, req_id: str) -> Dict[str, Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]]:
    """Where every piece of a request's state that a later step can read lives, by absolute
    position: name -> (state tensor, (row index, column index)). That is the SWA ring rows of
    the last window (all layers and the MTP layer), the compressor rows of the open window (and,
    CSA, the previous one), and every emitted CSA/HCA entry and indexer key."""
    from redknot.models.deepseek_v4.config import CSA, HCA
    runner, cache = llm.runner, llm.scheduler.cache
    cfg, state, bs = runner.cfg, runner.state, runner.layout.block_size
    slot, table = cache.slot(req_id), torch.tensor(cache.block_table(req_id), dtype=torch.long)
    length = llm.scheduler.requests[req_id].num_computed_tokens

    def ring(t, lo):
        pos = torch.arange(lo, length)
        return t, (torch.full_like(pos, slot), pos % t.shape[1])

    def entries(pool, m):
        w = torch.arange(length // m)
        return pool, (table[w * m // bs], (w * m % bs) // m)
    swa_lo = max(0, length - cfg.sliding_window + 1)
    out = {}
    for i, (kind, st) in enumerate(zip(cfg.layer_types, state.layers)):
        out[f"layer{i}.swa"] = ring(st.swa, swa_lo)
        if kind not in (CSA, HCA):
            continue
        m = cfg.csa_ratio if kind == CSA else cfg.hca_ratio
        lo = max(0, m * (length // m) - (m if kind == CSA else 0))
        names = ("kv_rows", "gate_rows", "idx_kv_rows", "idx_gate_rows") if kind == CSA else ("kv_rows", "gate_rows")
        for name in names:
            out[f"layer{i}.{name}"] = ring(getattr(st, name), lo)
        out[f"layer{i}.entries"] = entries(st.entries, m)
        if kind == CSA:
            out[f"layer{i}.idx_keys"] = entries(st.idx_keys, m)
    for j, st in enumerate(state.mtp):
        out[f"mtp{j}.swa"] = ring(st.swa, swa_lo)
    return out


def live_state(llm, req_id: str) -> Dict[str, torch.Tensor]:
    """Copies of the request's readable state (see ``live_locations``) and its length."""
    out = {name: t[idx].clone() for name, (t, idx) in live_locations(llm, req_id).items()}
    out["length"] = torch.tensor(llm.scheduler.requests[req_id].num_computed_tokens)
    return out


@torch.no_grad()
def poison_dead_state(llm, req_id: str) -> int:
    """Fill with NaN every state value of the engine that ``live_locations`` does not list for
    ``req_id`` (other slots, rolled-back ring rows, entries of rejected positions, free blocks);
    a later read of any of them shows up as NaN. Returns how many values were poisoned."""
    where = live_locations(llm, req_id)
    saved = {name: t[idx].clone() for name, (t, idx) in where.items()}
    total = 0
    for st in llm.runner.state.layers + llm.runner.state.mtp:
        for t in st.tensors():
            total += t.numel()
            t.fill_(float("nan"))
    for name, (t, idx) in where.items():
        t[idx] = saved[name]
    return total - sum(v.numel() for v in saved.values())


def oracle_hook(prompts, ref):
    """Draft hook: the plain run's tokens at the drafted positions, every third position wrong."""
    def hook(rid, first_pos, drafts):
        out = ref[rid].token_ids
        start = first_pos - len(prompts[rid])
        got = []
        for j in range(len(drafts)):
            i = start + j
            tok = out[i] if 0 <= i < len(out) else 7
            got.append(tok + 1 if (first_pos + j) % 3 == 0 else tok)
        return got
    return hook
