"""Fast CPU tests for train/corpus.py and train/tokenizer.py (no network, no training run)."""
import json
import textwrap
from pathlib import Path

import pytest

from train import corpus

REPO = Path(__file__).resolve().parents[1]

SRC = textwrap.dedent('''\
    import os


    def top(a, b=1):
        """Add two numbers.

        Returns the sum.
        """
        return a + b


    class K:
        def meth(self):
            """One-line doc."""
            if self:
                return {"x": [1, 2]}\t# tab comment
            return None

        def nodoc(self):
            return 3
    ''')


def test_split_deterministic_and_disjoint():
    paths = [f"pkg{i}/mod{j}.py" for i in range(30) for j in range(10)]
    train, held = corpus.split(paths)
    train2, held2 = corpus.split(list(reversed(paths)))
    assert set(train) == set(train2) and set(held) == set(held2)
    assert not set(train) & set(held)
    assert set(train) | set(held) == set(paths)
    assert 0 < len(held) < len(paths) // 5  # ~5%
    assert all(corpus.is_heldout(p) for p in held)


def test_exclusions():
    for rel in ["test/test_os.py", "unittest/test/test_case.py", "idlelib/idle_test/test_x.py",
                "lib2to3/tests/data/bom.py", "site-packages/pip/__init__.py", "ctypes/tests/x.py"]:
        assert corpus.is_excluded(rel), rel
    for rel in ["os.py", "asyncio/events.py", "unittest/case.py", "test_like_name.py"]:
        assert not corpus.is_excluded(rel), rel


def test_list_sources_on_tmp_tree(tmp_path):
    for rel in ["a.py", "pkg/b.py", "pkg/tests/t.py", "test/x.py", "pkg/c.txt"]:
        f = tmp_path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("x = 1\n")
    assert corpus.list_sources(tmp_path) == ["a.py", "pkg/b.py"]


def test_docstring_prompts():
    ps = corpus.docstring_prompts(SRC, "m.py")
    assert [p["name"] for p in ps] == ["top", "meth"]
    assert ps[0]["prompt"].startswith("def top(a, b=1):\n")
    assert ps[0]["prompt"].endswith('"""\n    ')
    assert ps[1]["prompt"] == '    def meth(self):\n        """One-line doc."""\n        '
    for p in ps:  # prompt is a verbatim prefix of a slice of the source
        assert p["prompt"].rstrip(" ") in SRC


@pytest.mark.parametrize("name", ["corpus_manifest.json", "heldout_prompts.json"])
def test_shipped_files_parse(name):
    path = REPO / "pair" / name
    if not path.exists():
        pytest.skip(f"{path} not generated")
    data = json.loads(path.read_text())
    if name == "corpus_manifest.json":
        train = {e["path"] for e in data["train"]}
        held = {e["path"] for e in data["heldout"]}
        assert data["python_version"] and train and held and not train & held
        assert all(len(e["sha256"]) == 64 for e in data["train"] + data["heldout"])
        assert all(corpus.is_heldout(p) for p in held)
        assert not any(corpus.is_heldout(p) for p in train)
    else:
        assert len(data) >= 8
        for p in data:
            assert corpus.is_heldout(p["path"])
            assert p["prompt"].lstrip().startswith(("def ", "async def "))
            assert '"""' in p["prompt"] or "'''" in p["prompt"]


def test_tokenizer_roundtrip_and_mask(tmp_path):
    from transformers import AutoTokenizer

    from train import tokenizer as tk

    texts = [SRC, "x = {'a': 1}\n" * 5, "def f():\n\tpass\n\n\n# ünïcode ✓\n"] * 3
    tok = tk.build_tokenizer(texts, vocab_size=400)
    tk.save_tokenizer(tok, tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"  # loadable by 4.x and 5.x
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert tok.mask_token == tk.MASK and tok.mask_token_id is not None
    assert tok.eos_token == tok.pad_token == tk.EOS
    assert tok.mask_token_id != tok.eos_token_id
    probe = SRC + "\n    \n\t\tdef  g( ):  # two  spaces\r\n" + "ünïcode ✓ 😀\n"
    enc = tok(probe)
    assert "token_type_ids" not in enc  # generate() on 4.x rejects it
    ids = enc["input_ids"]
    assert ids == tok(probe, add_special_tokens=False)["input_ids"]  # no bos/eos added
    assert tok.decode(ids) == probe
    assert tok.mask_token_id not in ids
    # special tokens are atomic
    assert tok(tk.MASK + tk.EOS, add_special_tokens=False)["input_ids"] == [tok.mask_token_id, tok.eos_token_id]


def _heldout_only_lines(root):
    """Lines (stripped, >= 40 chars) of held-out modules that no training module contains."""
    train_rel, held_rel = corpus.split(corpus.list_sources(root))
    seen = {l.strip() for t in corpus.iter_texts(train_rel, root) for l in t.splitlines()}
    return {l.strip() for t in corpus.iter_texts(held_rel, root) for l in t.splitlines()
            if len(l.strip()) >= 40 and l.strip() not in seen}


def test_long_training_prompts_never_contain_heldout_text():
    """Issue 15: the long-prompt training data is left-extended with TRAINING-split source only, so the
    benchmark's length sweep (held-out modules) measures text the drafter never saw. Checked on the
    decoded prompts against every held-out-only line; the same check fires on a prompt extended with
    held-out files (so it can fail)."""
    from transformers import AutoTokenizer

    from train import data

    root = corpus.stdlib_root()
    held_lines = _heldout_only_lines(root)
    if len(held_lines) < 100:
        pytest.skip(f"this Python's standard library gives only {len(held_lines)} held-out-only lines")
    tok = AutoTokenizer.from_pretrained(REPO / "pair" / "target")

    def leaks(ids):
        return [l for l in tok.decode(ids).splitlines() if l.strip() in held_lines]

    ids = data.long_training_prompt_ids(tok, 24, (700, 1100), fraction=0.9, seed=3)
    assert sum(len(x) >= 700 for x in ids) >= 15  # most prompts really are long
    assert all(not leaks(x) for x in ids)
    _, held_rel = corpus.split(corpus.list_sources(root))
    rec = data.training_prompt_records(1, seed=3)[0]
    planted = corpus.left_extend(tok, rec["prompt"], rec["path"], rec["lineno"], 3000, root, held_rel)
    assert leaks(planted)


def test_long_training_prompts_are_deterministic_and_validate_their_arguments():
    from transformers import AutoTokenizer

    from train import data

    tok = AutoTokenizer.from_pretrained(REPO / "pair" / "target")
    a = data.long_training_prompt_ids(tok, 6, (64, 300), fraction=0.5, seed=1)
    assert a == data.long_training_prompt_ids(tok, 6, (64, 300), fraction=0.5, seed=1)
    short = [tok(p, add_special_tokens=False)["input_ids"] for p in data.training_prompts(6, seed=1)]
    for x, s in zip(a, short):
        assert x[-len(s):] == s  # the prompt itself is kept whole at the end
        assert x == s or 64 <= len(x) <= 300
    with pytest.raises(ValueError, match="lo <= hi"):
        data.long_training_prompt_ids(tok, 2, (300, 64), fraction=0.5)
    with pytest.raises(ValueError, match="fraction"):
        data.long_training_prompt_ids(tok, 2, (64, 300), fraction=1.5)
