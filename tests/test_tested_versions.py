"""The tested transformers versions are named once (``tested_versions.TESTED_TRANSFORMERS``) and agree with
``pyproject.toml``, the CI lanes and the README; a newer transformers gets one warning at the first call on a
path that reads transformers' internals (issue 48)."""

import logging
import pathlib
import re

import pytest
import torch
import transformers

import tested_versions
from tested_versions import TESTED_TRANSFORMERS
from tiny import tiny_draft, tiny_target

REPO = pathlib.Path(__file__).resolve().parents[1]
CI = (REPO / ".ci" / "run").read_text()
README = (REPO / "README.md").read_text()


def _ci_value(name: str) -> str:
    return re.search(rf"^{name}='([^']*)'$", CI, flags=re.MULTILINE).group(1)


def test_pyproject_ci_lanes_and_readme_agree_with_the_constant():
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.findall(r'"(transformers[^"]*)"', pyproject) == [tested_versions.requirement()] == [
        "transformers>=4.57.1,<5.26"]
    full, middle = _ci_value("FULL_LANES").split(), _ci_value("MIDDLE_LANE").split()
    assert full == [TESTED_TRANSFORMERS[0], TESTED_TRANSFORMERS[-1]]  # oldest and newest: the whole suite
    assert sorted(full + middle, key=tested_versions._minor) == list(TESTED_TRANSFORMERS)
    assert all((REPO / path).is_file() for path in _ci_value("MIDDLE_TESTS").split())
    install = README[README.index("## Install"):README.index("## A real pair")]
    assert all(v in install for v in TESTED_TRANSFORMERS), "the README's Install section names the tested versions"


def test_untested_newer_is_a_newer_minor_only():
    assert not tested_versions.untested_newer("5.25.3") and not tested_versions.untested_newer("4.57.1")
    assert tested_versions.untested_newer("5.26.0.dev0") and tested_versions.untested_newer("6.0.0")
    with pytest.raises(ValueError, match="'five'"):
        tested_versions.untested_newer("five")
    with pytest.raises(KeyError, match="'hybird'"):
        tested_versions.warn_if_untested("hybird")


def _warnings(caplog) -> list:
    return [r.getMessage() for r in caplog.records if r.name.endswith("tested_versions")]


def test_a_newer_transformers_warns_once_naming_the_versions_and_the_path(monkeypatch, caplog):
    """The version is patched to 5.26.0: the first spec_generate call (taps) logs one warning naming the tested
    versions and that path; a second call, and another path, say nothing. The running version logs nothing."""
    target, draft = tiny_target(), tiny_draft()
    ids = torch.tensor([[5, 6, 7, 8]])
    monkeypatch.setattr(tested_versions, "_WARNED", [False])
    with caplog.at_level(logging.WARNING):
        draft.spec_generate(target, ids, max_new_tokens=4, temperature=0.0)
    assert _warnings(caplog) == []  # the running version is a tested one (CI lanes)
    monkeypatch.setattr(tested_versions.transformers, "__version__", "5.26.0")  # the module it reads (other tests
    # may have imported transformers afresh since this file was)
    with caplog.at_level(logging.WARNING):
        draft.spec_generate(target, ids, max_new_tokens=4, temperature=0.0)
        draft.spec_generate(target, ids, max_new_tokens=4, temperature=0.0)
        tested_versions.warn_if_untested("hybrid cache")
    (message,) = _warnings(caplog)
    assert "transformers 5.26.0 is newer" in message and "4.57.1, 5.24.0, 5.25.0" in message
    assert "target feature taps" in message and "transformers<5.26" in message


@pytest.mark.parametrize("path, words", [("hybrid cache", "hybrid linear-attention"), ("cache reuse", "passed cache"),
                                         ("native route", "speculation_type")])
def test_each_path_names_itself(path, words, monkeypatch, caplog):
    monkeypatch.setattr(tested_versions, "_WARNED", [False])
    monkeypatch.setattr(tested_versions.transformers, "__version__", "6.1.0")
    with caplog.at_level(logging.WARNING):
        tested_versions.warn_if_untested(path)
    (message,) = _warnings(caplog)
    assert words in message.split(" reads ")[0]


def test_the_private_transformers_names_the_package_reads_are_there():
    """Every private name the package reads (issue 48 checked them against 5.25): a canary for the next version.
    Not read by the package, so not checked: ``_update_past_and_masks``, ``_is_stateful`` (removed in 5.25), the
    tensor-parallel styles (the package only passes ``tp_plan="auto"``)."""
    import inspect

    from transformers import DynamicCache, cache_utils
    from transformers.generation.utils import GenerationMixin

    import native_routes

    assert all(hasattr(cache_utils.DynamicLayer, name) for name in ("crop", "batch_select_indices", "get_seq_length"))
    if tested_versions._minor(transformers.__version__) < (5, 0):
        return
    assert "config" in inspect.signature(DynamicCache.__init__).parameters  # HybridCache(config=...)
    assert hasattr(cache_utils.DynamicSlidingWindowLayer, "activate_past_recording")  # cache_reuse
    layer = cache_utils.LinearAttentionLayer()  # target_cache._states / _set_states / _is_linear
    assert isinstance(layer.conv_states, dict) and isinstance(layer.recurrent_states, dict) and not hasattr(layer, "keys")
    # native_routes: the frame that builds the generator, the first attribute its __init__ reads, the embedding it keeps
    assert native_routes.native_dflash_available() and hasattr(GenerationMixin, "_get_candidate_generator")
    from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

    init = inspect.getsource(DFlashTokenCandidateGenerator.__init__)
    body = init[init.index("):"):]  # after the signature
    assert body.index("assistant_model.device") < body.index("self.main_model_input_embeddings = ")
