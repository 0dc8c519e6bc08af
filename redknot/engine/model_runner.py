"""Model runner: owns the device, the model, the state tensors and the sampler.

The model, its state layout and state tensors come from the model's family
(:class:`redknot.models.family.ModelFamily`); each step reaches the model as a
:class:`redknot.step.metadata.StepMetadata`.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

from redknot.cache import CachePlan, CacheSpec, plan_cache
from redknot.config.schema import EngineConfig, FeaturesConfig, HardwareConfig, ModelConfig
from redknot.engine.device import cache_budget_bytes, synchronize
from redknot.engine.inputs import StepInputs
from redknot.engine.messages import ModelRunnerOutput
from redknot.kernels import KernelSet
from redknot.kernels.dtypes import torch_dtype
from redknot.kernels.tuning_cache import use_cache_dir, use_seed, use_small_rows_class
from redknot.models.family import ExpertRows, ModelFamily
from redknot.sample import Sampler, SamplingRow
from redknot.speculative.dspark import DSparkSpeculator
from redknot.speculative.replay import CompactReplay
from redknot.step.overlap import use_side_stream

log = logging.getLogger(__name__)


@dataclass
class StepBatch:
    """Everything one launch needs: the inputs, one sampling row per logits row, the grammar mask."""
    inputs: StepInputs
    rows: List[SamplingRow]
    bitmask: Optional[torch.Tensor] = None


def engine_kernels(hardware: HardwareConfig, features: FeaturesConfig,
                   kernels: Optional[KernelSet] = None) -> KernelSet:
    """The kernel set the engine runs: the hardware's, with the batch-invariant backend
    taking over every op it implements when ``features.batch_invariant.enabled``."""
    if kernels is None:
        kernels = KernelSet(hardware.kernels.default, dict(hardware.kernels.ops))
    if not features.batch_invariant.enabled:
        return kernels
    from redknot.kernels.batch_invariant import BACKEND, OPS
    ops = {op: b for op, b in kernels.choice.items() if b != kernels.default}
    ops.update({op: BACKEND for op in OPS})
    return KernelSet(kernels.default, ops)


class ModelRunner:
    """Builds the model and its state on ``device``; runs one step at a time.

    ``execute`` is the only method that touches the device during serving, so it
    can run on a worker thread while the host prepares the next step.
    """

    def __init__(self, family: ModelFamily, model_cfg: ModelConfig, hardware: HardwareConfig,
                 features: FeaturesConfig, engine: EngineConfig, kernels: KernelSet, device: torch.device,
                 expert_rows: Optional[ExpertRows] = None) -> None:
        self.family = family
        self.device = device
        self.kernels = kernels
        if device.type == "cuda":  # a layout whose weights cannot fit is refused before any is read
            props = torch.cuda.get_device_properties(device)
            family.check_memory(model_cfg, hardware, features, device_bytes=props.total_memory,
                                device_name=props.name)
        use_cache_dir(engine.cache_dir, engine.kernel_tuning_store)  # launch choices persist with the caches
        use_seed(engine.kernel_tuning_seed)  # shipped launch choices for the same GPU and versions
        # a row's bits must not depend on how many rows share its step: one weight-stream class for all. The
        # switch is process-wide and engines may share a process (mode=compare, tests): each applies its own
        # before every step, graph capture and profile (``_own_kernel_switches``), not only here.
        self._small_rows_class = not (features.batch_invariant.enabled or features.deterministic)
        self._side_stream_tokens = hardware.side_stream_max_tokens   # CPU rows never fork (overlap.concurrent)
        self._own_kernel_switches()
        self.model = family.build_model(model_cfg, hardware, engine.cache_dir, kernels=kernels, device=device,
                                        expert_rows=expert_rows)
        self.cfg = self.model.cfg
        self.max_model_len = model_cfg.max_position
        self.max_num_seqs = engine.scheduler.max_num_seqs
        par = features.parallel
        self.parallel = par.dp > 1 or par.ep > 1 or par.cp > 1
        self.max_num_batched_tokens = engine.scheduler.max_num_batched_tokens
        self.vocab_size = self.cfg.vocab_size
        self.dtype = torch_dtype(hardware.dtype)
        kv_dtype = torch_dtype(hardware.kv_cache_dtype)
        self.layout = family.state_layout(self.cfg, block_size=engine.scheduler.block_size,
                                          max_backtrack=features.dspark.effective_max_draft,
                                          kv_bytes=torch.empty((), dtype=kv_dtype).element_size())
        self.cache_spec = CacheSpec.from_layout(self.layout)
        self.plan: CachePlan = plan_cache(
            self.cache_spec, max_num_seqs=engine.scheduler.max_num_seqs, max_model_len=model_cfg.max_position,
            budget_bytes=cache_budget_bytes(device, hardware.memory_utilization),
            num_blocks=engine.scheduler.num_cache_blocks)
        # One spare slot and block beyond the plan: padding rows of captured decode graphs write there.
        self.state = family.allocate_state(self.cfg, self.layout, num_slots=self.plan.num_slots + 1,
                                           num_blocks=self.plan.num_blocks + 1, device=device, dtype=kv_dtype)
        log.info("state cache: %s (%s)", self.plan.describe(), self.layout.describe())
        invariant = features.batch_invariant.enabled or features.deterministic
        self.sampler = Sampler(device, row_by_row=invariant)
        self.record_logits = False
        # (StepBatch, logits [N, V]) -> {req_id: accepted drafts + bonus token}; set by speculative decoding.
        self.verifier: Optional[Callable[[StepBatch, torch.Tensor], Dict[str, List[int]]]] = None
        # Speculative decoding and compact SWA replay (redknot.speculative); None when off.
        self.replay = CompactReplay.from_features(features, self.cfg)
        self.speculator = DSparkSpeculator.create(family.draft_models(self.model), self.state, self.sampler, features,
                                        self.max_model_len, self.replay)
        if self.speculator is not None:
            self.verifier = self.speculator.verify
        self.graphs = None
        self.verify_graphs = None   # DSpark: decode + verify steps by total-token tier (speculative.varlen)
        self.graph_pool = None      # the memory pool every captured graph of this runner shares
        self.graph_max_len = min(hardware.cuda_graph_max_len, self.max_model_len)
        self._max_draft = features.dspark.effective_max_draft
        if hardware.cuda_graphs and device.type == "cuda" and self.speculator is None:
            from redknot.engine.cuda_graphs import DecodeGraphs
            self.graphs = DecodeGraphs(self, max_batch=engine.scheduler.max_num_seqs, max_len=self.graph_max_len)
        elif hardware.cuda_graphs and device.type == "cuda":
            from redknot.engine.cuda_graphs import CudaGraphCapture
            self.use_verify_graphs(CudaGraphCapture())
            # DSpark: the draft's block forward per batch tier (the drafter's graphs, captured at warm-up)
            self.speculator.use_draft_graphs(CudaGraphCapture(), self.max_num_seqs, self.padding_slot)

    def use_verify_graphs(self, capture):
        """Run decode and verify steps of DSpark drafting through :class:`VerifyGraphs` recorded with
        ``capture`` (CUDA graphs; tests pass the host stand-in); captured by :meth:`warmup`, or here
        when the runner has warmed up already. The drafter's taps are outputs of every graph."""
        from redknot.speculative.varlen import VerifyGraphs

        taps = ()
        if self.speculator is not None:
            dcfg = getattr(getattr(self.speculator.drafter, "draft", None), "dcfg", None)
            taps = tuple(dcfg.target_layer_ids) if dcfg is not None else ()
        self.verify_graphs = VerifyGraphs(self, max_num_seqs=self.max_num_seqs, block=self._max_draft,
                                          capture=capture, tap_layers=taps, max_len=self.graph_max_len)
        return self.verify_graphs

    def _own_kernel_switches(self) -> None:
        use_small_rows_class(self._small_rows_class)
        use_side_stream(self._side_stream_tokens)

    @property
    def padding_slot(self) -> int:
        return self.plan.num_slots

    @property
    def padding_block(self) -> int:
        return self.plan.num_blocks

    def execute(self, batch: StepBatch) -> ModelRunnerOutput:
        """Run the model on the step, sample every logits row, wait for the device."""
        inputs = batch.inputs
        out = ModelRunnerOutput(step_id=inputs.sched.step_id)
        if inputs.sched.is_empty:
            out.finish_time = time.perf_counter()
            return out
        t0 = time.perf_counter()
        self._own_kernel_switches()
        streams, logits = self._forward(inputs)  # [T, hc, D] (None after a graph replay), [N, V] fp32
        out.sampled_token_ids = self._sample(batch, logits)
        if self.speculator is not None:  # MTP catch-up and the next step's drafts
            self.speculator.after_step(batch, streams, out, t0)
        synchronize(self.device)  # tokens are on the host already; this also covers logits copies
        if self.record_logits:
            out.logits = self._split_logits(inputs, logits.cpu())
        out.finish_time = time.perf_counter()
        out.execute_time = out.finish_time - t0
        return out

    def _sample(self, batch: StepBatch, logits: torch.Tensor) -> Dict[str, List[int]]:
        """One token per logits row, grouped by request. A step that feeds draft tokens is
        handed to ``self.verifier`` (speculative decoding), which returns the accepted tokens
        plus the bonus token per request; the scheduler rolls back the rest."""
        if any(sr.draft_token_ids for sr in batch.inputs.sched.requests):
            if self.verifier is None:
                raise RuntimeError("draft tokens were scheduled but no verifier is installed (features.dspark)")
            return self.verifier(batch, logits)
        tokens = self.sampler.sample(logits, batch.rows, batch.bitmask) if batch.rows else []
        sampled, i = {}, 0
        for req_id, n in batch.inputs.logits_owners:
            sampled[req_id] = tokens[i:i + n]
            i += n
        return sampled

    def _forward(self, inputs: StepInputs):
        if self.graphs is not None and self.graphs.can_run(inputs):
            return None, self.graphs.run(inputs)
        if self.verify_graphs is not None and self.verify_graphs.can_run(inputs):
            return self.verify_graphs.run(inputs)
        return self.eager_forward(inputs)

    def eager_logits(self, inputs: StepInputs) -> torch.Tensor:
        """Forward + logits of the step, op by op."""
        return self.eager_forward(inputs)[1]

    def eager_forward(self, inputs: StepInputs):
        """-> (pre-head streams [T, hc, D], logits [N, V] fp32) of the step, op by op."""
        self._own_kernel_switches()
        meta = inputs.to(self.device)
        if self.replay is not None:
            meta.replay_from = self.replay.starts(inputs.sched.requests)
        streams = self.model.forward(meta, self.state)  # [T, hc, D]
        if not inputs.logits_owners:  # a step of prefill chunks only
            return streams, torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        return streams, self.model.compute_logits(streams[meta.logits_indices])

    @staticmethod
    def _split_logits(inputs: StepInputs, logits: torch.Tensor) -> Dict[str, torch.Tensor]:
        parts, i = {}, 0
        for req_id, n in inputs.logits_owners:
            parts[req_id] = logits[i:i + n]
            i += n
        return parts

    def warmup(self) -> None:
        """Capture decode graphs (CUDA, when enabled) and time the verify cost table of confidence
        scheduling (``features.dspark.budget=profile``) before serving."""
        self._own_kernel_switches()
        if self.graphs is not None:
            self.graphs.capture()
        if self.verify_graphs is not None:
            self.verify_graphs.capture()
        if self.speculator is not None:   # the drafter's graphs, when in use, share the pool
            self.graph_pool = self.speculator.capture_draft_graphs(self.graph_pool)
        if self.speculator is not None and self.speculator.needs_profile and self.parallel:
            # Ranks would time different costs (and the profile's forwards would need every rank's
            # collectives): parallel layouts verify every draft instead (an effective value).
            log.warning("features.dspark.budget=profile is not used with a parallel layout: every draft is verified")
            self.speculator.scheduler.adaptive = False
        elif self.speculator is not None and self.speculator.needs_profile:
            from redknot.speculative.profile import profile_cost_model
            # Without captured graphs (the CPU: tests, the embedded default run) a short profile: one
            # timing per size, sizes in powers of four, batches of at most 8 requests (larger extrapolate).
            graphs = self.device.type == "cuda"
            self.speculator.set_costs(profile_cost_model(
                self, self.speculator, self.max_num_seqs if graphs else min(8, self.max_num_seqs),
                self.max_num_batched_tokens, repeats=5 if graphs else 1, coarse=not graphs))

    @property
    def cuda_graphs_status(self) -> str:
        if self.verify_graphs is not None:  # DSpark: verify graphs (the status says which steps replay)
            return self.verify_graphs.status
        if self.graphs is None:
            if self.device.type != "cuda":
                return f"off: {self.device.type}"
            if self.speculator is not None:
                return "off: hardware.cuda_graphs=false (DSpark verify steps run eagerly)"
            return "off: hardware.cuda_graphs=false"
        return self.graphs.status

    @property
    def num_graph_replays(self) -> int:
        return sum(g.num_replays for g in (self.graphs, self.verify_graphs) if g is not None)
