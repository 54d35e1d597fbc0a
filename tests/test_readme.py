"""The code blocks of README.md and docs/*.md marked `<!-- tested: NAME -->` run, as written, on tiny local
models; every other python block says why it is not run (`<!-- not run: ... -->`)."""

import pathlib
import re

import pytest
import torch

from tiny import tiny_draft, tiny_target, tiny_tokenizer
from versions import newest_transformers_only

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
PAGES = [README, *sorted((README.parent / "docs").glob("*.md"))]


def all_text() -> str:
    return "\n".join(page.read_text() for page in PAGES)


def readme_blocks():
    text = all_text()
    return dict(re.findall(r"<!-- tested: (\w+) -->\n```python\n(.*?)```", text, flags=re.DOTALL))


@pytest.fixture
def hub(tmp_path):
    """Local folders standing in for the Hub repos named in the README."""
    tokenizer = tiny_tokenizer()
    target = tiny_target()
    target.generation_config.eos_token_id = tokenizer.eos_token_id
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    tiny_draft(mask_token_id=tokenizer.mask_token_id).save_pretrained(tmp_path / "draft")
    return {"z-lab/Qwen3-4B-DFlash-b16": str(tmp_path / "draft"), "Qwen/Qwen3-4B": str(tmp_path / "target")}


def test_readme_blocks_run_on_tiny_models(hub, capsys, tmp_path, monkeypatch):
    from modeling_dflash import native_dflash_available

    monkeypatch.chdir(tmp_path)  # as a user runs them: from another folder, the package installed
    blocks = readme_blocks()
    assert set(blocks) == {"pair", "usage", "native", "custom_generate", "batch", "chat", "vision", "trees"}
    namespace, calls, expected = {}, [], None
    for name in ("usage", "native", "custom_generate", "batch"):
        code = blocks[name]
        for repo, folder in hub.items():
            assert repo in code or name != "usage"
            code = code.replace(f'"{repo}"', repr(folder))
        if name == "native" and not native_dflash_available():
            continue  # transformers 4.57.1 has no native DFlash path (the table says so)
        before = len(calls)
        exec(compile(code, f"README:{name}", "exec"), namespace)
        if name == "usage":  # the greedy usage output is the target's own
            target, ids = namespace["target"], namespace["model_inputs"]["input_ids"]
            expected = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=256,
                                       eos_token_id=namespace["tokenizer"].eos_token_id)
            assert torch.equal(namespace["output_ids"], expected)
            namespace["draft"].register_forward_hook(lambda module, args, output: calls.append(1))
        elif name in ("native", "custom_generate"):  # same tokens, and the drafter really ran
            assert torch.equal(namespace["output_ids"], expected), name
            assert len(calls) - before >= 1, f"README:{name} never called the drafter"
    reply = namespace["reply"][0]["generated_text"]
    assert reply[-1]["role"] == "assistant" and reply[-1]["content"]
    out = namespace["out"]
    assert out.sequences.shape[0] == 2 and len(out.num_new_tokens) == 2
    printed = capsys.readouterr().out
    assert "tau =" in printed


@newest_transformers_only
def test_readme_pair_block_runs_on_the_shipped_pair(monkeypatch, capsys):
    """The README's first snippet runs as written against pair/target + pair/drafter (no chat template)."""
    monkeypatch.chdir(README.parent)
    namespace = {}
    exec(compile(readme_blocks()["pair"], "README:pair", "exec"), namespace)
    target, ids = namespace["target"], namespace["input_ids"]
    expected = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=64)
    assert namespace["out"].sequences.tolist() == expected.tolist()
    assert "tau =" in capsys.readouterr().out


def test_readme_trees_block_runs_on_the_shipped_pair(monkeypatch, capsys):
    """The draft-trees snippet: the tree's tokens are the target's own, and it accepts more than the chain."""
    monkeypatch.chdir(README.parent)
    namespace = {}
    exec(compile(readme_blocks()["trees"], "README:trees", "exec"), namespace)
    target, ids = namespace["target"], namespace["input_ids"]
    expected = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=64)
    assert namespace["tree"].sequences.tolist() == expected.tolist()
    assert namespace["tree"].tau > namespace["chain"].tau
    assert "tree of 15 nodes" in capsys.readouterr().out


def test_readme_chat_block_continues_from_the_cache_on_the_shipped_pair(monkeypatch, capsys):
    """The two-turn chat runs as written on the shipped pair, on both versions: identical replies (asserted in
    the block), and turn 2 with reuse prefills only what follows turn 1's cache."""
    monkeypatch.chdir(README.parent)
    exec(compile(readme_blocks()["chat"], "README:chat", "exec"), {})
    printed = capsys.readouterr().out
    assert "reuse=False turn 2: 104 tokens in, prefill computed 104," in printed
    assert "reuse=True turn 2: 104 tokens in, prefill computed 20," in printed


def test_blocks_on_the_tiny_pair_set_one_thread_and_say_why():
    """Pasted on a multi-core machine, code on the shipped pair ran 10-40x slower than the README's
    figures (issue 26): every python block that loads ``pair/`` sets one thread before loading, and the
    text after the pair block states the measured effect. Planted: dropping the call fails."""
    text = all_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    loading = [b for b in blocks if re.search(r"from_pretrained\(\s*\"pair/", b)]
    assert loading, "no README block loads the shipped pair any more: update this test"
    for block in loading:
        call = re.search(r"^torch\.set_num_threads\(1\)", block, flags=re.MULTILINE)  # a statement, not a comment
        assert call and call.start() < block.index("from_pretrained"), block
    after = text[text.index(readme_blocks()["pair"]):][:2000]
    assert "torch.set_num_threads(1)" in after and re.search(r"threads? .*took|took .*thread", after, flags=re.DOTALL)


def test_every_python_block_is_run_or_says_why_not():
    """No python block of the README or docs is silently untested."""
    for page in PAGES:
        text = page.read_text()
        for match in re.finditer(r"(?:(<!--[^>]*-->)\n)?```python\n", text):
            mark = match.group(1) or ""
            line = text[: match.start()].count("\n") + 1
            assert mark.startswith(("<!-- tested: ", "<!-- not run: ")), f"{page.name}:{line}: mark the block"


def test_blocks_import_the_installed_package():
    """One import style that works after ``pip install``, from any folder: a block imports this package's
    modules as ``dflash_hf.<module>``, never by the bare file name of the repository root (which works only
    pasted at the root)."""
    root_modules = {path.stem for path in README.parent.glob("*.py")}
    bare = re.compile(r"^\s*(?:from|import)\s+(\w+)", flags=re.MULTILINE)
    for page in PAGES:
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL):
            for module in bare.findall(block):
                assert module not in root_modules, f"{page.name}: import {module} as dflash_hf.{module}"
