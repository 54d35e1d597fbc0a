"""Hub kernels (issue 48): transformers 5.25's ``from_pretrained`` loads them by default; the package's own loads
(the CLI, the demo, the benchmark, the converter) pass ``use_kernels=False`` unless the user asks
(``--use-kernels``, or ``USE_HUB_KERNELS`` set by the user), through one helper, ``convert.loading.model_load_kwargs``."""

import pathlib

import pytest
import transformers

import cli
import demo
from convert import loading

REPO = pathlib.Path(__file__).resolve().parents[1]
PAIR = REPO / "pair"


@pytest.mark.parametrize("asked, environ, version, want", [
    (False, {}, "5.25.0", {"use_kernels": False}),  # on by default there: turned off
    (False, {}, "5.26.0.dev0", {"use_kernels": False}),
    (False, {}, "5.24.0", {}), (False, {}, "4.57.1", {}),  # off by default: the load is left as it was
    (False, {"USE_HUB_KERNELS": "1"}, "5.25.0", {}), (False, {"USE_HUB_KERNELS": "0"}, "5.25.0", {}),  # the user's
    (True, {}, "5.25.0", {"use_kernels": True}), (True, {}, "4.57.1", {"use_kernels": True}),  # asked for
])
def test_the_keyword_each_case_passes(asked, environ, version, want):
    assert loading.model_load_kwargs(asked, environ=environ, transformers_version=version) == want


def _spy(monkeypatch):
    """Record the keywords of every ``from_pretrained`` of the auto classes ``load_pair`` uses; the loads run."""
    seen = []
    for cls in (transformers.AutoModel, transformers.AutoModelForCausalLM):
        real = cls.from_pretrained.__func__

        def spy(klass, *args, _real=real, **kwargs):
            seen.append((klass.__name__, kwargs.get("use_kernels", "absent")))
            return _real(klass, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    return seen


def test_load_pair_passes_the_keyword_of_this_transformers(monkeypatch):
    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    seen = _spy(monkeypatch)
    loading.load_pair(str(PAIR / "target"), str(PAIR / "drafter"), "cpu", None, check=False)
    want = loading.model_load_kwargs().get("use_kernels", "absent")
    assert seen == [("AutoModelForCausalLM", want), ("AutoModel", want)]
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    assert want is (False if (major, minor) >= (5, 25) else "absent")
    seen.clear()
    monkeypatch.setenv("USE_HUB_KERNELS", "0")  # the user's own setting: left to transformers
    loading.load_pair(str(PAIR / "target"), str(PAIR / "drafter"), "cpu", None, check=False)
    assert seen == [("AutoModelForCausalLM", "absent"), ("AutoModel", "absent")]


class _Stop(Exception):
    pass


def _capture(monkeypatch, module):
    """Replace ``module.load_pair`` by a recorder that stops the command right there."""
    got = {}

    def fake(*args, **kwargs):
        got.update(kwargs)
        raise _Stop

    monkeypatch.setattr(module, "load_pair", fake)
    return got


@pytest.mark.parametrize("flags, want", [([], False), (["--use-kernels"], True)])
def test_every_command_line_hands_its_flag_to_the_loader(flags, want, monkeypatch):
    got = _capture(monkeypatch, loading)  # dflash-hf generate imports it at the call
    with pytest.raises(_Stop):
        cli.run_generate(cli.generate_parser().parse_args(["hi", "--device", "cpu", *flags]))
    assert got["use_kernels"] is want
    got = _capture(monkeypatch, demo)
    with pytest.raises(_Stop):
        demo.run(demo.parse_args(["--device", "cpu", *flags]))
    assert got["use_kernels"] is want
    from bench import cli as bench_cli

    got = _capture(monkeypatch, bench_cli)
    with pytest.raises(_Stop):
        bench_cli.load_models(bench_cli.parse_args(["--device", "cpu", *flags]), "cpu", None)
    assert got["use_kernels"] is want
