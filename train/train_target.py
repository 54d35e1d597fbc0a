"""Train the small target causal LM (Qwen3 architecture) on the stdlib corpus.

One command reproduces ``pair/target`` from scratch::

    python -m train.train_target            # ~55 min on 1 CPU thread

Steps: write ``pair/corpus_manifest.json`` + ``pair/heldout_prompts.json``,
train the BPE tokenizer, pack the training split into ``seq_len``-token rows
(files joined by ``<|endoftext|>``), train with AdamW + warmup/cosine, grad
clip 1.0, fp32.  The LR schedule progress is
``max(step / max_steps, elapsed / max_minutes)`` so a time-bounded run still
anneals to its floor.  Checkpoints (model + optimizer + step + data position)
go to ``--ckpt-dir`` (outside git) and ``--resume`` continues from there.
At the end the held-out loss is measured on the reloaded shipped weights and
everything is written to ``--summary``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig,
                          Qwen3Config, Qwen3ForCausalLM)
import transformers

from train import corpus
from train import tokenizer as tok_mod


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = ap.add_argument
    # model
    a("--hidden", type=int, default=192)
    a("--layers", type=int, default=6)
    a("--heads", type=int, default=6)
    a("--kv-heads", type=int, default=2)
    a("--head-dim", type=int, default=32)
    a("--intermediate", type=int, default=512)
    a("--vocab-size", type=int, default=4096)
    a("--max-pos", type=int, default=2048)
    # optimisation
    a("--seq-len", type=int, default=512)
    a("--batch", type=int, default=8, help="rows per step (tokens/step = batch*seq_len)")
    a("--lr", type=float, default=2e-3)
    a("--min-lr-ratio", type=float, default=0.1)
    a("--warmup", type=int, default=40, help="warmup steps")
    a("--weight-decay", type=float, default=0.1)
    a("--max-steps", type=int, default=100000)
    a("--max-minutes", type=float, default=55.0, help="training wall-clock budget")
    a("--seed", type=int, default=0)
    a("--threads", type=int, default=1, help="torch.set_num_threads")
    # io
    a("--out", default="pair/target")
    a("--pair-dir", default="pair", help="where manifest/prompts are written")
    a("--log", default="pair/target_train_log.jsonl")
    a("--summary", default="pair/target_train_summary.json")
    a("--ckpt-dir", default=".cache/target_ckpt")
    a("--ckpt-every", type=int, default=50, help="steps between checkpoints")
    a("--log-every", type=int, default=10)
    a("--eval-every", type=int, default=100)
    a("--eval-rows", type=int, default=24, help="held-out rows for periodic eval")
    a("--save-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    a("--resume", action="store_true")
    return ap.parse_args(argv)


def make_config(args, tok) -> Qwen3Config:
    """Qwen3 config for the target; tied embeddings, eos = bos = pad."""
    return Qwen3Config(
        vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        max_position_embeddings=args.max_pos, tie_word_embeddings=True,
        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, use_cache=True,
    )


def token_stream(tok, rels, root=None) -> torch.Tensor:
    """All files tokenised and joined, each followed by eos. Shape ``[n_tokens]`` int64."""
    ids = []
    for text in corpus.iter_texts(rels, root):
        ids.extend(tok(text, add_special_tokens=False)["input_ids"])
        ids.append(tok.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def rows(stream: torch.Tensor, seq_len: int, offset: int = 0) -> torch.Tensor:
    """Non-overlapping rows ``[n_rows, seq_len]`` from ``stream[offset:]``."""
    s = stream[offset:]
    n = s.numel() // seq_len
    return s[: n * seq_len].view(n, seq_len)


def epoch_rows(stream, seq_len, seed, epoch) -> torch.Tensor:
    """Shuffled rows for one epoch; offset and order depend only on (seed, epoch)."""
    g = torch.Generator().manual_seed(seed * 1000003 + epoch)
    off = int(torch.randint(seq_len, (1,), generator=g))
    r = rows(stream, seq_len, off)
    return r[torch.randperm(r.shape[0], generator=g)]


def lr_at(step, elapsed_s, args) -> float:
    """Linear warmup then cosine to ``min_lr_ratio * lr``; progress uses steps or time."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    prog = max(step / args.max_steps, elapsed_s / (60 * args.max_minutes))
    prog = min(1.0, prog)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * prog)))


