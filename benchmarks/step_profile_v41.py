"""Where the device time of the V4.1 tensor-only decode step goes: two torch.profiler (kineto) views.

* eager: the step's kernels launched one by one (no graph), ``steps`` times under the profiler, with
  the step's ``v41_step.<region>`` ranges on (``tensor_step.PROFILE_REGIONS``). Every kernel the device
  ran is read from the trace's device events (not from the host ops' kernel lists, which miss kernels
  that no PyTorch op launched, such as Triton's) and attributed to the innermost region open on the
  host when its launch call (``cudaLaunchKernel`` / ``cuLaunchKernel*``, matched by CUPTI correlation id)
  ran. Reported: device time per kernel name and per region summed over the steps, launches, the
  device-busy time per step (union of the kernels' device intervals), and against the graph replay's
  wall time per step: ``launch gaps = replay wall - busy``, a measured number.
* replay: ``steps`` replays of the captured graph under the same profiler (recent torch/CUPTI record the
  kernels inside a graph): kernels seen per replay, their busy time and its coverage of the replay's
  wall time, so a replay trace that misses kernels shows as low coverage next to the eager launches.

On a CPU (``--smoke``) the trace has no device events: each view reports the host ops' self CPU time
instead (same tables, so the code path runs in the CPU tests).
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch

RANGE_PREFIX = "v41_step."
# Host-side calls of the CUDA runtime / driver that put work on the device (their CUPTI correlation id is the
# one of the kernel / copy they launched).
_LAUNCH = re.compile(r"^cu(da)?(LaunchKernel|LaunchCooperativeKernel|Memcpy|Memset|GraphLaunch)")
_RUNTIME = re.compile(r"^cu(da)?[A-Z]")


def _is_device(ev) -> bool:
    return getattr(ev.device_type, "name", str(ev.device_type)) != "CPU"


def _is_range(ev) -> bool:
    return ev.name.startswith(RANGE_PREFIX) or ev.name.startswith("v41_profile.")


def _region_at(ranges: list[tuple], times: list[float | None]) -> list[str]:
    """Innermost range open at each host time (ranges: (start, end, name), properly nested), by one sweep."""
    marks = []
    for i, (s, e, name) in enumerate(ranges):
        marks.append((s, 1, i))
        marks.append((e, 0, i))
    for j, t in enumerate(times):
        if t is not None:
            marks.append((t, 2, j))
    marks.sort(key=lambda m: (m[0], m[1]))   # at one time: ends, then starts, then the launch
    out = ["(launch not in the trace)"] * len(times)
    stack: list[int] = []
    for _t, kind, i in marks:
        if kind == 1:
            stack.append(i)
        elif kind == 0:
            if i in stack:
                stack.remove(i)
        else:
            out[i] = ranges[stack[-1]][2][len(RANGE_PREFIX):] if stack else "(outside the regions)"
    return out


def _union_us(intervals: Iterable[tuple]) -> float:
    busy, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy


def _rows(table: dict[str, list], steps: int, top: int) -> list[dict]:
    total = sum(v[0] for v in table.values()) or 1.0
    out = sorted(({"name": k, "ms": v[0] / 1e3, "ms_per_step": v[0] / 1e3 / steps, "share": v[0] / total,
                   "calls": v[1], "calls_per_step": v[1] / steps} for k, v in table.items()),
                 key=lambda r: (-r["ms"], r["name"]))
    rest = out[top:]
    if rest:
        out = out[:top] + [{"name": f"(rest: {len(rest)} names)", "ms": sum(r["ms"] for r in rest),
                            "ms_per_step": sum(r["ms_per_step"] for r in rest),
                            "share": sum(r["share"] for r in rest), "calls": sum(r["calls"] for r in rest),
                            "calls_per_step": sum(r["calls_per_step"] for r in rest)}]
    return out


def kernel_report(events, steps: int, wall_ms: float | None = None, top: int = 40) -> dict:
    """Per kernel name and per region: device time summed over ``steps`` steps and launches, from the events
    of a torch.profiler trace (``prof.events()``: objects with ``name``, ``device_type``, ``time_range``,
    ``id``, ``linked_correlation_id``, ``self_cpu_time_total``). With device events (a GPU trace) the
    kernels / copies are the device events and ``busy_ms_per_step`` the union of their intervals per step;
    without (a CPU trace) the host ops' self times stand for them. ``wall_ms``: the step's wall time
    (the graph replay's), giving ``gap_ms_per_step = wall - busy`` and ``coverage = busy / wall``."""
    events = list(events)
    ranges = sorted(((ev.time_range.start, ev.time_range.end, ev.name) for ev in events
                     if not _is_device(ev) and ev.name.startswith(RANGE_PREFIX)), key=lambda r: (r[0], -r[1]))
    device = [ev for ev in events if _is_device(ev) and not _is_range(ev)]
    host_launch = {ev.id: ev for ev in events if not _is_device(ev) and _LAUNCH.match(ev.name)}
    # host ops (and ranges: a kernel launched by no PyTorch op may be linked to the range around it)
    host_ops = {ev.id: ev for ev in events if not _is_device(ev) and not _RUNTIME.match(ev.name)}
    if device:
        kind = "device"
        items, times, found = [], [], 0
        for ev in device:
            launch = host_launch.get(ev.id)
            if launch is None:   # no launch call under this correlation id: the host op it is linked to
                launch = host_ops.get(getattr(ev, "linked_correlation_id", 0) or -1)
            else:
                found += 1
            items.append((ev.name, ev.time_range.end - ev.time_range.start))
            times.append(None if launch is None else launch.time_range.start)
        busy = _union_us((ev.time_range.start, ev.time_range.end) for ev in device)
        span = max(ev.time_range.end for ev in device) - min(ev.time_range.start for ev in device)
    else:
        kind = "host (no device events: self CPU time of the host ops)"
        ops = [ev for ev in host_ops.values() if ev.self_cpu_time_total > 0 and not _is_range(ev)]
        items = [(ev.name, ev.self_cpu_time_total) for ev in ops]
        times = [ev.time_range.start for ev in ops]
        found = None
        busy = sum(us for _n, us in items)
        span = (max(ev.time_range.end for ev in ops) - min(ev.time_range.start for ev in ops)) if ops else 0.0
    regions = _region_at(ranges, times)
    by_kernel: dict[str, list] = {}
    by_region: dict[str, list] = {}
    for (name, us), reg in zip(items, regions):
        for table, key in ((by_kernel, name[:100]), (by_region, reg)):
            row = table.setdefault(key, [0.0, 0])
            row[0] += us
            row[1] += 1
    steps = max(1, steps)
    busy_ms = busy / 1e3 / steps
    rep = {"kind": kind, "steps": steps, "launches": len(items), "launches_per_step": len(items) / steps,
           "launch_calls_on_host": len(host_launch), "launches_matched": found,
           "device_ms_per_step": sum(us for _n, us in items) / 1e3 / steps, "busy_ms_per_step": busy_ms,
           "span_ms_per_step": span / 1e3 / steps, "wall_ms_per_step": wall_ms,
           "gap_ms_per_step": None if wall_ms is None else wall_ms - busy_ms,
           "coverage": None if not wall_ms else busy_ms / wall_ms,
           "by_kernel": _rows(by_kernel, steps, top), "by_region": _rows(by_region, steps, 60)}
    return rep


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def profile_steps(fn: Callable[[], object], device, steps: int, regions: bool = True):
    """``fn`` once unprofiled, then ``steps`` times under torch.profiler (CPU, and CUDA activity on a GPU),
    with the tensor step's region ranges on when ``regions``. Returns the trace's events."""
    from torch.profiler import ProfilerActivity, profile

    import redknot.models.deepseek_v41.tensor_step as ts

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    old = ts.PROFILE_REGIONS
    ts.PROFILE_REGIONS = regions
    try:
        fn()
        _sync(device)
        with profile(activities=acts) as prof:
            for _ in range(steps):
                fn()
            _sync(device)
    finally:
        ts.PROFILE_REGIONS = old
    return prof.events()


def step_views(eager: Callable[[], object], replay: Callable[[], object] | None, device, steps: int,
               wall_ms: float | None) -> dict:
    """Both views of one step (see the module docstring); a view whose profile fails reports its error."""
    out = {}
    for name, fn, regions in (("eager", eager, True), ("replay", replay, False)):
        if fn is None:
            continue
        try:
            out[name] = kernel_report(profile_steps(fn, device, steps, regions), steps, wall_ms)
        except Exception as exc:   # noqa: BLE001  (a profiler API difference must not cost the timings)
            out[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
    return out


def _f(x, fmt=".3f") -> str:
    return "n/a" if x is None else format(x, fmt)


def format_views(views: dict, title: str, heading: str = "Decode step profile") -> list[str]:
    """Markdown: a summary line per view, then the eager view's tables by region and by kernel, and the
    replay view's table by kernel (each sorted by device time)."""
    lines = ["", f"## {heading}: {title}", ""]
    lines += [("| view | what | steps | launches/step | launch calls on host (matched) | device ms/step | "
              "busy ms/step | span ms/step | replay wall ms/step | wall - busy (launch gaps) ms/step | "
              "busy/wall |"), "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, v in views.items():
        if "error" in v:
            lines.append(f"| {name} | failed: {v['error']} | | | | | | | | | |")
            continue
        lines.append(f"| {name} | {v['kind']} | {v['steps']} | {v['launches_per_step']:.1f} | "
                     f"{v['launch_calls_on_host']} ({_f(v['launches_matched'], 'd')}) | {v['device_ms_per_step']:.3f} | "
                     f"{v['busy_ms_per_step']:.3f} | {v['span_ms_per_step']:.3f} | {_f(v['wall_ms_per_step'])} | "
                     f"{_f(v['gap_ms_per_step'])} | {_f(v['coverage'] and 100 * v['coverage'], '.1f')} % |")
    for name, what in (("eager", "by_region"), ("eager", "by_kernel"), ("replay", "by_kernel")):
        v = views.get(name)
        if not v or "error" in v:
            continue
        lines += ["", f"### {name} view, device time {what.replace('_', ' ')} (summed over {v['steps']} steps)", "",
                  "| name | share | ms total | ms/step | launches | launches/step |", "|---|---|---|---|---|---|"]
        lines += [f"| `{r['name']}` | {100 * r['share']:.1f} % | {r['ms']:.3f} | {r['ms_per_step']:.4f} | "
                  f"{r['calls']} | {r['calls_per_step']:.1f} |" for r in v[what]]
    return lines
