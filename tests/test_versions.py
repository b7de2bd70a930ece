"""The versions this release ran with: the table, and the start-up warning for anything outside it."""
from __future__ import annotations

import re

import pytest

from dflash_contract import versions


def test_this_environment_was_checked():
    """The CI environment is one of the checked sets: no warning here."""
    assert versions.unchecked_versions() == [] and versions.version_warning("dflash-serve") is None


@pytest.mark.parametrize("name,version", [("torch", "2.9.1"), ("transformers", "4.56.2"), ("numpy", "2.6.0"),
                                          ("torch", "2.10.0a0+b4e4ee81d3.nv25.12")])
def test_a_version_outside_the_table_is_named(monkeypatch, name, version):
    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda n: version if n == name else real(n))
    lines = versions.unchecked_versions()
    if re.match(r"\d+\.\d+", version).group() in versions.CHECKED[name]:
        assert lines == []  # NVIDIA's 2.10.0a0 build is PyTorch 2.10
    else:
        assert lines == [f"{name} {version} (this release ran with {', '.join(versions.CHECKED[name])})"]
        assert versions.version_warning("dflash-serve").startswith(f"dflash-serve: warning: not checked with this "
                                                                   f"release: {name} {version}")
