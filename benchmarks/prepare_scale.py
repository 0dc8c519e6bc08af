"""Time ``mode=prepare`` of the release suites on LongBench-scale data; print time and disk used.

The data is made by RedKnot itself (``redknot.bench.fixtures``, profile
``scale``): LongBench's row counts (200 per dataset) and mean context lengths,
in the LongBench JSONL format. Each suite is prepared through the real command
line, ``python -m redknot mode=prepare suite=<suite> ...``: cold (no frozen
inputs, no tokenized contexts in the cache), then again (reuse of the frozen
inputs), then with only the frozen inputs removed (the tokenized contexts kept
from the first prepare, as when a second suite is prepared from the same data),
optionally followed by ``mode=validate`` (which always tokenizes afresh).
Everything is written under ``--work`` (default ``outputs/bench-scale``).

    python benchmarks/prepare_scale.py                       # 64k and 128k, the suites' own case counts
    python benchmarks/prepare_scale.py --samples 200         # every row of every dataset
    python benchmarks/prepare_scale.py --suites 128k --validate
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

from redknot.bench import fixtures

DATASETS = ["hotpotqa", "2wikimqa", "musique", "narrativeqa", "triviaqa"]


def _disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _redknot(overrides: List[str], cwd: Path) -> tuple:
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "redknot", *overrides], cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if out.returncode != 0:
        raise SystemExit(f"python -m redknot {' '.join(overrides)} failed ({out.returncode}):\n"
                         f"{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
    return seconds, out.stdout


def _inner_seconds(stdout: str) -> Optional[float]:
    found = re.search(r"(?:built|reused) in ([0-9.]+) s", stdout)
    return float(found.group(1)) if found else None


def make_data(work: Path, seed: int) -> Path:
    data = work / "longbench"
    if not all((data / f"{d}.jsonl").is_file() for d in DATASETS):
        started = time.perf_counter()
        fixtures.write_dataset_dir(data, "scale", DATASETS, seed)
        print(f"generated scale fixtures in {time.perf_counter() - started:.1f} s: "
              f"{_disk_bytes(data) / 2 ** 20:.1f} MiB, {', '.join(DATASETS)} x 200 rows")
    return data


def measure(suite: str, data: Path, work: Path, samples: Optional[int], validate: bool) -> dict:
    root = work / "outputs"
    cache = root / "cache"
    common = [f"suite={suite}", f"suite.data.dir={data}", f"output.root={root}", "tracking.enabled=false",
              "hydra.run.dir=" + str(root / "hydra" / "${now:%H-%M-%S-%f}")]
    if samples:
        common.append(f"suite.samples_per_dataset={samples}")
    shutil.rmtree(cache / "inputs", ignore_errors=True)
    shutil.rmtree(cache / "tokens", ignore_errors=True)
    build_wall, build_out = _redknot(["mode=prepare", *common], work)
    (entry,) = sorted((cache / "inputs").glob("*"))
    reuse_wall, reuse_out = _redknot(["mode=prepare", *common], work)
    disk = _disk_bytes(entry)
    shutil.rmtree(entry)
    warm_wall, warm_out = _redknot(["mode=prepare", *common], work)
    row = {"suite": suite, "cases": re.search(r"(\d+) cases of", build_out).group(1),
           "build_wall_s": build_wall, "build_inner_s": _inner_seconds(build_out),
           "reuse_wall_s": reuse_wall, "warm_wall_s": warm_wall, "warm_inner_s": _inner_seconds(warm_out),
           "disk_mib": disk / 2 ** 20, "tokens_mib": _disk_bytes(cache / "tokens") / 2 ** 20,
           "address": entry.name}
    if validate:
        row["validate_wall_s"] = _redknot(["mode=validate", *common], work)[0]
    return row


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suites", nargs="+", default=["64k", "128k"])
    parser.add_argument("--samples", type=int, default=None, help="suite.samples_per_dataset (default: the suite's)")
    parser.add_argument("--work", type=Path, default=Path("outputs/bench-scale"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--validate", action="store_true", help="also time mode=validate")
    args = parser.parse_args(argv)
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    data = make_data(work, args.seed)
    print(f"machine: {os.cpu_count()} CPUs visible, {len(os.sched_getaffinity(0))} usable")
    print(f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    rows = [measure(suite, data, work, args.samples, args.validate) for suite in args.suites]
    print(f"{'suite':<6} {'cases':>5} {'cold s':>8} {'(inner)':>8} {'reuse s':>8} {'warm-tok s':>10} {'(inner)':>8} "
          f"{'inputs MiB':>10} {'tokens MiB':>10} {'validate s':>10}  address")
    for r in rows:
        print(f"{r['suite']:<6} {r['cases']:>5} {r['build_wall_s']:>8.1f} {r['build_inner_s'] or 0:>8.1f} "
              f"{r['reuse_wall_s']:>8.1f} {r['warm_wall_s']:>10.1f} {r['warm_inner_s'] or 0:>8.1f} "
              f"{r['disk_mib']:>10.1f} {r['tokens_mib']:>10.1f} {r.get('validate_wall_s', float('nan')):>10.1f}  "
              f"{r['address']}")
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
