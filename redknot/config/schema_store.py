"""Registers the schema in Hydra's ConfigStore.

``conf/config.yaml`` names ``redknot_schema`` first in its defaults list, so every
group option composed after it is merged into the typed :class:`RedKnotConfig`:
an unknown key or a bad enum value fails while composing, naming the key (and,
for enums, the allowed values).
"""
from __future__ import annotations

from hydra.core.config_store import ConfigStore

from redknot.config.schema import RedKnotConfig

SCHEMA_NAME = "redknot_schema"


def register() -> None:
    """Store the schema (idempotent: storing the same name again replaces it)."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=RedKnotConfig)


register()
