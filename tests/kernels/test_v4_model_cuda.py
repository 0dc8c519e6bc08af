"""The V4 reference path on CUDA: fp32 parity with transformers (as on CPU) and device/CPU
agreement of the attention-side reference ops."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "unit", "model"))

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _true_fp32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def test_fp32_parity_with_transformers_on_cuda(tmp_path):
    from v4_testutil import PARITY_CONFIG, hf_model, native_model_from_hf, rel_err
    from redknot.models.deepseek_v4.single import SingleSequence

    hf = hf_model(PARITY_CONFIG, seed=0)
    ids = torch.randint(0, hf.config.vocab_size, (70,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None], use_cache=False).logits[0]
    model = native_model_from_hf(hf, str(tmp_path)).to("cuda")
    full = SingleSequence(model, 70).step(ids.tolist(), all_logits=True)[1].cpu()
    seq = SingleSequence(model, 70, shuffle_blocks=1)
    cuts = [0, 33, 34, 50, 70]
    chunked = torch.cat([seq.step(ids[a:b].tolist(), all_logits=True)[1].cpu() for a, b in zip(cuts, cuts[1:])])
    seq = SingleSequence(model, 70)
    decode = [seq.step(ids[:40].tolist())[1].cpu()] + [seq.step([int(t)])[1].cpu() for t in ids[40:]]
    assert rel_err(full, ref) <= 1e-5
    assert rel_err(chunked, ref) <= 1e-5
    assert rel_err(torch.cat(decode), ref[39:]) <= 1e-5


def test_reference_ops_agree_between_cuda_and_cpu():
    from redknot.kernels import KernelSet
    from redknot.step.metadata import StepMetadata

    ks = KernelSet()
    g = torch.Generator().manual_seed(0)
    h, d, ring, n, ctx = 8, 64, 20, 50, 30
    q, kv, swa, sinks = (torch.randn(n, h, d, generator=g), torch.randn(n, d, generator=g),
                         torch.randn(1, ring, d, generator=g), torch.randn(h, generator=g))
    pool = torch.randn(6, 8, d, generator=g)
    table = [4, 1, 5, 0, 2, 3]
    idx = torch.randint(-1, 20, (n, 7), generator=g)
    qi, wi = torch.randn(n, 16, 32, generator=g), torch.randn(n, 16, generator=g)
    keys = torch.randn(6, 8, 32, generator=g)

    def run(device):
        meta = StepMetadata.build([[0] * n], [ctx], [0], [table], device=device)
        to = lambda t: t.to(device)  # noqa: E731
        att = ks.sparse_attention(to(q), to(kv), to(swa), to(sinks), 0.125, 16, meta, to(pool), to(idx))
        top = ks.indexer_topk(to(qi), to(wi), to(keys), meta, 2, 10, 0.2)
        return att.cpu(), top.cpu()

    (a_gpu, t_gpu), (a_cpu, t_cpu) = run("cuda"), run("cpu")
    assert torch.allclose(a_gpu, a_cpu, atol=1e-5)
    assert torch.equal(t_gpu, t_cpu)
