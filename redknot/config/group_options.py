"""The config-group listing behind ``mode=catalog``.

:func:`group_options` is what Hydra itself would accept for each group (it asks
Hydra's config loader, so options from plugins and extra search paths show up
too); :func:`catalog_with` builds the ``mode=catalog`` body around the harness's
own tables.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

from redknot.config.hardware_fit import CONF_DIR

GROUPS = ("model", "hardware", "features", "suite", "sweep", "compare", "hydra/launcher")


@contextmanager
def _config_loader(conf_dir: Path) -> Iterator:
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import redknot.config.schema_store  # noqa: F401

    if GlobalHydra.instance().is_initialized():  # inside python -m redknot
        yield GlobalHydra.instance().config_loader()
        return
    with initialize_config_dir(str(conf_dir), version_base="1.3"):
        yield GlobalHydra.instance().config_loader()


def group_options(conf_dir: Path = CONF_DIR) -> Dict[str, List[str]]:
    """``{"model": ["deepseek-v4-flash", ...], "hardware": [...], ...}``."""
    with _config_loader(conf_dir) as loader:
        return {group: sorted(loader.get_group_options(group)) for group in GROUPS}


def summary(group: str, option: str, conf_dir: Path = CONF_DIR) -> str:
    """A one-line description of one option (from its YAML; empty for options defined elsewhere)."""
    from omegaconf import OmegaConf

    path = conf_dir / group / f"{option}.yaml"
    if not path.is_file():
        return ""
    node = OmegaConf.load(path)
    if group == "model":
        return f"[{node.get('support', '')}] max_position {node.get('max_position')}: {node.get('description', '')}"
    if group == "hardware":
        return f"[{node.get('support', '')}] {node.get('description', '')}"
    if group == "suite":
        return (f"{node.get('context_tokens')} tokens x {node.get('samples_per_dataset')} per dataset: "
                f"{', '.join(node.get('datasets', []))}")
    return _first_comment(path)


def _first_comment(path: Path) -> str:
    for line in path.read_text().splitlines():
        text = line.lstrip("# ").strip()
        if line.startswith("#") and text and not text.startswith("@package"):
            return text
    return ""


def render(options: Dict[str, List[str]], selected: Optional[Dict[str, str]] = None,
           conf_dir: Path = CONF_DIR):
    """A rich table of every group option; the selected ones are marked with ``*``."""
    from rich.markup import escape
    from rich.table import Table

    selected = selected or {}
    table = Table(title="RedKnot config groups (select with group=option; sweeps with +sweep=option)")
    table.add_column("group", no_wrap=True)
    table.add_column("option", no_wrap=True)
    table.add_column("summary", overflow="fold")
    for group, names in options.items():
        for i, name in enumerate(names):
            mark = "*" if selected.get(group) == name else " "
            table.add_row(group if i == 0 else "", f"{mark} {name}", escape(summary(group, name, conf_dir)))
        table.add_section()
    return table


def render_compact(options: Dict[str, List[str]], selected: Optional[Dict[str, str]] = None):
    """One row per group: its options, the selected one marked with ``*``."""
    from rich.table import Table

    selected = selected or {}
    table = Table(title="config groups (group=option; +sweep=option; hydra/launcher=option with -m)")
    table.add_column("group", no_wrap=True)
    table.add_column("options", overflow="fold")
    for group, names in options.items():
        table.add_row(group, ", ".join(f"*{n}" if selected.get(group) == n else n for n in names))
    return table


def catalog_with(details: Optional[Callable[[Any], int]]) -> Callable[[Any], int]:
    """The ``mode=catalog`` body: ``details(ctx)`` (the harness's tables) when given, then every
    config group's options; without ``details``, the group listing with a summary per option."""
    def catalog(ctx) -> int:
        from rich.console import Console

        code = int(details(ctx) or 0) if details is not None else 0
        console = Console(width=None if sys.stdout.isatty() else 140)
        options = group_options()
        console.print(render_compact(options, ctx.choices) if details is not None else render(options, ctx.choices))
        if details is None:
            _print_device(console)
        return code
    return catalog


def _print_device(console) -> None:
    from redknot.config.hardware_fit import detect, fitting_options

    facts = detect()
    console.print(f"this machine: {facts.accelerator.value} ({facts.name}); hardware options that fit: "
                  f"{', '.join(fitting_options(facts))}")
