"""The public engine API: generate, add_request/step/abort, outputs, metrics, stats, errors."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
from llm_testutil import run_all

from redknot.config.schema import Accelerator, FeaturesConfig, HardwareConfig
from redknot.engine import SamplingParams

REPO = Path(__file__).resolve().parents[3]


def test_generate_strings_and_token_lists(engines):
    llm = engines()
    outs = llm.generate(["Hello, world", [0, 5, 6, 7], "x"], SamplingParams(max_tokens=4, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [4, 4, 4]
    assert outs[0].prompt_token_ids[0] == llm.tokenizer.bos_id
    assert outs[0].prompt_token_ids[1:] == llm.tokenizer.encode("Hello, world")
    assert outs[1].prompt_token_ids == [0, 5, 6, 7]
    assert outs[2].text == llm.tokenizer.decode(outs[2].token_ids)
    single = llm.generate("Hello, world", SamplingParams(max_tokens=4, ignore_eos=True))
    assert single[0].token_ids == outs[0].token_ids
    with pytest.raises(ValueError, match="3 prompts but 2 SamplingParams"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()])


def test_step_api_metrics_and_stats(engines):
    llm = engines()
    before = llm.stats().num_steps, llm.stats().num_prefill_tokens, llm.stats().num_decode_tokens
    llm.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=6, ignore_eos=True))
    llm.add_request("b", [3, 4, 5], SamplingParams(max_tokens=3, ignore_eos=True))
    seen = {"a": [], "b": []}
    finals = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            seen[out.req_id].append(len(out.token_ids))
            if out.finished:
                finals[out.req_id] = out
    assert seen["b"] == [1, 2, 3] and seen["a"][-1] == 6  # incremental outputs, then the final one
    for out in finals.values():
        m = out.metrics
        assert m.arrival_time <= m.scheduled_time <= m.first_token_time <= m.finish_time
        assert (m.num_prompt_tokens, m.num_output_tokens) == (len(out.prompt_token_ids), len(out.token_ids))
    stats = llm.stats()
    assert stats.num_steps > before[0]
    assert stats.num_prefill_tokens - before[1] == 37 + 3
    assert stats.num_decode_tokens - before[2] == 5 + 2  # the first token comes from the prefill step
    assert stats.cache_blocks_peak_used >= 3


def test_abort_running_and_waiting(engines):
    llm = engines(max_num_seqs=1)
    llm.add_request("run", [3, 4, 5], SamplingParams(max_tokens=50, ignore_eos=True))
    llm.add_request("wait", [3, 4, 5], SamplingParams(max_tokens=50, ignore_eos=True))
    llm.step()
    llm.step()
    llm.abort("run")
    llm.abort("wait")
    llm.abort("unknown")  # already gone: nothing happens
    outs = {o.req_id: o for o in llm.step()}
    assert outs["run"].finish_reason == "abort" and outs["run"].finished and len(outs["run"].token_ids) == 2
    assert outs["wait"].finish_reason == "abort" and outs["wait"].token_ids == []
    assert not llm.has_unfinished_requests()


def test_bad_requests_are_refused_with_the_field(engines):
    llm = engines()
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        llm.add_request("e", [], SamplingParams())
    with pytest.raises(ValueError, match=r"prompt_token_ids has \[129280\]"):
        llm.add_request("v", [1, 129280], SamplingParams())
    with pytest.raises(ValueError, match="max_position=1024"):
        llm.add_request("long", [5] * 1024, SamplingParams())
    llm.add_request("dup", [5], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="already in the engine"):
        llm.add_request("dup", [5], SamplingParams(max_tokens=1))
    run_all(llm, {}, SamplingParams())


def test_device_mismatch_names_device_and_fitting_option(model_cfg, cache_dir):
    from redknot.engine import LLM
    hw = HardwareConfig(name="sm90-port", accelerator=Accelerator.cuda, compute_capability=["9.0"])
    with pytest.raises(RuntimeError, match=r"hardware=sm90-port needs accelerator cuda.*this machine has "
                                           r"no accelerator.*hardware=cpu"):
        LLM(model_cfg, hw, FeaturesConfig())


def test_engine_imports_no_harness_hydra_or_mlflow():
    code = "import sys, redknot.engine.llm; print(sorted(m for m in sys.modules if m.split('.')[0] in " \
           "('hydra', 'mlflow') or m.startswith('redknot.bench')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


def test_offline_inference_example_runs(tmp_path):
    cmd = [sys.executable, str(REPO / "examples" / "offline_inference.py"), f"output.root={tmp_path}",
           "engine.scheduler.num_cache_blocks=64", "model.max_position=8192"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # tiny GEMMs; immune to oversubscribed CI cores
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 4 and "EngineStats(" in lines[-1]
    assert "[stop," in lines[2] or "[length," in lines[2]
    assert any((tmp_path / "cache").iterdir())  # the synthetic model went under output.root


def test_generate_refuses_bytes_and_none_naming_the_type(engines):
    llm = engines()
    with pytest.raises(TypeError, match=r"got bytes \(decode bytes to str first"):
        llm.generate(b"Capital of France?", SamplingParams(max_tokens=1))
    with pytest.raises(TypeError, match="got NoneType"):
        llm.generate(None, SamplingParams(max_tokens=1))
    with pytest.raises(TypeError, match="got bytes"):
        llm.generate(["fine", b"not fine"], SamplingParams(max_tokens=1))
    assert not llm.has_unfinished_requests()  # nothing was queued


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_sampling_params_refuse_non_finite_numbers(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        SamplingParams(**{field: value})
