"""Shared helpers for the Triton kernels: interpreter detection, launch sizing, checks."""
from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable, Dict, Hashable, List, Sequence, Tuple

import torch

from redknot.kernels.capture import cuda_graph

log = logging.getLogger(__name__)

LOG2E = 1.4426950408889634


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(t: torch.Tensor) -> int:
    """Multiprocessors of the tensor's device (a nominal 8 on CPU, so split heuristics stay exercised)."""
    if t.is_cuda:
        return num_sms(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return 8


def dot_precision(dtype: torch.dtype):
    """fp32 operands use exact FMA dots (tf32 would cost ~1e-3 relative); 16-bit ones the tensor cores."""
    return "ieee" if dtype == torch.float32 else None


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: last dimension must be contiguous, got strides {tuple(t.stride())}")


def as_i32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else t.to(torch.int32)


class DeviceCounters:
    """Zeroed int32 counters, one set per device and stream, for launches whose last program of a block is found
    by an acquire-release counter (each launch leaves its counters zero again). The launches that share a set run
    one after another on their stream; a launch on another stream (``redknot.step.overlap``'s side stream, a graph
    capture's stream) gets a set of its own, so two streams never count into the same words. A set is kept for the
    process, and so is every set a larger one replaced: a CUDA graph captured with it may still replay it.
    ``counters(device, n)`` returns at least ``n`` of them for the device's current stream."""

    def __init__(self, minimum: int):
        self.minimum = minimum
        self.sets: Dict[Tuple[str, Any, int], torch.Tensor] = {}
        self.outgrown: List[torch.Tensor] = []

    def __call__(self, device: torch.device, n: int) -> torch.Tensor:
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        key = (device.type, device.index, stream)
        c = self.sets.get(key)
        if c is None or c.numel() < n:
            if c is not None:
                self.outgrown.append(c)
            c = torch.zeros(max(n, self.minimum), dtype=torch.int32, device=device)
            self.sets[key] = c
        return c


def _patch_interpreter() -> None:
    """Make Triton 3.6's CPU interpreter compute what the GPU computes (interpreter only):

    * scalars are 1-element arrays there and ``range`` bounds call ``int()`` on them, which numpy >= 2.4
      rejects: read the element explicitly;
    * ``tl.dot`` multiplies bf16 operands as their raw uint16 storage: widen them to fp32 first;
    * fp32 -> bf16 casts truncate, and fp32 -> e4m3 casts mis-round near powers of two: round to
      nearest even (e4m3 saturating at ±448), as the hardware does.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_redknot_patched", False):
        return
    original_patch = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            bits = h.data.astype(np.uint32) << np.uint32(16)
            return interpreter.TensorHandle(bits.view(np.float32), tl.float32)
        return h

    builder = interpreter.InterpreterBuilder
    original_dot, original_cast, original_fp_to_fp = builder.create_dot, builder.cast_impl, builder.create_fp_to_fp

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def rounded(src, dst_type):
        """fp32 -> bf16 / e4m3 with round-to-nearest-even, or None for other casts."""
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = src.data.astype(np.float32).view(np.uint32)
            out = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            return interpreter.TensorHandle(out.astype(np.uint16), tl.bfloat16)
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            vals = torch.from_numpy(np.clip(src.data.astype(np.float32), -448.0, 448.0))
            return interpreter.TensorHandle(vals.to(torch.float8_e4m3fn).view(torch.uint8).numpy(), tl.float8e4nv)
        return None

    def cast_impl(self, src, dst_type):
        out = rounded(src, dst_type)
        return original_cast(self, src, dst_type) if out is None else out

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        out = rounded(src, dst_type)
        return original_fp_to_fp(self, src, dst_type, rounding_mode) if out is None else out

    interpreter._patch_lang_tensor = patch_lang_tensor
    builder.create_dot, builder.cast_impl, builder.create_fp_to_fp = create_dot, cast_impl, create_fp_to_fp
    _speed_up_lang_patching(interpreter, tl)
    interpreter._redknot_patched = True


def _speed_up_lang_patching(interpreter, tl) -> None:
    """The same ``tl`` patching in the interpreter, done with less work (interpreter only).

    Every launch patches ``tl``'s builtins for its run and restores them after, and every call of a
    ``@triton.jit`` helper inside the kernel patches them again (per program of the grid), each time
    scanning the modules with ``inspect.getmembers`` (test_step_mhc_v41 + test_step_rows_v41 spent 15.5 s of
    CPU without this, 9.7 s with it). Here

    * the builtins of a module or class are found by one scan and remembered (the per-call check that a
      member is still the original builtin, i.e. not already patched, stays);
    * a helper called while the running launch (or an earlier helper of it) has patched the same ``tl``
      modules skips the re-patch: its patches would replace those by equal ones (the interpreter never
      restores a helper's patches either).

    Anything else (a different Triton layout, a helper outside a launch) takes the interpreter's own path.
    """
    import inspect

    import numpy as np

    needed = ("_patch_builtin", "_patch_attr", "_patch_lang", "_LangPatchScope", "GridExecutor")
    if not all(hasattr(interpreter, name) for name in needed):
        return
    original_patch_builtin, original_patch_lang = interpreter._patch_builtin, interpreter._patch_lang
    original_launch = interpreter.GridExecutor.__call__
    builtins: dict = {}  # module or class -> [(name, builtin member)]

    def patch_builtin(pkg, builder, scope):
        members = builtins.get(pkg)
        if members is None:
            members = [(n, m) for n, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)]
            if not members:  # nothing builtin left to find (already patched): no cache from this scan
                return original_patch_builtin(pkg, builder, scope)
            builtins[pkg] = members
        for name, member in members:
            if getattr(pkg, name, None) is member:
                interpreter._patch_attr(pkg, name, member, builder, scope)

    langs_of: dict = {}  # function -> ids of the tl modules among its globals
    state = {"launching": False, "patched": None}

    def langs(fn) -> frozenset:
        found = langs_of.get(fn)
        if found is None:
            found = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
            langs_of[fn] = found
        return found

    def patch_lang(fn):
        if state["launching"]:  # the launch's own patch, kept for the rest of its run
            state["launching"] = False
            scope = original_patch_lang(fn)
            state["patched"] = langs(fn)
            if callable(getattr(tl, "topk", None)) and callable(getattr(tl, "sort", None)):
                scope.set_attr(tl, "topk", topk)
                scope.set_attr(tl, "sort", sort)
            return scope
        if state["patched"] is None:  # outside a launch
            return original_patch_lang(fn)
        if langs(fn) <= state["patched"]:
            return interpreter._LangPatchScope()  # already in place; nothing to restore
        scope = original_patch_lang(fn)  # e.g. tl.sum's module also names tl.core; in place till the launch ends
        state["patched"] = state["patched"] | langs(fn)
        return scope

    original_topk, original_sort = getattr(tl, "topk", None), getattr(tl, "sort", None)

    def sorted_ints(x, k, dim, descending):
        """``tl.topk`` / ``tl.sort`` of an integer block along its last dimension, by one numpy sort: the
        bitonic network's result, as integers have one sorted order (ties are equal bits). None (the
        interpreter's own network, and its errors) for other operands."""
        k, dim, descending = (tl.core._unwrap_if_constexpr(v) for v in (k, dim, descending))
        if not isinstance(x, tl.tensor) or not x.type.is_block() or not x.dtype.is_int():
            return None
        shape = [int(tl.core._unwrap_if_constexpr(n)) for n in x.shape]
        n, numel = shape[-1], int(np.prod(shape))
        data = x.handle.data
        k = n if k is None else k
        if (dim not in (None, len(shape) - 1) or not isinstance(k, int) or k <= 0 or k & (k - 1) or k > n
                or numel & (numel - 1) or list(data.shape) != shape):
            return None
        data = np.sort(data, axis=-1)
        data = data[..., ::-1][..., :k] if descending else data[..., :k]
        return tl.tensor(interpreter.TensorHandle(np.ascontiguousarray(data), x.dtype.scalar),
                         tl.block_type(x.dtype.scalar, shape[:-1] + [k]))

    def topk(x, k, *args, **kwargs):  # (x, k, dim=None, descending=True); Triton 3.6 has no descending
        dim, descending = (kwargs.get(name, args[i] if len(args) > i else default)
                           for i, (name, default) in enumerate((("dim", None), ("descending", True))))
        out = sorted_ints(x, k, dim, descending)
        return original_topk(x, k, *args, **kwargs) if out is None else out

    def sort(x, *args, **kwargs):  # (x, dim=None, descending=False)
        dim, descending = (kwargs.get(name, args[i] if len(args) > i else default)
                           for i, (name, default) in enumerate((("dim", None), ("descending", False))))
        out = sorted_ints(x, None, dim, descending)
        return original_sort(x, *args, **kwargs) if out is None else out

    def launch(self, *args, **kwargs):
        outer = state["patched"]
        state["launching"] = True
        try:
            return original_launch(self, *args, **kwargs)
        finally:
            state["launching"], state["patched"] = False, outer

    interpreter._patch_builtin, interpreter._patch_lang = patch_builtin, patch_lang
    interpreter.GridExecutor.__call__ = launch


_INTERPRETED_AT_IMPORT = interpreting()  # kernels below this module were decorated for the interpreter
if _INTERPRETED_AT_IMPORT:
    _patch_interpreter()


class ConfigTuner:
    """Per-problem-class choice among a kernel's launch configurations, by measurement.

    The first call of a class (``key``) on a CUDA device times every candidate on the real inputs
    (median of a few runs) and keeps the fastest that ran; a candidate that fails to compile is
    skipped and remembered in ``failures``. A class whose fastest candidate takes less than
    ``graph_below_ms`` eagerly is timed again as CUDA-graph replays (every candidate captured once), the
    way the decode step runs it: an eager time that short is mostly the host's launch cost, which a graph
    does not pay, so eager timing would favour the candidates with the fewest launches over the fastest
    kernels. If any candidate cannot be captured, the class keeps its eager timings (``timed_as`` says
    which). Without CUDA, under the interpreter, during CUDA-graph
    capture or while ``ConfigTuner.enabled`` is off, the first candidate is used untimed (and not
    remembered). ``choices`` and ``timings`` are readable by benchmarks. Measured choices persist across
    processes through ``tuning_cache`` (per GPU, compute capability, torch and triton version and class);
    a class no stored choice covers may take the shipped seed's choice for the same environment. Candidates
    added since a class was stored are timed against its stored choice only (the other candidates keep their
    stored times), so adding one candidate costs a class two timings, not one per candidate.
    """

    enabled = True
    graph_below_ms = 1.0   # classes faster than this eagerly are compared as graph replays (0: never)

    def __init__(self, name: str, candidates: Sequence[Any]):
        self.name = name
        self.candidates: List[Any] = list(candidates)
        self.choices: Dict[Hashable, Any] = {}
        self.timings: Dict[Hashable, List[Tuple[Any, float]]] = {}
        self.failures: Dict[Hashable, List[Tuple[Any, str]]] = {}
        self.timed_as: Dict[Hashable, str] = {}   # "eager" or "graph": how the class's timings were taken

    def pick(self, key: Hashable, run: Callable[[Any], Any], device: torch.device) -> Any:
        if key in self.choices:
            return self.choices[key]
        if (not ConfigTuner.enabled or device.type != "cuda" or interpreting()
                or torch.cuda.is_current_stream_capturing()):
            return self.candidates[0]
        return self._measure(key, run, device)

    def _measure(self, key: Hashable, run: Callable[[Any], Any], device: torch.device) -> Any:
        """The choice stored by an earlier process (``tuning_cache``; else the shipped seed's, for the same
        GPU and versions) when it still names a candidate that runs once here, else a fresh measurement,
        stored for the next process."""
        from redknot.kernels import tuning_cache

        store, key_text = tuning_cache.store(), tuning_cache.describe(key)
        wanted = key_text is not None and (store is not None or tuning_cache.seed() is not None)
        env = tuning_cache.environment(device) if wanted else None
        entry, source = tuning_cache.lookup(env, self.name, key_text) if env is not None else (None, None)
        stored = tuning_cache.restore(entry, self.candidates) if entry is not None else None
        new = tuning_cache.untimed(entry, self.candidates) if stored is not None else []
        best = None
        if new:   # candidates added since the entry was measured: timed here against the stored choice
            log.info("%s %s: %s choice %s predates candidates %s; timing them against it", self.name, key,
                     source, stored[0], ", ".join(new))
            best = self._tune_added(key, run, stored, new, entry.get("failed") or [])
        elif stored is not None:
            try:
                run(stored[0])  # the first-use guard: a stored choice that no longer builds or runs is re-tuned
            except Exception as exc:
                log.warning("%s %s: %s choice %s failed (%s: %s); tuning again", self.name, key, source, stored[0],
                            type(exc).__name__, str(exc).splitlines()[0][:160] if str(exc) else "")
            else:
                self.timings[key], self.failures[key] = stored[1], []
                self.choices[key] = stored[0]
                log.info("%s %s: %s choice %s", self.name, key, source, stored[0])
                return stored[0]
        elif entry is not None:
            log.info("%s %s: %s choice %r is no candidate; tuning again", self.name, key, source, entry["choice"])
        if best is None:
            best = self._tune(key, run)
        if env is not None and store is not None:
            texts = [(tuning_cache.describe(c), ms) for c, ms in self.timings[key]]
            choice = tuning_cache.describe(best)
            failed = [tuning_cache.describe(c) for c, _ in self.failures.get(key, [])]
            if choice is not None and all(t is not None for t, _ in texts) and None not in failed:
                store.record(env, self.name, key_text, choice, texts, failed)
        return best

    def _tune_added(self, key: Hashable, run: Callable[[Any], Any], stored: Tuple[Any, list], new: List[str],
                    failed_before: List[str]) -> Any:
        """The stored choice and the candidates added since (``new``, described) timed here, side by side; the
        other candidates keep their stored times (each was slower than the stored choice where it was measured)
        and failures, so a class with one added candidate is timed twice, not once per candidate. None when the
        stored choice no longer runs (the caller then times every candidate)."""
        from redknot.kernels import tuning_cache

        subset = [stored[0]] + [c for c in self.candidates if tuning_cache.describe(c) in new]
        try:
            best = self._tune(key, run, subset)
        except RuntimeError:  # nothing in the subset ran
            return None
        if any(c == stored[0] for c, _ in self.failures.get(key, [])):
            return None
        self.timings[key] = list(self.timings[key]) + [(c, ms) for c, ms in stored[1] if c not in subset]
        self.failures[key] = list(self.failures.get(key, [])) + [
            (c, "failed where the stored entry was measured") for c in self.candidates
            if tuning_cache.describe(c) in failed_before and c not in subset]
        return best

    def _tune(self, key: Hashable, run: Callable[[Any], Any], candidates: Sequence[Any] | None = None) -> Any:
        from triton.testing import do_bench

        results, failed = [], []
        for cfg in self.candidates if candidates is None else candidates:
            try:
                results.append((cfg, float(do_bench(lambda: run(cfg), warmup=3, rep=10, return_mode="median"))))
            except Exception as exc:  # a config the compiler rejects (resources, layout) is just skipped
                failed.append((cfg, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"))
        self.failures[key] = failed
        if not results:
            raise RuntimeError(f"{self.name}: no launch configuration ran for {key}: {failed}")
        self.timed_as[key] = "eager"
        if min(ms for _, ms in results) < ConfigTuner.graph_below_ms:
            replayed = _replay_times([cfg for cfg, _ in results], run)
            if replayed is not None:
                results, self.timed_as[key] = replayed, "graph"
        self.timings[key] = results
        best = min(results, key=lambda r: r[1])[0]
        self.choices[key] = best
        log.info("%s %s: chose %s from %s (%s)", self.name, key, best, results, self.timed_as[key])
        return best


def _replay_times(configs: Sequence[Any], run: Callable[[Any], Any]) -> List[Tuple[Any, float]] | None:
    """Each config's ``run`` captured in a CUDA graph and timed as replays (median, as ``_tune`` times eager
    runs), or None when CUDA is absent or any config cannot be captured (a host sync, a capture-unsafe call):
    a class is compared in one way only. Every config has run eagerly before, so nothing compiles here."""
    from triton.testing import do_bench

    if not torch.cuda.is_available():
        return None
    out: List[Tuple[Any, float]] = []
    for cfg in configs:
        graph = torch.cuda.CUDAGraph()
        try:
            with cuda_graph(graph):
                run(cfg)
        except Exception as exc:
            log.info("graph timing: %s cannot be captured (%s: %s); the class keeps its eager timings", cfg,
                     type(exc).__name__, str(exc).splitlines()[0][:160] if str(exc) else "")
            return None
        try:
            out.append((cfg, float(do_bench(graph.replay, warmup=3, rep=10, return_mode="median"))))
        finally:
            del graph
    return out
