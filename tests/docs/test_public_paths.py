"""The import paths README and docs show resolve to the objects that do the work: the public
modules of the integrations are their implementations' names, not copies."""

from __future__ import annotations

import importlib

import pytest

import fastmuon

FACES = {
    "fastmuon.ultralytics": "fastmuon.integrations.ultralytics",
    "fastmuon.transformers": "fastmuon.integrations.transformers",
    "fastmuon.qk_clip": "fastmuon.integrations.logit_max",
}


@pytest.mark.parametrize("public, home", sorted(FACES.items()))
def test_each_public_module_offers_its_implementations_objects(public, home):
    face, impl = importlib.import_module(public), importlib.import_module(home)
    assert face.__all__, public
    for name in face.__all__:
        assert getattr(face, name) is getattr(impl, name), f"{public}.{name}"
    documented = set(getattr(impl, "__all__", face.__all__))
    assert documented <= set(face.__all__), f"{public} lacks {sorted(documented - set(face.__all__))}"


def test_the_groups_package_offers_param_groups_and_its_threshold():
    import fastmuon.groups
    from fastmuon.groups import build

    assert fastmuon.groups.param_groups is fastmuon.param_groups is build.param_groups
    assert fastmuon.groups.OUTSIDE_SHARE_WARNING == build.OUTSIDE_SHARE_WARNING


def test_the_top_level_names_resolve():
    for name in fastmuon.__all__:
        assert getattr(fastmuon, name) is not None, name
