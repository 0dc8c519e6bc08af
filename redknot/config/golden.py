"""Golden snapshots of the resolved config, one per suite x hardware pair.

Each file under ``tests/golden/`` is exactly what
``python -m redknot suite=S hardware=H --cfg job --resolve`` prints (after a
two-line header), so a one-line YAML change shows its full effect in review.
``tests/unit/config/test_golden.py`` fails on drift; after an intended change::

    python -m redknot.config.golden --update
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

from redknot.config.hardware_fit import CONF_DIR

GOLDEN_DIR = CONF_DIR.parent / "tests" / "golden"
SUITES = tuple(sorted(p.stem for p in (CONF_DIR / "suite").glob("*.yaml")))
HARDWARE = ("cpu", "sm90-port", "sm100", "ascend950")
UPDATE_COMMAND = "python -m redknot.config.golden --update"


def pairs() -> List[Tuple[str, str]]:
    return [(suite, hw) for suite in SUITES for hw in HARDWARE]


def file_name(suite: str, hardware: str) -> str:
    return f"{suite}__{hardware}.yaml"


def header(suite: str, hardware: str) -> str:
    return (f"# python -m redknot suite={suite} hardware={hardware} --cfg job --resolve\n"
            f"# generated: {UPDATE_COMMAND}\n")


def render_all(conf_dir: Path = CONF_DIR, only: Optional[List[Tuple[str, str]]] = None
               ) -> Iterator[Tuple[str, str]]:
    """(file name, snapshot text) for every pair (or the pairs in ``only``), composed from ``conf_dir``."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import redknot.config.schema_store  # noqa: F401

    with initialize_config_dir(str(conf_dir), version_base="1.3"):
        for suite, hw in only or pairs():
            cfg = compose("config", overrides=[f"suite={suite}", f"hardware={hw}"])
            yield file_name(suite, hw), header(suite, hw) + OmegaConf.to_yaml(cfg, resolve=True)


def drift(golden_dir: Path = GOLDEN_DIR, conf_dir: Path = CONF_DIR,
          only: Optional[List[Tuple[str, str]]] = None) -> Dict[str, str]:
    """``{file: reason}`` for every snapshot that is missing, stale or (without ``only``) unexpected."""
    problems = {}
    expected = dict(render_all(conf_dir, only))
    for name, text in expected.items():
        path = golden_dir / name
        if not path.is_file():
            problems[name] = "missing"
        elif path.read_text() != text:
            problems[name] = "differs from the composed config"
    for path in golden_dir.glob("*.yaml") if only is None else ():
        if path.name not in expected:
            problems[path.name] = "no longer a suite x hardware pair"
    return problems


def update(golden_dir: Path = GOLDEN_DIR) -> List[str]:
    golden_dir.mkdir(parents=True, exist_ok=True)
    written = []
    expected = dict(render_all())
    for name, text in expected.items():
        path = golden_dir / name
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            written.append(name)
    for path in golden_dir.glob("*.yaml"):
        if path.name not in expected:
            path.unlink()
            written.append(f"{path.name} (removed)")
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help="rewrite the snapshots that changed")
    parser.add_argument("--dir", type=Path, default=GOLDEN_DIR, help="snapshot directory")
    args = parser.parse_args(argv)
    if args.update:
        for name in update(args.dir):
            print(f"updated {name}")
        return 0
    problems = drift(args.dir)
    for name, reason in sorted(problems.items()):
        print(f"{name}: {reason}")
    if problems:
        print(f"run: {UPDATE_COMMAND}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
