"""The step contract: what one engine step hands to a model family and its kernels.

Neutral ground: the engine, every model family and the kernels import it; it
imports none of them. One engine step, in the order its data flows (where each
type is built, and by whom):

1. ``Scheduler.schedule()`` (engine/scheduler.py) -> :class:`~redknot.engine.messages.SchedulerOutput`:
   per request a ``ScheduledRequest`` (tokens at ``start_pos..``, slot, block table,
   logits rows, draft tokens to verify). Pure Python.
2. ``build_step_inputs`` (engine/inputs.py) -> ``StepInputs``: the step's
   :class:`~redknot.step.metadata.StepMetadata` on the host (the requests' new tokens
   concatenated, varlen: ``input_ids``, ``positions``, ``query_start_loc``,
   ``seq_slots``, ``block_tables``, ``logits_indices`` + their Python copies) and
   which request owns which logits row.
3. ``EngineCore._batch`` (engine/core.py) -> ``StepBatch`` (engine/model_runner.py):
   the inputs plus one ``SamplingRow`` per logits row (sample/sampler.py) and the
   grammar bitmask.
4. ``ModelRunner.execute`` (engine/model_runner.py): ``StepInputs.to(device)`` gives
   the device ``StepMetadata`` (compact SWA replay sets ``replay_from``; a captured
   decode graph replays a ``tensor_only`` one built from its static buffers,
   engine/cuda_graphs.py); then ``model.forward(meta, state)`` of the family's model.
5. Inside the model: per forward a :class:`~redknot.step.context.StepContext`
   (step/context.py: per-sequence ``SeqSpan`` s, the rotary tables at the step's
   positions, the rows each ring write takes); layers call ops on the
   ``KernelSet`` with ``ctx.meta``, and the fast backends derive ``StepTensors``
   (kernels/step_index.py: row -> sequence, context lengths, query starts) from
   the metadata's tensors once per step. Those tensors, the family's state tensors
   and the layer's activations are what a kernel reads.
6. ``model.compute_logits`` -> fp32 logits; the ``Sampler`` (or the speculative
   ``Verifier``) -> tokens -> :class:`~redknot.engine.messages.ModelRunnerOutput`; the
   drafter runs the family's draft model on its own ``StepMetadata.build(...)`` and
   adds the next step's drafts (speculative/).
7. ``Scheduler.update_from_output`` -> ``RequestUpdate`` s -> ``OutputProcessor``
   -> ``RequestOutput`` (engine/outputs.py).

Context parallel (parallel/cp.py) hands each rank a ``CPStepMetadata``, a
``StepMetadata`` of its share of the rows.
"""
from __future__ import annotations

from redknot._lazy import lazy_getattr

_EXPORTS = {
    "StepMetadata": "redknot.step.metadata",
    "StepContext": "redknot.step.context",
    "SeqSpan": "redknot.step.context",
    "RopeTable": "redknot.step.context",
    "write_ring": "redknot.step.context",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
