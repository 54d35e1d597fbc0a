"""Corpus: the running Python's standard-library ``.py`` sources.

Test packages, ``site-packages`` and ``lib2to3`` test data are excluded.  Whole
modules are held out deterministically: a file goes to the held-out split when
``int(sha256(relative_path), 16) % 20 == 0`` (about 5%), so the split depends
only on each file's relative path, never on listing order or Python version.

CLI: ``python -m train.corpus [--out pair]`` writes ``corpus_manifest.json``
and ``heldout_prompts.json``.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

HELDOUT_MOD = 20
_EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


def stdlib_root() -> Path:
    """Directory holding the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_excluded(rel: str) -> bool:
    """True for files inside test packages, site-packages or lib2to3 test data."""
    parts = Path(rel).parts
    if any(p in _EXCLUDED_DIRS for p in parts[:-1]):
        return True
    return rel.startswith("lib2to3/tests")


def is_heldout(rel: str) -> bool:
    """Deterministic module-level split on the POSIX relative path."""
    return int(hashlib.sha256(rel.encode("utf-8")).hexdigest(), 16) % HELDOUT_MOD == 0


def list_sources(root: Path | None = None) -> list[str]:
    """Sorted POSIX relative paths of all included ``.py`` files under ``root``."""
    root = Path(root) if root is not None else stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
        for fn in filenames:
            if fn.endswith(".py"):
                rel = (Path(dirpath) / fn).relative_to(root).as_posix()
                if not is_excluded(rel):
                    out.append(rel)
    return sorted(out)


def split(paths: list[str]) -> tuple[list[str], list[str]]:
    """Return ``(train, heldout)`` lists of relative paths (order preserved)."""
    train = [p for p in paths if not is_heldout(p)]
    held = [p for p in paths if is_heldout(p)]
    return train, held


def read_source(root: Path, rel: str) -> str | None:
    """File text as UTF-8, or None when it is not valid UTF-8 (a few stdlib files)."""
    try:
        return (Path(root) / rel).read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None


def iter_texts(rels: list[str], root: Path | None = None):
    """Yield the text of each readable file in ``rels``."""
    root = Path(root) if root is not None else stdlib_root()
    for rel in rels:
        text = read_source(root, rel)
        if text:
            yield text


def _entry(root: Path, rel: str) -> dict:
    return {"path": rel, "sha256": hashlib.sha256((root / rel).read_bytes()).hexdigest()}


def build_manifest(root: Path | None = None) -> dict:
    """Manifest dict: python version plus train/heldout entries with file hashes."""
    root = Path(root) if root is not None else stdlib_root()
    train, held = split(list_sources(root))
    return {
        "python_version": sys.version.split()[0],
        # where the files came from, without naming this machine's paths (files are keyed by relative path)
        "stdlib": "sysconfig.get_paths()['stdlib'] of the Python above",
        "heldout_rule": f"int(sha256(rel_path),16) % {HELDOUT_MOD} == 0",
        "train": [_entry(root, r) for r in train],
        "heldout": [_entry(root, r) for r in held],
    }


def docstring_prompts(text: str, path: str) -> list[dict]:
    """Prompts from every (method or top-level) function with a triple-quoted docstring.

    Prompt text = source from the ``def`` line through the end of the docstring,
    plus the following newline and the indentation of the function body.
    """
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines(keepends=True)
    out = []
    candidates = list(tree.body)
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            candidates.extend(node.body)
    for node in candidates:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if ast.get_docstring(node) is None or len(node.body) < 2:
            continue
        doc = node.body[0]
        start = node.lineno - 1  # def line (decorators excluded)
        body = "".join(lines[start:doc.end_lineno])
        # cut after the docstring's closing quotes on its last line
        last = lines[doc.end_lineno - 1]
        cut = len(body) - len(last) + doc.end_col_offset
        nxt = lines[node.body[1].lineno - 1] if node.body[1].lineno - 1 < len(lines) else ""
        indent = nxt[: len(nxt) - len(nxt.lstrip())]
        if '"""' not in body[:cut] and "'''" not in body[:cut]:
            continue  # keep only conventional triple-quoted docstrings
        out.append({"path": path, "name": node.name, "lineno": node.lineno,
                    "prompt": body[:cut] + "\n" + indent})
    return out


def select_prompts(held: list[str], root: Path | None = None, n: int = 16,
                   max_chars: int = 600) -> list[dict]:
    """Pick ``n`` prompts deterministically, round-robin over held-out modules.

    Prompts longer than ``max_chars`` characters are skipped.
    """
    root = Path(root) if root is not None else stdlib_root()
    per_mod = []
    for rel in held:
        text = read_source(root, rel)
        if not text:
            continue
        ps = [p for p in docstring_prompts(text, rel) if len(p["prompt"]) <= max_chars]
        ps.sort(key=lambda p: hashlib.sha256(f"{p['path']}:{p['name']}:{p['lineno']}".encode()).hexdigest())
        if ps:
            per_mod.append(ps)
    chosen, i = [], 0
    while len(chosen) < n and any(i < len(ps) for ps in per_mod):
        for ps in per_mod:
            if i < len(ps) and len(chosen) < n:
                chosen.append(ps[i])
        i += 1
    return chosen


def left_extend(tokenizer, prompt: str, path: str, lineno: int, length: int, root, files: list[str],
                texts: dict | None = None) -> list[int]:
    """Token ids of ``prompt`` left-extended to ``length`` tokens with text of its own split.

    The prompt is kept whole; in front of it goes the source that precedes it in its own file
    (``path``; found by text, else by ``lineno``), then whole files of ``files`` in the given order
    (``path`` itself skipped), each followed by a newline. Prompts already ``length`` tokens or longer
    are returned as is. The benchmark's prompt-length sweep passes the HELD-OUT files, the long-prompt
    training data the TRAINING files, so neither ever reads the other split.

    Args:
        root: the standard-library folder; ``texts`` an optional ``{rel: text}`` cache.

    Raises:
        ValueError: ``files`` hold too little text to reach ``length`` (says how many tokens they give).
    """
    def read(rel):
        if texts is not None and rel in texts:
            return texts[rel]
        try:
            text = read_source(Path(root), rel) or ""
        except OSError:  # a file listed but not present (another Python's manifest)
            text = ""
        if texts is not None:
            texts[rel] = text
        return text

    def encode(text):  # whole files exceed the tokenizer's model_max_length: no warning, the ids are cut later
        return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]

    ids = encode(prompt)
    if len(ids) >= length:
        return ids
    own = read(path)
    at = own.find(prompt)
    if at < 0:  # fall back to the recorded line
        at = sum(len(l) for l in own.splitlines(keepends=True)[: lineno - 1])
    front = []
    for text in [own[:at]] + [read(f) + "\n" for f in files if f != path]:
        front = encode(text) + front
        if len(front) + len(ids) >= length:
            return (front + ids)[-length:]
    raise ValueError(f"the given files give only {len(front) + len(ids)} tokens, {length} asked for")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="pair", help="output folder")
    ap.add_argument("--n-prompts", type=int, default=16)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    man = build_manifest()
    (out / "corpus_manifest.json").write_text(json.dumps(man, indent=1) + "\n")
    held = [e["path"] for e in man["heldout"]]
    prompts = select_prompts(held, n=args.n_prompts)
    (out / "heldout_prompts.json").write_text(json.dumps(prompts, indent=1) + "\n")
    print(f"train files: {len(man['train'])}  heldout files: {len(held)}  prompts: {len(prompts)}")


if __name__ == "__main__":
    main()
