"""Fixtures shared by the tests in tests/unit."""

from __future__ import annotations

import random

import pytest


@pytest.fixture
def seed() -> int:
    s = random.SystemRandom().randrange(2**31)
    print(f"seed={s}")
    return s
