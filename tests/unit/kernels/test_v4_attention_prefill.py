"""The transposed prefill kernel of V4's ``sparse_attention_paged`` (``attention_prefill``) against the float64
oracle on fresh random inputs: toy widths under Triton's CPU interpreter (the window alone, top-k lists with -1
pads, every visible entry, the fused inverse RoPE; a query with no compressed entry; key lists that are no
multiple of the block; rows from the ring and from this step), one launch at V4 width (64 heads x 512, window
128, 512 top-k entries: what ``tools/sm90_compile.py`` compiles for sm_90a), the tuner's candidates and the
first-use guard, and real sizes on the GPU (``-m gpu``). Tolerance 1e-2 norm-wise (bf16 rows and
probabilities; measured ~2e-3)."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels.triton import attention, oracle
from redknot.kernels.triton import attention_prefill as prefill
from redknot.kernels.triton.attention import PrefillTConfig

CANDIDATES = [c for c in attention.ATTN_PREFILL_TUNER.candidates if isinstance(c, PrefillTConfig)]
# interpreter-sized shapes: every column split, row pointers in step and a block ahead, 16 heads per program
SHAPES = [PrefillTConfig(16, 4, 1, 16), PrefillTConfig(32, 4, 2, 16, prefetch=True), PrefillTConfig(16, 4, 4, 16),
          PrefillTConfig(32, 4, 4, 16, prefetch=True)]
TOY = {"heads": 5, "dim": 64, "window": 8, "ratio": 4, "block_size": 16, "topk": 7, "ctx": 37, "new": 3}


def _fresh_seed() -> int:
    return int(torch.randint(0, 2 ** 31 - 1, (), generator=torch.Generator().manual_seed(torch.seed())).item())


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def _oracle(args: dict) -> torch.Tensor:
    return oracle.sparse_attention_paged(**{k: v for k, v in args.items() if k != "out"})


def test_the_prefill_tuner_offers_the_transposed_kernel():
    assert CANDIDATES, "no attention_prefill launch shape among the prefill tuner's candidates"
    assert all(c.block_n == 64 * c.num_warps // 4 for c in CANDIDATES)  # one 64-key slice per warpgroup
    assert attention.ATTN_PREFILL_TUNER.candidates[:len(attention.ATTN_TUNER.candidates)] == \
        attention.ATTN_TUNER.candidates  # the earlier shapes stay candidates: the faster one is kept


@pytest.mark.parametrize("comp", ["topk", "all", "none"])
@pytest.mark.parametrize("rope", [False, True], ids=["plain", "inv-rope"])
@pytest.mark.parametrize("cfg", SHAPES, ids=str)
def test_prefill_kernel_matches_oracle(comp, rope, cfg, kernel_device):
    seed = _fresh_seed()
    args = prefill.check_inputs(kernel_device, seed=seed, comp=comp, rope=rope, **TOY)
    args["out"].fill_(float("nan"))  # poisoned: every row must be written
    got = prefill.launch_prefill_t(cfg, **args)
    assert _rel(got, _oracle(args)) < 1e-2, (cfg, seed)
    # the op with the launch shape as its config runs the same kernel
    same = attention.sparse_attention_paged(**{**args, "out": None}, config=cfg)
    assert torch.equal(same, got)


def test_prefill_kernel_without_sinks(kernel_device):
    seed = _fresh_seed()
    args = prefill.check_inputs(kernel_device, seed=seed, comp="topk", **TOY)
    args["sink"] = None
    assert _rel(prefill.launch_prefill_t(SHAPES[2], **args), _oracle(args)) < 1e-2, seed


def test_a_query_without_entries_equals_the_window_alone(kernel_device):
    """The second sequence's query (position 1) sees no compressed entry: its row is the window-only result."""
    seed = _fresh_seed()
    args = prefill.check_inputs(kernel_device, seed=seed, comp="topk", **TOY)
    assert bool((args["topk"][-1] < 0).all())
    got = prefill.launch_prefill_t(SHAPES[0], **args)[-1].clone()
    args["cache"] = args["block_table"] = args["topk"] = None
    assert torch.equal(got, prefill.launch_prefill_t(SHAPES[0], **args)[-1])


def test_the_tolerance_sees_a_dropped_entry(kernel_device):
    """The bound is tight enough to fail: the oracle without one query's compressed entries, or with the sinks
    moved by 2, is far outside it."""
    args = prefill.check_inputs(kernel_device, seed=_fresh_seed(), comp="topk", **TOY)
    got = prefill.launch_prefill_t(SHAPES[1], **args)
    cut = dict(args, topk=args["topk"].clone())
    cut["topk"][1] = -1
    assert _rel(got, _oracle(cut)) > 1e-2
    assert _rel(got, _oracle(dict(args, sink=args["sink"] + 2))) > 1e-2


