"""docs/RELIABILITY.md names, for each fault, the test that pins it: every test
it names exists, so the table cannot point at a test that was renamed or
removed."""

import os
import re

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)


def test_every_test_the_reliability_table_names_exists():
    with open(os.path.join(ROOT, "docs", "RELIABILITY.md")) as f:
        text = f.read()
    named = []
    for cell in re.findall(r"`(tests/[^`]+\.py)::([^`]+)`((?:, `::[^`]+`)*)", text):
        path, first, more = cell
        names = [first] + re.findall(r"`::([^`]+)`", more)
        named += [(path, re.sub(r"\[.*\]$", "", name)) for name in names]
    assert len(named) > 30
    for path, name in named:
        with open(os.path.join(ROOT, path)) as f:
            assert re.search(rf"^def {re.escape(name)}\(", f.read(), re.M), f"{path}::{name} is not a test"
