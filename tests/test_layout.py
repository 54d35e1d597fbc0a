"""The layout of the Hub code (issue 20): one concern per flat root module, no import cycle, one source
of truth for every code file (``pair/drafter`` links to the root), regular files in every folder the
package writes, and folders written by an older layout still usable."""

import ast
import os
import pathlib
import shutil
import sys
import tarfile

import pytest
import torch
from transformers import AutoModel

from convert.sources import REMOTE_CODE_FILES, remote_code_files
from tiny import tiny_draft, tiny_target

REPO = pathlib.Path(__file__).resolve().parents[1]
DRAFTER = REPO / "pair" / "drafter"
CUSTOM_GENERATE = "custom_generate/generate.py"
TEMPLATE = "custom_generate_template.py"  # the one source of every custom_generate/generate.py
ROOT_MODULES = sorted(p.stem for p in REPO.glob("*.py"))


def _root(name: str) -> pathlib.Path:
    return REPO / (TEMPLATE if name == CUSTOM_GENERATE else name)


def _imported_root_modules(path: pathlib.Path) -> set:
    """Root modules that ``path`` imports, relatively or not, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level <= 1 and node.module:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
    return found & set(ROOT_MODULES)


def _cycle(graph: dict):
    """One import cycle of ``graph`` as a list of module names, or None."""
    state = {}

    def visit(module, path):
        state[module] = "open"
        for dep in sorted(graph[module]):
            if state.get(dep) == "open":
                return path[path.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep, path + [dep])
                if found:
                    return found
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module, [module])
            if found:
                return found
    return None


def test_root_modules_import_no_cycle_counting_imports_inside_functions():
    graph = {m: _imported_root_modules(REPO / f"{m}.py") - {m} for m in ROOT_MODULES}
    assert graph["generation_utils"] and "generation_utils" not in graph["static_generate"]
    assert _cycle(graph) is None, f"import cycle among the root modules: {' -> '.join(_cycle(graph))}"
    assert _cycle({**graph, "static_generate": graph["static_generate"] | {"generation_utils"}})  # the check bites


def test_no_root_module_is_over_800_lines():
    sizes = {m: len((REPO / f"{m}.py").read_text(encoding="utf-8").splitlines()) for m in ROOT_MODULES}
    assert {m: n for m, n in sizes.items() if n > 800} == {}


def test_remote_code_files_are_the_modeling_files_imports():
    """``REMOTE_CODE_FILES`` is what ``save_pretrained`` copies: the modeling file and its relative imports."""
    assert sorted(REMOTE_CODE_FILES) == sorted(remote_code_files(str(REPO)))


@pytest.mark.parametrize("name", sorted(REMOTE_CODE_FILES) + [CUSTOM_GENERATE])
def test_pair_drafter_code_files_are_links_to_the_root_files(name):
    """pair/drafter runs the root's code through relative git symlinks, so it can never go stale."""
    path = DRAFTER / name
    assert path.is_symlink(), f"pair/drafter/{name} is not a link: ln -sf {os.path.relpath(_root(name), path.parent)} {path}"
    assert not os.path.isabs(os.readlink(path)), f"pair/drafter/{name} links to an absolute path"
    assert os.path.realpath(path) == os.path.realpath(_root(name))


def test_pair_drafter_holds_no_other_code_file():
    code = {p.relative_to(DRAFTER).as_posix() for p in DRAFTER.rglob("*.py") if "__pycache__" not in p.parts}
    assert code == set(REMOTE_CODE_FILES) | {CUSTOM_GENERATE}


def _assert_regular_copies(folder: pathlib.Path):
    for name in list(REMOTE_CODE_FILES) + [CUSTOM_GENERATE]:
        path = folder / name
        assert path.is_file() and not path.is_symlink(), f"{name} is not a regular file in {folder}"
        assert path.read_bytes() == _root(name).read_bytes(), name


def test_folders_written_from_the_linked_drafter_hold_regular_files(tmp_path):
    """save_pretrained of the drafter loaded from pair/drafter (links) and the converter write copies."""
    from convert.convert_checkpoint import convert_checkpoint

    loaded = AutoModel.from_pretrained(str(DRAFTER), trust_remote_code=True)
    assert type(loaded).__module__.startswith("transformers_modules")  # the remote code, through the links
    loaded.save_pretrained(tmp_path / "saved")
    _assert_regular_copies(tmp_path / "saved")
    convert_checkpoint(str(DRAFTER), str(tmp_path / "converted"), verify=False)
    _assert_regular_copies(tmp_path / "converted")


def test_a_folder_written_at_a00c5de_still_loads_renders_and_pushes(tmp_path):
    """A drafter saved before the split (six code files; tests/fixtures/README.md) keeps working."""
    from convert.push_to_hub import push_to_hub
    from model_cards.render import render_model_card

    folder = tmp_path / "old_layout"
    tiny_draft().save_pretrained(folder)
    for name in list(REMOTE_CODE_FILES) + [CUSTOM_GENERATE]:
        os.remove(folder / name)
    with tarfile.open(REPO / "tests" / "fixtures" / "layout_a00c5de.tar.gz") as tar:
        tar.extractall(folder, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    assert sorted(remote_code_files(str(folder))) == ["configuration_dflash.py", "generation_utils.py",
                                                      "modeling_dflash.py", "static_generate.py", "target_cache.py",
                                                      "target_families.py"]
    draft = AutoModel.from_pretrained(str(folder), trust_remote_code=True).eval()
    ran = pathlib.Path(sys.modules[type(draft).__module__].__file__)
    assert ran.read_bytes() == (folder / "modeling_dflash.py").read_bytes()  # the old modeling file runs
    target, ids = tiny_target(peaked=True), torch.tensor([[5, 9, 2, 7]])
    out = draft.spec_generate(target, ids, max_new_tokens=12, temperature=0.0)
    assert torch.equal(out, target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False))
    card = str(render_model_card(str(folder), "me/draft", license="mit", target_id="Qwen/Qwen3-8B"))
    assert "custom_code" in card
    plan = push_to_hub(str(folder), "me/draft", license="mit", dry_run=True, target_id="Qwen/Qwen3-8B")
    assert "generation_utils.py" in plan.files and "decode_step.py" not in plan.files
    shutil.rmtree(folder / "custom_generate")
    os.remove(folder / "target_cache.py")  # a file its own modeling file imports: refused, named
    with pytest.raises(Exception, match="target_cache.py"):
        push_to_hub(str(folder), "me/draft", license="mit", dry_run=True, target_id="Qwen/Qwen3-8B")
