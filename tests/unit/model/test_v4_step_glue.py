"""The V4 tensor-only decode step computes its compressors' index tensors once per step and shape (not once per
compressor), and ``benchmarks/v4_step_ops.py`` counts the step's ops."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_compressor_decode_rows_once_per_step_and_shape(monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import v4_step_ops

    from redknot.kernels import ref_attention, registry  # noqa: F401  (ref_attention registers the reference op)
    calls = []
    real = registry._OPS["compressor_decode_rows"]["reference"]

    def spy(positions, seq_slots, block_tables, ring_len, ratio, overlap, per_block, rope_inv):
        calls.append((ring_len, ratio, overlap, per_block))
        return real(positions, seq_slots, block_tables, ring_len, ratio, overlap, per_block, rope_inv)

    monkeypatch.setitem(registry._OPS["compressor_decode_rows"], "reference", spy)
    v4_step_ops.count_step("reference", "cpu", 2)   # two tensor-only decode steps of the tiny model
    # the tiny model's compressors: two CSA layers with a kv and an indexer compressor each (ratio 4, overlapping
    # windows) and one HCA layer (ratio 128): per step one call per shape (the kv and the indexer compressors'
    # pools may have their own entries a block)
    shapes = set(calls)
    assert 2 <= len(shapes) <= 3 and len(calls) == 2 * len(shapes), calls
    assert {(r, o) for _, r, o, _ in shapes} == {(4, True), (128, False)}, calls


def test_the_op_count_benchmark_prints_its_table():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "v4_step_ops.py"), "--top", "5"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "model glue" in res.stdout and "| glue ops | source |" in res.stdout


def test_the_indexer_weights_go_in_as_projected_with_the_head_scale_in_the_score_scale(monkeypatch):
    """Index heads a power of four (the tiny model's 16, V4's 64): 1/sqrt(heads) is a power of two, so the indexer
    takes its weights as projected (bf16, no cast or scale launches) and the score scale carries the head scale.
    Every score term is then the same fp32 value as with the weights scaled first: the scores bit for bit, and
    the selections, of each call the model makes (prefill and decode, bf16)."""
    import torch

    from redknot.kernels import KernelSet, ref_attention, registry
    from redknot.models.deepseek_v4.model import DeepseekV4
    from redknot.models.deepseek_v4.state import V4State
    from redknot.models.deepseek_v4.state_layout import StateLayout
    from redknot.models.deepseek_v4.synthetic import TINY_ARCHITECTURE, randomize_, synthetic_config
    from redknot.step.metadata import StepMetadata

    cfg = synthetic_config(TINY_ARCHITECTURE, quantize_fp8=False)
    heads = cfg.index_n_heads
    calls = []
    real = registry._OPS["indexer_topk"]["reference"]

    def spy(q, weights, key_pool, meta, ratio, topk, scale, *rest):
        calls.append((q, weights, key_pool.clone(), meta, ratio, topk, scale))
        return real(q, weights, key_pool, meta, ratio, topk, scale, *rest)

    monkeypatch.setitem(registry._OPS["indexer_topk"], "reference", spy)
    model = DeepseekV4(cfg, torch.bfloat16, device="cpu", kernels=KernelSet("reference"), with_mtp=False)
    randomize_(model, seed=5)
    model.fuse_projections()
    layout = StateLayout.create(cfg, block_size=128, kv_bytes=2)
    state = V4State.allocate(cfg, layout, 1, layout.blocks_for(80), "cpu", torch.bfloat16)
    tables = [list(range(layout.blocks_for(80)))]
    ids = [3 + (11 * i) % (cfg.vocab_size - 3) for i in range(72)]
    model(StepMetadata.build([ids], [0], [0], tables, device="cpu"), state)
    model(StepMetadata.build([[5]], [72], [0], tables, device="cpu"), state)
    assert len(calls) >= 2
    g = torch.Generator().manual_seed(0)
    for q, w, pool, meta, ratio, topk, scale in calls:
        assert w.dtype == torch.bfloat16 and scale == cfg.index_head_dim ** -0.5 * heads ** -0.5
        keys = torch.randn(50, q.shape[-1], generator=g)
        base = torch.relu(torch.einsum("qhd,ed->qhe", q.float(), keys))
        folded = (base * scale * w.float().unsqueeze(-1)).sum(1)
        scaled_first = (base * (cfg.index_head_dim ** -0.5) * (w.float() * heads ** -0.5).unsqueeze(-1)).sum(1)
        assert torch.equal(folded, scaled_first)
        assert not torch.equal(folded, (base * scale * (w.float() * 1.01).unsqueeze(-1)).sum(1))  # it can fail
        assert torch.equal(ref_attention.indexer_topk(q, w, pool, meta, ratio, topk, scale),
                           ref_attention.indexer_topk(q, w.float() * heads ** -0.5, pool, meta, ratio, topk,
                                                      cfg.index_head_dim ** -0.5))