@torch.no_grad()
def eval_loss(model, data: torch.Tensor, batch: int = 8) -> float:
    """Mean next-token cross-entropy (nats/token) over rows ``data [n, L]``."""
    model.eval()
    tot, n = 0.0, 0
    for i in range(0, data.shape[0], batch):
        x = data[i:i + batch]
        logits = model(input_ids=x).logits[:, :-1].float()
        tot += torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum").item()
        n += x[:, 1:].numel()
    model.train()
    return tot / n


def unigram_loss(train_stream, held_stream, vocab) -> float:
    """Held-out cross-entropy (nats/token) of an add-one unigram model fit on train."""
    counts = torch.bincount(train_stream, minlength=vocab).double() + 1
    logp = (counts / counts.sum()).log()
    return float(-logp[held_stream].mean())


def save_ckpt(path: Path, model, opt, state) -> None:
    """Atomic checkpoint write: model + optimizer + training state."""
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / "ckpt.pt.tmp"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state}, tmp)
    os.replace(tmp, path / "ckpt.pt")


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    torch.manual_seed(args.seed)
    ckpt_dir = Path(args.ckpt_dir)
    out = Path(args.out)

    # data + tokenizer
    root = corpus.stdlib_root()
    man = corpus.build_manifest(root)
    pair = Path(args.pair_dir)
    pair.mkdir(parents=True, exist_ok=True)
    (pair / "corpus_manifest.json").write_text(json.dumps(man, indent=1) + "\n")
    held_rel = [e["path"] for e in man["heldout"]]
    train_rel = [e["path"] for e in man["train"]]
    (pair / "heldout_prompts.json").write_text(
        json.dumps(corpus.select_prompts(held_rel, root), indent=1) + "\n")
    tok_dir = ckpt_dir / "tokenizer"
    if args.resume and (tok_dir / "tokenizer.json").exists():
        tok = AutoTokenizer.from_pretrained(tok_dir)
    else:
        tok = tok_mod.build_tokenizer(corpus.iter_texts(train_rel, root), args.vocab_size)
        tok_mod.save_tokenizer(tok, tok_dir)
    train_stream = token_stream(tok, train_rel, root)
    held_stream = token_stream(tok, held_rel, root)
    held_rows = rows(held_stream, args.seq_len)
    g = torch.Generator().manual_seed(1234)
    eval_rows = held_rows[torch.randperm(held_rows.shape[0], generator=g)[: args.eval_rows]]
    print(f"train tokens {train_stream.numel()}  held-out tokens {held_stream.numel()}")

    # model + optimiser
    cfg = make_config(args, tok)
    model = Qwen3ForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params} ({n_params / 1e6:.2f} M)")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    state = {"step": 0, "epoch": 0, "pos": 0, "elapsed_s": 0.0, "tokens": 0}
    if args.resume and (ckpt_dir / "ckpt.pt").exists():
        ck = torch.load(ckpt_dir / "ckpt.pt", map_location="cpu", weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        state = ck["state"]
        print(f"resumed at step {state['step']} ({state['elapsed_s'] / 60:.1f} min)")
    else:
        Path(args.log).parent.mkdir(parents=True, exist_ok=True)
        Path(args.log).write_text("")
    log = open(args.log, "a")

    def log_line(d):
        log.write(json.dumps(d) + "\n")
        log.flush()

    # training loop
    model.train()
    data = epoch_rows(train_stream, args.seq_len, args.seed, state["epoch"])
    t_start = time.time() - state["elapsed_s"]
    budget_s = 60 * args.max_minutes
    pbar = tqdm(total=args.max_steps, initial=state["step"], mininterval=10, dynamic_ncols=True)
    win_loss, win_n, win_t = 0.0, 0, 0.0  # win_t: seconds spent in train steps only
    while state["step"] < args.max_steps and time.time() - t_start < budget_s:
        if state["pos"] + args.batch > data.shape[0]:
            state["epoch"] += 1
            state["pos"] = 0
            data = epoch_rows(train_stream, args.seq_len, args.seed, state["epoch"])
        x = data[state["pos"]: state["pos"] + args.batch]
        lr = lr_at(state["step"], time.time() - t_start, args)
        for grp in opt.param_groups:
            grp["lr"] = lr
        t0 = time.time()
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        win_t += time.time() - t0
        state["step"] += 1
        state["pos"] += args.batch
        state["tokens"] += x.numel()
        state["elapsed_s"] = time.time() - t_start
        win_loss += loss.item()
        win_n += 1
        pbar.update(1)
        if state["step"] % args.log_every == 0:
            rec = {"step": state["step"], "loss": win_loss / win_n, "lr": lr,
                   "grad_norm": float(gnorm), "tokens": state["tokens"], "epoch": state["epoch"],
                   "elapsed_s": round(state["elapsed_s"], 1),
                   "tok_per_s": round(win_n * x.numel() / win_t, 1)}
            log_line(rec)
            pbar.set_postfix(loss=f"{rec['loss']:.3f}", tps=rec["tok_per_s"])
            win_loss, win_n, win_t = 0.0, 0, 0.0
        if state["step"] % args.eval_every == 0:
            log_line({"step": state["step"], "heldout_loss": eval_loss(model, eval_rows),
                      "elapsed_s": round(time.time() - t_start, 1)})
        if state["step"] % args.ckpt_every == 0:
            save_ckpt(ckpt_dir, model, opt, state)
    pbar.close()
    train_s = time.time() - t_start
    save_ckpt(ckpt_dir, model, opt, state)

    # save shipped weights (lower precision) + tokenizer + generation config
    out.mkdir(parents=True, exist_ok=True)
    save_dtype = getattr(torch, args.save_dtype)
    model.eval()
    model.to(save_dtype).save_pretrained(out)
    tok_mod.save_tokenizer(tok, out)
    GenerationConfig(bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id, do_sample=False).save_pretrained(out)

    # evaluate exactly what ships: reload in float32
    shipped = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    stok = AutoTokenizer.from_pretrained(out)
    held_loss = eval_loss(shipped, held_rows)
    uni = unigram_loss(train_stream, held_stream, len(tok))
    prompts = json.loads((pair / "heldout_prompts.json").read_text())
    samples = []
    for p in prompts[:4]:
        enc = stok(p["prompt"], return_tensors="pt", add_special_tokens=False)
        gen = shipped.generate(**enc, max_new_tokens=48, do_sample=False)
        samples.append({"path": p["path"], "prompt": p["prompt"],
                        "completion": stok.decode(gen[0, enc["input_ids"].shape[1]:])})
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    summary = {
        "args": vars(args), "config": cfg.to_dict(), "n_params": n_params,
        "weights_bytes": size, "saved_dtype": args.save_dtype,
        "steps": state["step"], "epochs_started": state["epoch"] + 1,
        "tokens_seen": state["tokens"], "train_wall_s": round(train_s, 1),
        "mean_tok_per_s": round(state["tokens"] / max(train_s, 1e-9), 1),
        "train_tokens": train_stream.numel(), "heldout_tokens": held_stream.numel(),
        "heldout_loss_shipped_fp32": held_loss, "heldout_ppl": math.exp(held_loss),
        "unigram_heldout_loss": uni,
        "n_train_files": len(train_rel), "n_heldout_files": len(held_rel),
        "python_version": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "cpu_threads": args.threads,
        "greedy_samples": samples,
    }
    Path(args.summary).write_text(json.dumps(summary, indent=1) + "\n")
    print(f"held-out loss {held_loss:.4f} (unigram {uni:.4f}); weights {size / 1e6:.2f} MB")
    for s in samples[:2]:
        print("----", s["path"], "\n" + s["prompt"] + "<<<" + s["completion"])


if __name__ == "__main__":
    main(sys.argv[1:])