@pytest.mark.parametrize("cfg", CANDIDATES, ids=str)
def test_prefill_kernel_at_v4_width(cfg, kernel_device):
    """Queries at V4 width (64 heads x 512, window 128, 512 top-k entries over 5 blocks of 128 keys): the launch
    the sm_90a compile check sees at real sizes."""
    seed = _fresh_seed()
    args = prefill.check_inputs(kernel_device, seed=seed, topk=512, ctx=2100, new=1, block_size=256)
    got = prefill.launch_prefill_t(cfg, **args)
    assert _rel(got, _oracle(args)) < 1e-2, (cfg, seed)


def test_first_use_check_accepts_the_kernel_and_refuses_a_wrong_one(monkeypatch, kernel_device):
    """The guard the tuner relies on: a launch shape passes on fresh inputs at V4 width, a kernel that drops its
    compressed entries does not, and the op then refuses that shape (so the tuner skips it)."""
    cfg = CANDIDATES[0]
    monkeypatch.setattr(prefill, "_FIRST_USE", {})
    assert prefill.first_use_ok(cfg, torch.device(kernel_device))
    monkeypatch.setattr(prefill, "_FIRST_USE", {})
    real = prefill.launch_prefill_t
    monkeypatch.setattr(prefill, "launch_prefill_t",
                        lambda c, **a: real(c, **dict(a, cache=None, block_table=None, topk=None)))
    assert not prefill.first_use_ok(cfg, torch.device(kernel_device))
    if kernel_device == "cuda":
        args = prefill.check_inputs(kernel_device, seed=_fresh_seed(), **TOY)
        with pytest.raises(RuntimeError, match="first-use check"):
            attention.sparse_attention_paged(**{**args, "out": None}, config=cfg)


@pytest.mark.parametrize("comp,rope", [("none", False), ("all", True)])
def test_first_use_check_of_each_compiled_form(comp, rope, monkeypatch, kernel_device):
    """The guard checks the form the call runs (window only, every visible entry, fused RoPE), each on its own."""
    monkeypatch.setattr(prefill, "_FIRST_USE", {})
    assert prefill.first_use_ok(CANDIDATES[0], torch.device(kernel_device), rope, comp)
    assert list(prefill._FIRST_USE) == [(CANDIDATES[0], str(torch.device(kernel_device)), rope, comp)]


def test_the_prefill_kernel_refuses_fp32_rows(kernel_device):
    """bf16 rows only (its probabilities are bf16): an fp32 call with the shape as config is refused, so the
    tuner never keeps it for an fp32 class."""
    args = prefill.check_inputs(kernel_device, seed=_fresh_seed(), dtype=torch.float32, **TOY)
    with pytest.raises(ValueError, match="bf16"):
        attention.sparse_attention_paged(**{**args, "out": None}, config=SHAPES[0])


@pytest.mark.parametrize("mode", ["csa", "hca"])
def test_the_chunk_arguments_of_the_gpu_cases_at_toy_dims(mode, kernel_device):
    """``checks.common.prefill_attention_args`` (the chunk the GPU cases below and the Gluon kernel's run) at toy
    dims: a transposed launch on them matches the oracle, and the compressed lists hold visible entries only."""
    from redknot.kernels.triton.checks.common import TOY as d
    from redknot.kernels.triton.checks.common import prefill_attention_args
    gen = torch.Generator().manual_seed(_fresh_seed())
    args = prefill_attention_args(d, mode, 96, 40, kernel_device, gen)
    ratio = d.csa_ratio if mode == "csa" else d.hca_ratio
    assert bool((args["topk"] < ((args["positions"][:, None] + 1) // ratio)).all())
    want = _oracle({**args, "out": None})
    got = attention.sparse_attention_paged(**args, config=SHAPES[2])
    assert _rel(got, want) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["csa", "hca"])
def test_prefill_kernel_at_real_size_on_the_gpu(mode):
    """A 4096-query chunk at context 8192 with V4 dims (as ``benchmarks/kernels_v4.py`` times it): every transposed
    launch shape passes its first-use check and matches the float64 oracle on 128 sampled queries and the
    earlier kernel on all of them; the tuned op stays within bound."""
    from redknot.kernels.triton.checks.common import REAL, prefill_attention_args
    gen = torch.Generator().manual_seed(_fresh_seed())
    args = prefill_attention_args(REAL, mode, 8192, 4096, "cuda", gen)
    t = args["q"].shape[0]
    base = attention.sparse_attention_paged(**args, config=attention.AttnConfig(num_stages=2))
    rows = torch.randperm(t, generator=gen)[:128].cuda()
    sub = dict(args, q=args["q"][rows], positions=args["positions"][rows], token_seq=args["token_seq"][rows],
               topk=args["topk"][rows])
    want = oracle.sparse_attention_paged(**sub)
    for cfg in CANDIDATES:
        assert prefill.first_use_ok(cfg, torch.device("cuda")), cfg
        got = attention.sparse_attention_paged(**args, config=cfg)
        assert _rel(got[rows], want) < 1e-2, cfg
        assert _rel(got, base) < 1e-2, cfg
    assert _rel(attention.sparse_attention_paged(**args)[rows], want) < 1e-2
