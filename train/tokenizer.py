"""Byte-level BPE tokenizer trained on the training split of the corpus.

Special tokens: ``<|endoftext|>`` (id 0; eos = bos = pad) and ``<|mask|>``
(id 1; reserved DFlash ``mask_token_id``, never produced by the corpus).
Byte-level pre-tokenisation without prefix space and a ByteLevel decoder make
``decode(encode(text)) == text`` for any UTF-8 text, including indentation.

CLI: ``python -m train.tokenizer [--vocab-size 4096] [--out pair/target]``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"
MASK = "<|mask|>"


def train_bpe(texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2) -> Tokenizer:
    """Train a raw ``tokenizers.Tokenizer`` (byte-level BPE) on ``texts``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS, MASK],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def wrap(tok: Tokenizer, model_max_length: int = 2048) -> PreTrainedTokenizerFast:
    """Wrap a raw tokenizer as a ``PreTrainedTokenizerFast`` with eos/bos/pad/mask set."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        mask_token=MASK,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
    )


def save_tokenizer(tok: PreTrainedTokenizerFast, out) -> None:
    """``save_pretrained`` + make ``tokenizer_config.json`` loadable by transformers 4.x and 5.x.

    transformers 5 writes ``tokenizer_class: TokenizersBackend`` (unknown to 4.x)
    and load-time keys; we store the portable ``PreTrainedTokenizerFast`` instead.
    """
    tok.save_pretrained(out)
    make_portable(out)


def make_portable(out) -> None:
    """Rewrite ``out/tokenizer_config.json`` in place (idempotent)."""
    path = Path(out) / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["model_input_names"] = ["input_ids", "attention_mask"]  # no token_type_ids (4.x)
    for k in ("is_local", "local_files_only", "backend"):
        cfg.pop(k, None)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def build_tokenizer(texts: Iterable[str], vocab_size: int = 4096) -> PreTrainedTokenizerFast:
    """Train and wrap in one call."""
    return wrap(train_bpe(texts, vocab_size=vocab_size))


def main(argv=None) -> None:
    from train.corpus import build_manifest, iter_texts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--out", default="pair/target")
    args = ap.parse_args(argv)
    train = [e["path"] for e in build_manifest()["train"]]
    tok = build_tokenizer(iter_texts(train), vocab_size=args.vocab_size)
    save_tokenizer(tok, args.out)
    print(f"saved tokenizer (vocab {len(tok)}) to {args.out}")


if __name__ == "__main__":
    main()
