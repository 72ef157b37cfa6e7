"""Small helpers shared by every layer (stdlib only)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the number of pages of `b` tokens that hold `a` tokens."""
    return -(-a // b)
