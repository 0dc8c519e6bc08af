"""Offline batched inference with the Python API.

    python examples/offline_inference.py                       # the tiny V4 model on CPU
    python examples/offline_inference.py model.path=/ckpt hardware=sm90-port

Arguments are Hydra overrides of the run config (conf/config.yaml).
"""
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from redknot import LLM, SamplingParams
from redknot.config.resolve import to_typed

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")

with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
    cfg = to_typed(compose(config_name="config", overrides=sys.argv[1:]))

llm = LLM(cfg.model, cfg.hardware, cfg.features, cfg.engine)
prompts = ["The capital of France is", "List three prime numbers:", "def fibonacci(n):"]
params = [SamplingParams(max_tokens=16),                                   # greedy
          SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=1),  # seeded sampling
          SamplingParams(max_tokens=16, structured_output={"schema_type": "regex", "schema": r"[0-9]{1,3}(, [0-9]{1,3}){2}"})]
for out in llm.generate(prompts, params):
    m = out.metrics
    print(f"{out.prompt_token_ids[:4]}... -> {out.text!r} [{out.finish_reason}, {m.num_output_tokens} tokens, "
          f"ttft {1e3 * (m.first_token_time - m.arrival_time):.1f} ms]")
print(llm.stats())
llm.close()
