"""The model-family interface: everything the engine side needs from a model, in one place.

The engine, cache sizing, CUDA graphs, speculative decoding, the parallel
layouts and the harness reach a model only through a :class:`ModelFamily`
(found with :func:`redknot.models.registry.family_for`) and the objects it
returns, whose parts the engine side uses are the protocols below. Per-step data
crosses the seam as :class:`redknot.step.metadata.StepMetadata`.

Pure Python at import: families import torch and their model code inside the
methods that need them.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, List, Mapping, Optional, Protocol, Sequence, Tuple, Union

if TYPE_CHECKING:
    import torch

    from redknot.kernels import KernelSet
    from redknot.models.registry import FamilyEntry

MTP = "mtp"  # classic multi-token-prediction drafting (one MTP layer on the target's streams)
DSPARK = "dspark"  # DSpark draft stages: one parallel block per step from target taps (dspark_draft.py)


class ArchConfig(Protocol):
    """A parsed checkpoint config: the numbers the engine side reads."""
    vocab_size: int
    sliding_window: int                 # SWA window incl. the query
    num_trailing_sliding_layers: int    # window-only layers above the last compressed one (compact replay)


class StateSizes(Protocol):
    """A family's state layout as the cache manager and the runner see it (pure Python)."""
    block_size: int        # token positions per paged block
    max_backtrack: int     # tokens a sequence may be rolled back by
    bytes_per_block: int
    bytes_per_slot: int

    def describe(self) -> str: ...


class ServingModel(Protocol):
    """A built model as the model runner, CUDA graphs and context parallel call it."""
    cfg: ArchConfig
    device: "torch.device"
    dtype: "torch.dtype"
    supports_cuda_graphs: bool  # a tensor_only decode step reads every per-step value from tensors

    def forward(self, meta, state) -> "torch.Tensor": ...          # -> pre-head streams [T, ...]

    def compute_logits(self, streams: "torch.Tensor") -> "torch.Tensor": ...  # -> fp32 logits [N, V]


class MTPDraftModel(Protocol):
    """A classic MTP drafter: row t combines the target's streams at t with token t+1."""
    device: "torch.device"

    def mtp_forward(self, meta, state, prev_streams: "torch.Tensor", next_token_ids: "torch.Tensor"
                    ) -> Tuple["torch.Tensor", "torch.Tensor"]: ...  # -> (streams, logits of meta.logits_indices)


class Tokenizer(Protocol):
    """Text <-> token ids (no special tokens added by ``encode``)."""
    bos_id: int
    eos_id: int
    source: str      # the tokenizer file it was loaded from
    tokenizer: Any   # the ``tokenizers.Tokenizer`` (xgrammar and the harness read it)

    def encode(self, text: str) -> List[int]: ...

    def decode(self, ids, skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class ContextParallelHooks:
    """How a family's layers run when a step's rows are split over a context-parallel group
    (:mod:`redknot.parallel.cp`): ``attention(step, attn, ks, x, ctx, layer_state)`` is one
    attention layer over this rank's rows; ``idle(step, model, state)`` joins every collective
    of a forward with no local rows."""
    attention: Callable[..., Any]
    idle: Callable[..., None]


# (main layer index, number of routed experts) -> the experts this process keeps, one stacked row each.
ExpertRows = Callable[[int, int], Sequence[int]]


class ModelFamily(ABC):
    """One model family (see the module docstring); each ``redknot/models/<family>/family.py``
    defines ``FAMILY``, an instance of a subclass."""

    def __init__(self, entry: "FamilyEntry") -> None:
        self.entry = entry

    @property
    def name(self) -> str:
        return self.entry.name

    @abstractmethod
    def parse_config(self, source: Union[str, Mapping[str, Any]]) -> ArchConfig:
        """A checkpoint directory or a config.json dict -> the family's architecture config;
        bad fields raise ValueError naming the field."""

    @abstractmethod
    def state_layout(self, cfg: ArchConfig, *, block_size: int, max_backtrack: int, kv_bytes: int) -> StateSizes:
        """Ring and block sizes of the incremental state (pure Python)."""

    @abstractmethod
    def allocate_state(self, cfg: ArchConfig, layout: StateSizes, *, num_slots: int, num_blocks: int,
                       device: Any, dtype: Any) -> Any:
        """The device tensors of the state (``.layout`` is ``layout``); the model's forward reads them."""

    @abstractmethod
    def build_model(self, model_cfg: Any, hardware: Any, cache_dir: str, *, kernels: Optional["KernelSet"] = None,
                    device: Any = "cpu", expert_rows: Optional[ExpertRows] = None) -> ServingModel:
        """Load ``model.path`` (or the synthetic checkpoint, written first) onto ``device``;
        with ``expert_rows`` only those routed-expert rows are allocated and read (expert parallel)."""

    @abstractmethod
    def load_tokenizer(self, model_cfg: Any = None) -> Tokenizer:
        """The model's tokenizer (``model.tokenizer_path``, else the checkpoint's, else the family's own)."""

    @abstractmethod
    def cost_model(self, cfg: ArchConfig) -> Any:
        """FLOPs and bytes of prefill and decode for this architecture (pure Python)."""

    @abstractmethod
    def write_synthetic_checkpoint(self, model_cfg: Any, cache_dir: str) -> str:
        """Directory of the seeded checkpoint ``model.synthetic`` describes, written on first use."""

    @abstractmethod
    def draft_models(self, model: ServingModel) -> Mapping[str, Any]:
        """The drafters the checkpoint carries, by kind (:data:`MTP`: an :class:`MTPDraftModel`)."""

    @abstractmethod
    def expert_layers(self, model: ServingModel) -> Sequence[Any]:
        """The routed-expert (MoE) module of every main layer, in layer order, for expert parallel:
        each has ``experts`` (``keep_only``, ``logical_ids``, stacked ``w1/w2/w3`` and scales),
        ``gate.top_k``, ``limit`` and a settable ``dispatcher``."""

    def varlen_forward(self, model: ServingModel, state: Any, *, input_ids: "torch.Tensor",
                       positions: "torch.Tensor", query_start_loc: "torch.Tensor", seq_slots: "torch.Tensor",
                       block_tables: "torch.Tensor") -> "torch.Tensor":
        """One step that reads every per-step value from these device tensors (no host read, so a CUDA
        graph can capture it): T rows of B requests, 1..γ+1 rows each (DSpark's variable-length verify),
        rows at or past ``query_start_loc[B]`` are padding on the spare slot and block -> pre-head rows
        [T, ...]. Only for a model with ``supports_varlen_graphs``."""
        raise NotImplementedError(f"model family {self.name!r} has no variable-length tensor-only step")

    def context_parallel(self) -> Optional[ContextParallelHooks]:
        """The family's context-parallel layers; None: ``features.parallel.cp`` is not supported."""
        return None

    def memory_plans(self, model_cfg: Any, hardware: Any, features: Any,
                     device_name: Optional[str] = None) -> Sequence[Any]:
        """Per-device weights and state capacity of the configured parallel layout, one plan per
        device ``device_name`` or ``hardware.device_names`` names (each has ``describe() -> lines``
        and ``fits``); empty when the family has no plan. Pure Python (``mode=catalog``)."""
        return ()

    def check_memory(self, model_cfg: Any, hardware: Any, features: Any, *, device_bytes: int,
                     device_name: str) -> None:
        """Refuse, before any weight is read, a layout that cannot fit one device of ``device_bytes``
        (ValueError with the numbers); the default checks nothing."""
        return None
