"""Reference (plain PyTorch) implementations of every registered op.

Each fast backend keeps the signature of the op registered here and is tested
against it.
"""
from __future__ import annotations
