"""Prompt sources of the benchmark: the embedded held-out prompts, local JSONL files, five public
evaluation sets through ``datasets``, the chat template, and prompts left-extended to a set length.

The dataset adapters use each set's own column layout (the same prompt formats as the DFlash
authors' benchmark). Tests feed them tiny local files in that layout; the Hub path
(``datasets.load_dataset(<hub id>)``) is untested here because the test machines have no Hub access.
"""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HELDOUT = ROOT / "pair" / "heldout_prompts.json"
MANIFEST = ROOT / "pair" / "corpus_manifest.json"

_REASON = "\nPlease reason step by step, and put your final answer within \\boxed{{}}."

# name -> (hub load_dataset args, split, formatter row -> list of user turns)
DATASETS = {
    "gsm8k": (("openai/gsm8k", "main"), "test", lambda r: [("{question}" + _REASON).format(**r)]),
    "math500": (("HuggingFaceH4/MATH-500",), "test", lambda r: [("{problem}" + _REASON).format(**r)]),
    "humaneval": (("openai/openai_humaneval",), "test", lambda r: [
        "Write a solution to the following problem and make sure that it passes the tests:\n"
        "```python\n{prompt}\n```".format(**r)]),
    "mbpp": (("google-research-datasets/mbpp", "sanitized"), "test", lambda r: [r["prompt"]]),
    "mt-bench": (("HuggingFaceH4/mt_bench_prompts",), "train", lambda r: list(r["prompt"])),
}


def dataset_prompts(name: str, data_files=None, limit: int | None = None) -> list[dict]:
    """Prompts ``[{"id", "turns": [str, ...]}]`` of one evaluation set.

    Args:
        name: one of ``DATASETS`` (gsm8k, math500, humaneval, mbpp, mt-bench).
        data_files: a local JSON/JSONL file (or list) in the set's column layout; None loads the
            Hub copy (untested here: no Hub access on the test machines).
        limit: keep the first ``limit`` rows.

    Raises:
        ValueError: an unknown ``name``, or a row without the set's columns (names the column).
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; expected one of {sorted(DATASETS)}")
    import datasets

    hub_args, split, fmt = DATASETS[name]
    if data_files is not None:
        rows = datasets.load_dataset("json", data_files=[str(f) for f in _as_list(data_files)], split="train")
    else:
        rows = datasets.load_dataset(*hub_args, split=split)
    out = []
    for i, row in enumerate(rows):
        if limit is not None and i >= limit:
            break
        try:
            turns = fmt(row)
        except KeyError as err:
            raise ValueError(f"{name} row {i} has no column {err}; columns are {sorted(row)}") from None
        out.append({"id": f"{name}/{i}", "turns": turns})
    return out


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def local_prompts(path, limit: int | None = None) -> list[dict]:
    """Prompts from a local file: a JSON list (of strings, or of objects such as ``pair/heldout_prompts.json``)
    or JSONL (one string or object per line), whatever the suffix. An object holds ``prompt``, ``text`` or
    ``turns`` (a list of user turns). Returns ``[{"id", "turns", ...}]`` (held-out records keep ``path``
    and ``lineno`` for the length sweep).

    Raises:
        ValueError: the file is neither JSON nor JSONL, holds no prompt, or a record has none of
            ``prompt`` / ``text`` / ``turns`` (named with its index).
        OSError: the file cannot be read.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        records = json.loads(text)
        if not isinstance(records, list):
            records = [records]
    except json.JSONDecodeError:
        records = []
        for n, line in enumerate(text.splitlines(), start=1):
            try:
                records += [json.loads(line)] if line.strip() else []
            except json.JSONDecodeError as err:
                raise ValueError(f"{path} is neither a JSON list nor JSONL (line {n}: {err.msg}); expected a list "
                                 "of prompts, or one prompt per line") from None
    out = []
    for i, rec in enumerate(records[:limit] if limit is not None else records):
        if isinstance(rec, str):
            rec = {"prompt": rec}
        turns = (rec.get("turns") or [rec.get("prompt", rec.get("text"))]) if isinstance(rec, dict) else [None]
        if not isinstance(turns, list) or not all(isinstance(t, str) and t for t in turns):
            have = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
            raise ValueError(f"{path} record {i} needs a non-empty string, or an object with 'prompt', 'text' or "
                             f"'turns'; it has {have}")
        out.append({**rec, "id": rec.get("id", f"{path.name}/{i}"), "turns": list(turns)})
    if not out:
        raise ValueError(f"{path} holds no prompt")
    return out


def render(tokenizer, turns: list[str], chat_template: bool, enable_thinking: bool = False) -> str:
    """The text a prompt is encoded from: the first user turn as is, or through the tokenizer's chat
    template with ``add_generation_prompt=True`` and ``enable_thinking`` (Qwen3 templates read it).
    Multi-turn sets (mt-bench) are measured on their first turn.

    Raises:
        ValueError: ``chat_template`` asked for and the tokenizer has none.
    """
    if not chat_template:
        return turns[0]
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"--chat-template: the tokenizer {tokenizer.name_or_path!r} has no chat template")
    return tokenizer.apply_chat_template([{"role": "user", "content": turns[0]}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=enable_thinking)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------- prompt-length sweep


def heldout_files(manifest=MANIFEST) -> list[str]:
    """Held-out source paths (relative to the standard library) in manifest order."""
    return [e["path"] for e in json.loads(Path(manifest).read_text())["heldout"]]


def more_heldout_prompts(tokenizer, n: int, root=None) -> list[list[int]]:
    """Token ids of ``n`` distinct held-out prompts: the shipped ones first, then more picked the same way
    from the same held-out files (``train.corpus.select_prompts``, round-robin over the modules), for batch
    sizes beyond the 16 shipped prompts (``--batch-sizes 32``).

    Raises ValueError when the held-out files hold fewer than ``n`` prompts."""
    from train.corpus import select_prompts, stdlib_root

    records = select_prompts(heldout_files(), Path(root) if root is not None else stdlib_root(), n=n)
    if len(records) < n:
        raise ValueError(f"the held-out files hold {len(records)} prompts, fewer than {n}")
    return [encode(tokenizer, r["prompt"]) for r in records]


def extend_prompt(tokenizer, record: dict, length: int, root=None, files: list[str] | None = None) -> list[int]:
    """Token ids of a held-out prompt left-extended to ``length`` tokens.

    The prompt is kept whole; in front of it goes the text that precedes it in its own source file,
    then whole other held-out files (manifest order), so the extension is text the target and the
    drafter never trained on. Prompts already longer than ``length`` are returned unchanged.

    Args:
        record: a held-out prompt record (``path``, ``lineno``, ``turns``/``prompt``).
        root: the standard-library folder the corpus was built from (default: this interpreter's).
        files: the held-out paths (default: ``pair/corpus_manifest.json``).

    Raises:
        ValueError: not enough held-out text to reach ``length``.
    """
    from train.corpus import left_extend, stdlib_root

    root = Path(root) if root is not None else stdlib_root()
    try:
        return left_extend(tokenizer, record["turns"][0], record["path"], record.get("lineno", 1), length, root,
                           files or heldout_files())
    except ValueError as e:
        raise ValueError(f"held-out text: {e}") from None
