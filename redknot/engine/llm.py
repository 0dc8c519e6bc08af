"""LLM: the public engine API (offline batched generation and a step-wise interface)."""
from __future__ import annotations

import itertools
import logging
import random
import time
from typing import Dict, List, Optional, Sequence, Union

from redknot.cache import StateCacheManager
from redknot.config.schema import EngineConfig, FeaturesConfig, HardwareConfig, ModelConfig, StructuredOutputBackend
from redknot.engine.core import EngineCore
from redknot.engine.device import peak_memory_bytes, select_device
from redknot.engine.model_runner import ModelRunner, engine_kernels
from redknot.engine.output_processor import OutputProcessor
from redknot.engine.outputs import EngineStats, RequestOutput
from redknot.engine.request import FinishReason, Request, RequestTimes
from redknot.engine.scheduler import Scheduler
from redknot.kernels import KernelSet
from redknot.models.family import ExpertRows
from redknot.models.registry import family_for
from redknot.parallel.layout import needs_parallel
from redknot.sample import GrammarError, StructuredOutputManager
from redknot.sample.params import SamplingParams

log = logging.getLogger(__name__)

Prompt = Union[str, Sequence[int]]


def _check_prompts(prompts) -> None:
    """Refuse what ``generate`` would misread: bytes (a sequence of ints, taken for token ids), None, scalars."""
    def bad(p) -> bool:
        return isinstance(p, (bytes, bytearray, memoryview)) or p is None or not isinstance(p, (str, Sequence))

    if bad(prompts) or (not isinstance(prompts, str) and any(bad(p) for p in prompts if not isinstance(p, int))):
        shown = prompts if bad(prompts) else next(p for p in prompts if not isinstance(p, int) and bad(p))
        raise TypeError(f"generate: prompts must be a string, a list of token ids, or a list of those; got "
                        f"{type(shown).__name__}" + (" (decode bytes to str first, e.g. data.decode('utf-8'))"
                                                     if isinstance(shown, (bytes, bytearray, memoryview)) else ""))


