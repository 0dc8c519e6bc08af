"""Compose RedKnot's real conf/ in-process (Hydra's compose API), one initialisation per call
so no global Hydra state leaks into other tests."""
from contextlib import contextmanager
from pathlib import Path

from hydra import compose, initialize_config_dir

import redknot.config.schema_store  # noqa: F401
from redknot.config.hardware_fit import CONF_DIR
from redknot.config.resolve import resolve


@contextmanager
def hydra_context():
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        yield


def compose_cfg(*overrides):
    with hydra_context():
        return compose("config", overrides=list(overrides))


def resolve_overrides(*overrides, tmp_path: Path, environ=None):
    """Compose and resolve as `python -m redknot <overrides>` would (run dir under tmp_path)."""
    with hydra_context():
        cfg = compose("config", overrides=list(overrides))
        return resolve(cfg, run_dir=tmp_path / "run", overrides=list(overrides),
                       environ={} if environ is None else environ, cwd=tmp_path)


_DEFAULT = []


def default_typed():
    """A fresh copy of the typed default config with model=tiny (the V4 toy model, window 128: the
    rule boundaries the tests write out are its numbers), composed once per session."""
    import copy

    from redknot.config.resolve import to_typed

    if not _DEFAULT:
        _DEFAULT.append(to_typed(compose_cfg("model=tiny")))
    return copy.deepcopy(_DEFAULT[0])


def typed_with(changes):
    """The typed default config with ``{"features.dspark.max_draft": 3, ...}`` applied."""
    cfg = default_typed()
    for key, value in changes.items():
        *parents, leaf = key.split(".")
        node = cfg
        for part in parents:
            node = getattr(node, part)
        setattr(node, leaf, value)
    return cfg
