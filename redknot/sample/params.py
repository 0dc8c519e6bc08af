"""SamplingParams: how one request is decoded (pure Python, validated on construction)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

SCHEMA_TYPES = ("regex", "json", "ebnf")

# (output_token_ids so far, logits row [vocab]) -> logits row; applied before the grammar mask.
LogitsProcessor = Callable[[List[int], Any], Any]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    """A finite int or float (``nan`` and ``inf`` compare false with every bound, so they must be refused here)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class SamplingParams:
    """Decoding parameters of one request.

    ``temperature=0`` is greedy. ``top_k=0``, ``top_p=1`` and ``min_p=0`` switch
    those filters off. ``seed`` makes a sampled request reproducible: its tokens
    depend only on the seed, the prompt and these parameters, never on the rest
    of the batch. ``structured_output`` is ``{"schema_type": "regex"|"json"|"ebnf",
    "schema": str (or a dict for json)}``. Invalid values raise ``ValueError``
    naming the field.
    """
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    stop_token_ids: Optional[List[int]] = None
    stop: Optional[Union[str, List[str]]] = None
    seed: Optional[int] = None
    structured_output: Optional[Dict[str, Any]] = None
    ignore_eos: bool = False
    logits_processors: Optional[List[LogitsProcessor]] = field(default=None, compare=False)

    def __post_init__(self) -> None:
        self._check_numbers()
        self.stop_token_ids = self._check_stop_token_ids(self.stop_token_ids)
        self.stop = self._check_stop(self.stop)
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"SamplingParams.seed={self.seed!r}: must be an integer or None")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"SamplingParams.ignore_eos={self.ignore_eos!r}: must be true or false")
        if self.structured_output is not None:
            self.structured_output = normalize_structured_output(self.structured_output)
        if self.logits_processors is not None:
            bad = [p for p in self.logits_processors if not callable(p)]
            if bad:
                raise ValueError(f"SamplingParams.logits_processors: {bad[0]!r} is not callable")

    def _check_numbers(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens={self.max_tokens!r}: must be an integer >= 1")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature!r}: must be a number >= 0 (0 = greedy)")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k={self.top_k!r}: must be an integer >= 0 (0 = off)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p={self.top_p!r}: must be in (0, 1] (1 = off)")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"SamplingParams.min_p={self.min_p!r}: must be in [0, 1] (0 = off)")

    @staticmethod
    def _check_stop_token_ids(ids: Optional[Sequence[int]]) -> Optional[List[int]]:
        if ids is None:
            return None
        if isinstance(ids, (str, bytes)) or not all(_is_int(i) and i >= 0 for i in ids):
            raise ValueError(f"SamplingParams.stop_token_ids={ids!r}: must be a list of token ids >= 0")
        return list(ids)

    @staticmethod
    def _check_stop(stop: Optional[Union[str, Sequence[str]]]) -> Optional[List[str]]:
        if stop is None:
            return None
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"SamplingParams.stop={stop!r}: must be a non-empty string or a list of them")
        return list(stops)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def normalize_structured_output(spec: Any) -> Dict[str, str]:
    """Check a structured-output spec; return it with the schema as a string."""
    field_name = "SamplingParams.structured_output"
    if not isinstance(spec, dict):
        raise ValueError(f"{field_name}={spec!r}: must be a dict "
                         f"{{'schema_type': one of {list(SCHEMA_TYPES)}, 'schema': ...}}")
    unknown = sorted(set(spec) - {"schema_type", "schema"})
    if unknown:
        raise ValueError(f"{field_name} has unknown keys {unknown}; allowed: ['schema', 'schema_type']")
    kind = spec.get("schema_type")
    if kind not in SCHEMA_TYPES:
        raise ValueError(f"{field_name}.schema_type={kind!r}: must be one of {list(SCHEMA_TYPES)}")
    schema = spec.get("schema")
    if kind == "json" and isinstance(schema, dict):
        schema = json.dumps(schema, sort_keys=True)
    if not isinstance(schema, str) or not schema:
        allowed = "a non-empty string or a dict" if kind == "json" else "a non-empty string"
        raise ValueError(f"{field_name}.schema={schema!r}: must be {allowed} for schema_type={kind!r}")
    return {"schema_type": kind, "schema": schema}