class LLM:
    """The inference engine of one process.

    ``LLM(model, hardware, features, engine)`` finds the model's family
    (:func:`redknot.models.registry.family_for`), loads the model on the device
    the hardware option names (checked against what torch sees), sizes the state
    cache and starts serving. ``generate`` runs a batch to completion;
    ``add_request`` / ``step`` / ``abort`` drive it one step at a time.
    String prompts are encoded with the model's tokenizer and start with BOS.
    A multi-process layout is built by :func:`redknot.engine.build_engine`.
    """

    # Whether this class serves one rank of a multi-process layout (redknot.parallel's engine).
    multi_process = False

    def __init__(self, model: ModelConfig, hardware: HardwareConfig, features: FeaturesConfig,
                 engine: Optional[EngineConfig] = None, kernels: Optional[KernelSet] = None,
                 expert_rows: Optional[ExpertRows] = None) -> None:
        if not self.multi_process and needs_parallel(features.parallel):
            par = features.parallel
            raise ValueError(f"features.parallel (dp={par.dp}, cp={par.cp}, ep={par.ep}) or the launched world asks "
                             f"for more than one process; LLM serves one process: build the engine with "
                             f"redknot.engine.build_engine(model, hardware, features, engine)")
        engine = engine or EngineConfig()
        self.model_config, self.hardware, self.features, self.engine_config = model, hardware, features, engine
        self.device = select_device(hardware)
        self.kernels = engine_kernels(hardware, features, kernels)
        self.family = family_for(model)
        self.tokenizer = self.family.load_tokenizer(model)
        self.runner = ModelRunner(self.family, model, hardware, features, engine, self.kernels, self.device,
                                  expert_rows=expert_rows)
        plan = self.runner.plan
        cache = StateCacheManager(self.runner.cache_spec, plan.num_slots, plan.num_blocks)
        self.scheduler = Scheduler(engine.scheduler, cache, max_model_len=model.max_position,
                                   eos_token_id=self.tokenizer.eos_id)
        self.structured: Optional[StructuredOutputManager] = None
        if features.structured_output.backend == StructuredOutputBackend.xgrammar:
            self.structured = StructuredOutputManager(self.tokenizer, self.runner.vocab_size, [self.tokenizer.eos_id])
        self._outputs = OutputProcessor(self.tokenizer, self.scheduler)
        # A DSpark step's drafts are needed to schedule the request's next step, so drafting
        # runs the steps synchronously (the one-step-lag pipeline would schedule without them).
        async_scheduling = features.async_scheduling and self.runner.speculator is None
        if features.async_scheduling and not async_scheduling:
            log.info("features.dspark is on: engine steps run synchronously (async_scheduling is not used)")
        self._core = EngineCore(self.scheduler, self.runner, self._outputs, self.structured,
                                async_scheduling=async_scheduling)
        self._seed_rng = random.Random(engine.seed)
        self._arrivals = itertools.count()
        self._gen_ids = itertools.count()
        self.runner.warmup()

    # ------------------------------------------------------------------ step-wise API
    def add_request(self, req_id: str, prompt_token_ids: Sequence[int], params: Optional[SamplingParams] = None) -> None:
        """Queue a request. Bad prompts raise ValueError; a grammar that does not compile
        fails only this request (its output, with the compiler's message, comes from ``step``)."""
        params = params or SamplingParams()
        ids = self._check_prompt(req_id, prompt_token_ids)
        req = Request(req_id=req_id, prompt_token_ids=ids, params=params, arrival_seq=next(self._arrivals),
                      times=RequestTimes(arrival=time.perf_counter()), seed=self._seed_for(params))
        grammar, error = self._grammar_for(params)
        self.scheduler.add_request(req)
        self._outputs.add(req, grammar)
        if error is not None:
            self.scheduler.finish_request(req_id, FinishReason.ERROR, error)
            self._core.report(self._outputs.output(req, time.perf_counter()))

    def step(self) -> List[RequestOutput]:
        """Run one engine step; returns outputs of requests that progressed or finished."""
        return self._core.step()

    def has_unfinished_requests(self) -> bool:
        return self._core.has_unfinished()

    def abort(self, req_id: str) -> None:
        """Stop a request; its final output (finish_reason "abort") comes from the next ``step``."""
        req = self.scheduler.finish_request(req_id, FinishReason.ABORT)
        if req is not None:
            self._core.report(self._outputs.output(req, time.perf_counter()))

    def stats(self) -> EngineStats:
        s = self._core.stats
        s.peak_memory_bytes = peak_memory_bytes(self.device)
        s.num_cuda_graph_steps = self.runner.num_graph_replays
        s.cuda_graphs = self.runner.cuda_graphs_status
        if self.runner.speculator is not None:
            s.spec = self.runner.speculator.stats.snapshot()
        return s

    # ------------------------------------------------------------------ batch API
    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 params: Union[SamplingParams, Sequence[SamplingParams], None] = None) -> List[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); outputs in prompt order."""
        _check_prompts(prompts)
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"generate: {len(prompts)} prompts but {len(params)} SamplingParams")
        ids = []
        for prompt, p in zip(prompts, params):
            ids.append(f"gen-{next(self._gen_ids)}")
            self.add_request(ids[-1], self.encode(prompt), p)
        done: Dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.step():
                if out.finished:
                    done[out.req_id] = out
        return [done[i] for i in ids]

    def encode(self, prompt: Prompt) -> List[int]:
        if isinstance(prompt, str):
            return [self.tokenizer.bos_id] + self.tokenizer.encode(prompt)
        return list(prompt)

    def close(self) -> None:
        self._core.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers
    def _check_prompt(self, req_id: str, prompt_token_ids: Sequence[int]) -> List[int]:
        ids = list(prompt_token_ids)
        vocab = self.runner.vocab_size
        if not ids:
            raise ValueError(f"request {req_id!r}: prompt_token_ids is empty")
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {req_id!r}: prompt_token_ids has {bad[:3]}; token ids must be ints in "
                             f"[0, {vocab})")
        return ids

    def _seed_for(self, params: SamplingParams) -> int:
        """The request's seed: its own, else the engine seed (deterministic mode: every
        unseeded request uses it, so tokens depend only on the request), else a fresh draw."""
        if params.seed is not None:
            return params.seed
        if self.features.deterministic:
            return self.engine_config.seed
        return self._seed_rng.getrandbits(63)

    def _grammar_for(self, params: SamplingParams):
        if params.structured_output is None:
            return None, None
        if self.structured is None:
            raise ValueError("SamplingParams.structured_output needs features.structured_output.backend=xgrammar "
                             "(it is 'none')")
        try:
            return self.structured.new_matcher(params.structured_output), None
        except GrammarError as exc:
            return None, str(exc)
