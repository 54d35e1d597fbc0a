"""A drafter folder loaded in a process runs that folder's own remote code (issue: stale remote code).

transformers 4.57 keys a local folder's remote code by the folder's basename, and transformers 5
maps a remote config class to the first model class loaded for it, so without care a second folder
with the same ``modeling_dflash.py`` but another ``generation_utils.py`` (or an edited folder) runs
the first folder's decoding loop. Each folder here plants a ``spec_generate`` that raises a tag naming
its folder, so a call shows whose loop actually ran.
"""

import os
import pathlib

import pytest
import torch
from transformers import AutoModel
from transformers.dynamic_module_utils import get_relative_import_files, get_relative_imports

from tiny import tiny_draft

REPO = pathlib.Path(__file__).resolve().parents[1]


def _plant(folder: pathlib.Path, tag: str, file: str = "generation_utils.py") -> None:
    """Append to ``file`` of ``folder`` a ``spec_generate`` that raises ``RuntimeError(tag)``."""
    path = folder / file
    path.write_text(path.read_text() + f"\n\ndef spec_generate(*args, **kwargs):\n    raise RuntimeError({tag!r})\n")


def _drafter(parent: pathlib.Path, tag: str) -> pathlib.Path:
    folder = parent / "drafter"  # the same basename for every folder
    tiny_draft().save_pretrained(folder)
    _plant(folder, tag)
    return folder


def _ran(model) -> str:
    ids = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(RuntimeError) as err:
        model.spec_generate(model, ids, max_new_tokens=2)
    return str(err.value)


def _load(folder):
    return AutoModel.from_pretrained(str(folder), trust_remote_code=True)


@pytest.mark.parametrize("order", ["ab", "ba"])
def test_same_basename_same_modeling_file_each_folder_runs_its_own_loop(tmp_path, order):
    folders = {tag: _drafter(tmp_path / tag.lower(), f"folder {tag}") for tag in "AB"}
    assert (folders["A"] / "modeling_dflash.py").read_bytes() == (folders["B"] / "modeling_dflash.py").read_bytes()
    first, second = (folders[t] for t in order.upper())
    m_first = _load(first)
    m_second = _load(second)
    assert _ran(m_second) == f"folder {order[1].upper()}"
    assert _ran(m_first) == f"folder {order[0].upper()}"  # the first model keeps its own loop
    assert _ran(_load(first)) == f"folder {order[0].upper()}"  # and loading it again gives it back


def test_edited_folder_reloads_its_new_code(tmp_path):
    folder = _drafter(tmp_path, "before edit")
    before = _load(folder)
    assert _ran(before) == "before edit"
    _plant(folder, "after edit")
    assert _ran(_load(folder)) == "after edit"
    assert _ran(before) == "before edit"


def test_a_sibling_of_a_sibling_is_fresh_too(tmp_path):
    """A flat file imported only through ``generation_utils`` (e.g. a cache or family helper)."""
    folders = {}
    for tag in "AB":
        folder = tmp_path / tag.lower() / "drafter"
        tiny_draft().save_pretrained(folder)
        (folder / "probe_sibling.py").write_text("def spec_generate(*args, **kwargs):\n"
                                                 f"    raise RuntimeError('sibling {tag}')\n")
        gen = folder / "generation_utils.py"
        gen.write_text(gen.read_text() + "\nfrom .probe_sibling import spec_generate  # noqa: E402,F811\n")
        modeling = folder / "modeling_dflash.py"  # named here too, as the rule below asks
        modeling.write_text(modeling.read_text().replace(
            "    from .generation_utils import", "    from .probe_sibling import spec_generate as _unused\n"
            "    from .generation_utils import", 1))
        folders[tag] = folder
    m_a = _load(folders["A"])
    m_b = _load(folders["B"])
    assert (_ran(m_a), _ran(m_b)) == ("sibling A", "sibling B")
    (folders["A"] / "probe_sibling.py").write_text("def spec_generate(*a, **k):\n    raise RuntimeError('sibling A2')\n")
    assert _ran(_load(folders["A"])) == "sibling A2"


def test_modeling_file_names_every_sibling_file_it_needs():
    """transformers 4.57 copies only the modeling file's DIRECT relative imports of a local folder, so a
    flat file imported only from ``generation_utils.py`` would be missing from its module cache: the
    modeling file must import every file of the relative-import closure itself."""
    modeling = REPO / "modeling_dflash.py"
    closure = {os.path.basename(f)[:-3] for f in get_relative_import_files(str(modeling))}
    assert closure - set(get_relative_imports(str(modeling))) == set()


def test_our_class_imported_directly_is_never_swapped(tmp_path):
    """``DFlashDraftModel.from_pretrained`` from the repository loads with the repository's code."""
    from modeling_dflash import DFlashDraftModel
    from tiny import tiny_target

    folder = _drafter(tmp_path, "folder code")
    model = DFlashDraftModel.from_pretrained(str(folder))
    assert type(model) is DFlashDraftModel
    out = model.spec_generate(tiny_target(), torch.zeros(1, 3, dtype=torch.long), max_new_tokens=2, temperature=0.0)
    assert out.shape == (1, 5)


def test_the_repair_module_itself_runs_from_each_folder(tmp_path, monkeypatch):
    """Two same-named folders whose ``remote_code_cache.py`` differ: each load runs its own folder's repair
    file (the modeling file drops the cached repair module before importing it), in load order."""
    import builtins

    monkeypatch.setattr(builtins, "dflash_repair_runs", [], raising=False)
    folders = {}
    for tag in "AB":
        folder = folders[tag] = tmp_path / tag.lower() / "drafter"
        tiny_draft().save_pretrained(folder)
        repair = folder / "remote_code_cache.py"
        repair.write_text(repair.read_text() + f"\nimport builtins  # noqa: E402\nbuiltins.dflash_repair_runs.append({tag!r})\n")
        _plant(folder, f"folder {tag}")
    m_a, m_b = _load(folders["A"]), _load(folders["B"])
    assert builtins.dflash_repair_runs == ["A", "B"]
    assert (_ran(m_a), _ran(m_b)) == ("folder A", "folder B")


def test_remote_code_load_of_a_folder_without_fc_is_refused_by_name(tmp_path):
    """Issue 34: ``AutoModel.from_pretrained(trust_remote_code=True)`` loaded a copy without ``fc.weight``
    with a random ``fc`` (transformers' load report only); the folder's own code refuses it, naming both."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "drafter"
    tiny_draft().save_pretrained(folder)
    weights = load_file(str(folder / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if k != "fc.weight"}, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{folder}.*missing_keys \['fc.weight'\]"):
        _load(folder)
