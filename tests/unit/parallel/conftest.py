"""Parallel tests: a small synthetic V4 (every layer type, hash + learned routing, 8 experts, top-2),
worlds of 2 and 4 CPU processes started by torchrun (gloo), and single-process references."""
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .world_main import build, drive, record

HERE = Path(__file__).resolve().parent
ARCH = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=32, qk_rope_head_dim=16,
            q_lora_rank=32, o_groups=2, o_lora_rank=32, index_n_heads=8, index_head_dim=16, index_topk=4,
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_hash_layers=1,
            compress_ratios=[0, 4, 8, 4, 0], compress_rate_hca=8, sliding_window=16, max_position_embeddings=4096)
# Long prompts get split by context parallel (>= 2*cp*8 tokens), short ones and decodes go whole.
PROMPT_LENGTHS = [70, 12, 45, 90, 23, 5]
MAX_TOKENS = 5


def make_spec(cache_dir: str, scenarios: list, out: str, cuda: bool = False) -> dict:
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(3, 120000) for _ in range(n)] for i, n in enumerate(PROMPT_LENGTHS)}
    return dict(arch=ARCH, prompts=prompts, max_tokens=MAX_TOKENS, budget=256, chunk=128, max_len=512,
                cache_dir=cache_dir, out=out, scenarios=scenarios, cuda=cuda)


def single_process(spec: dict, invariant: bool):
    """(outputs, logits rows per request) of the plain one-process engine."""
    sc = dict(name="ref", dp=1, ep=1, cp=1, batch_invariant=invariant)
    llm = build(spec, sc)
    assert type(llm).__name__ == "LLM"  # sizes 1 in one process: the plain engine
    logits = {}
    record(llm, logits)
    try:
        return drive(llm, sc, spec["prompts"], spec["max_tokens"]), logits
    finally:
        llm.close()


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("parallel-model"))


@pytest.fixture(scope="session")
def reference(model_cache, tmp_path_factory):
    """One process, parallel sizes 1: {batch_invariant: (outputs, logits rows per request)}.
    Also writes the synthetic checkpoint the worlds then load."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    spec = make_spec(model_cache, [], str(tmp_path_factory.mktemp("ref")))
    try:
        return {invariant: single_process(spec, invariant) for invariant in (True, False)}
    finally:
        torch.set_num_threads(before)


def run_world(nproc: int, scenarios: list, cache_dir: str, out: Path, timeout: int = 600, cuda: bool = False) -> list:
    """Start ``nproc`` ranks of world_main.py under torchrun; -> each rank's results."""
    out.mkdir(parents=True, exist_ok=True)
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(make_spec(cache_dir, scenarios, str(out), cuda)))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(HERE / "world_main.py"), str(spec_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(nproc)]
