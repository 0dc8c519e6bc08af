"""Backend selection, signatures and the errors for missing packages (CPU; no vendor package installed)."""
import inspect
import sys
import textwrap

import pytest
import torch

from redknot.kernels import KernelBackendError, KernelSet, ref_attention, registered_ops
from redknot.kernels.registry import _OPS
from redknot.step.metadata import StepMetadata

VENDOR = [("flash_mla", "flash_mla", "sm100"), ("deep_gemm", "deep_gemm", "sm100"),
          ("deep_ep", "deep_ep", "sm100"), ("tilelang", "tilelang", "sm100"), ("torch_npu", "torch_npu", "ascend950")]


@pytest.mark.parametrize("backend,package,extra", VENDOR)
def test_missing_vendor_package_names_package_and_extra(backend, package, extra):
    if __import__("importlib").util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    with pytest.raises(KernelBackendError) as err:
        KernelSet(default="reference", ops={"rms_norm": backend})
    msg = str(err.value)
    assert repr(package) in msg and f".[{extra}]" in msg


def test_vendor_wrappers_import_lazily_and_fail_clearly_on_first_use():
    from redknot.kernels.bindings import ascend, sm100  # importing needs none of the vendor packages

    w = torch.zeros(256, 256).to(torch.float8_e4m3fn)
    with pytest.raises(KernelBackendError, match=r"'deep_gemm'.*\.\[sm100\]"):
        sm100.linear(torch.randn(3, 256), w, torch.ones(2, 2))
    with pytest.raises(KernelBackendError, match=r"'torch_npu'.*\.\[ascend950\]"):
        ascend.rms_norm(torch.randn(3, 8), None, 1e-6)
    x, wf = torch.randn(3, 16), torch.randn(5, 16)  # float weights need no vendor GEMM
    assert torch.equal(sm100.linear(x, wf), torch.nn.functional.linear(x, wf))


def test_flash_mla_wrapper_builds_the_reference_key_set(tmp_path, monkeypatch):
    """A stand-in ``flash_mla`` implementing the documented ``flash_mla_sparse_fwd`` contract (gather the
    indexed rows, -1 = none; softmax with the sink in the denominator) makes the wrapper's row indices
    testable on CPU: the result must equal the reference op."""
    pkg = tmp_path / "flash_mla"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent("""
        import torch

        def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
            idx = indices[:, 0, :].long()
            valid = idx >= 0
            keys = kv[:, 0, :][idx.clamp(min=0)].double()
            logits = torch.einsum("qhd,qkd->qhk", q.double(), keys) * sm_scale
            logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
            lse = torch.logsumexp(logits, -1)
            out = torch.einsum("qhk,qkd->qhd", torch.softmax(logits, -1), keys[..., :d_v])
            if attn_sink is not None:
                out = out / (1 + torch.exp(attn_sink.double()[None, :] - lse))[..., None]
            return out.to(q.dtype), logits.amax(-1), lse
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    from redknot.kernels import bindings
    from redknot.kernels.bindings import sm100
    monkeypatch.setattr(bindings, "_LOADED", {})
    g = torch.Generator().manual_seed(0)
    h, d, window, per_block = 4, 32, 8, 4
    meta = StepMetadata.build([[0] * 5, [0] * 1, [0] * 3], [0, 19, 9], [2, 0, 1], [[4, 1], [0, 3, 6], [5, 2]])
    t = meta.num_tokens
    q, kv = torch.randn(t, h, d, generator=g), torch.randn(t, d, generator=g)
    ring, sinks = torch.randn(3, window + 3, d, generator=g), torch.randn(h, generator=g)
    pool = torch.randn(7, per_block, d, generator=g)
    idx = torch.tensor([[0, -1], [-1, -1], [1, -1], [0, 1], [2, 0], [3, 0], [1, 2], [2, -1], [0, 1]])
    for extra in ((None, None), (pool, idx)):
        got = sm100.sparse_attention(q, kv, ring, sinks, d ** -0.5, window, meta, *extra)
        want = ref_attention.sparse_attention(q, kv, ring, sinks, d ** -0.5, window, meta, *extra)
        assert (got - want).abs().max() < 1e-5


def test_fast_backends_keep_the_reference_signatures():
    pytest.importorskip("triton")
    import redknot.kernels.triton  # noqa: F401  (registers the triton backend)
    from redknot.kernels.bindings import ascend, sm100  # noqa: F401

    checked = 0
    for op, impls in registered_ops().items():
        want = list(inspect.signature(impls["reference"]).parameters)
        for backend, fn in impls.items():
            if backend in ("reference",):
                continue
            assert list(inspect.signature(fn).parameters) == want, (op, backend)
            checked += 1
    assert checked >= 9


def test_triton_kernel_set_resolves_accelerated_ops_and_falls_back_to_reference(monkeypatch):
    pytest.importorskip("triton")
    ks = KernelSet(default="triton")
    fast = {"sparse_attention", "indexer_topk", "moe", "linear", "rms_norm", "rms_norm_rope", "rope", "rope_inplace", "mhc_pre", "mhc_pre_norm", "mhc_post", "mhc_post_pre_norm",
            "compressor", "compressor_decode", "compressor_decode_rows", "rope_cos_sin", "ring_write", "visible_entries", "moe_shared", "grouped_linear", "router_scores", "route", "mhc_head", "act_quant_mx", "linear_mx", "moe_mx", "cache_insert_mx", "sparse_attention_mx",
            "indexer_topk_mx", "indexer_candidates_mx", "indexer_source_mx", "engram_gather_mx"}
    assert {op for op, b in ks.choice.items() if b == "triton"} == fast & set(_OPS)
    assert all(b == "reference" for op, b in ks.choice.items() if op not in fast)
    # every op has a Triton form now: an op registered for the reference alone (the registry's table, patched)
    from redknot.kernels import registry
    monkeypatch.setitem(registry._OPS, "reference_only_op", {"reference": lambda: None})
    with pytest.raises(KernelBackendError, match="no 'triton' implementation"):
        KernelSet(default="reference", ops={"reference_only_op": "triton"})


def test_native_build_explains_what_is_missing_without_cuda():
    from redknot.kernels import native

    if torch.version.cuda is not None and torch.cuda.is_available():
        pytest.skip("a CUDA machine can build the native ops")
    with pytest.raises(KernelBackendError) as err:
        native.load("kv_fp8")
    msg = str(err.value)
    assert "CUDA" in msg and "kv_fp8" in msg
