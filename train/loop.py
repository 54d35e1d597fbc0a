"""The drafter training loop on ``accelerate``: data parallel over processes/GPUs, gradient accumulation,
mixed precision, checkpoints and resume through accelerate's state, trackers when installed.

The same :func:`train_drafter` runs in a notebook (one process, no launcher) and under
``accelerate launch`` / ``torchrun`` (one call per process).

Data parallel contract (what makes N processes train exactly like one):

* one optimizer step consumes a GLOBAL batch of ``batch_size x num_processes x grad_accum`` sequences,
  taken in order from the epoch's shuffled order (seeded by ``(seed, epoch)``); micro-batch ``m`` of
  process ``r`` holds global rows ``[(m P + r) b, (m P + r + 1) b)``; an epoch has
  ``num_examples // global_batch`` steps (the remainder, different each epoch, is skipped);
* anchors are drawn from a generator seeded by ``(seed, epoch, example index)``: a sequence gets the
  same blocks whichever process trains it;
* each micro-batch's loss is ``sum(w * ce)`` divided by ``sum(w)`` over ALL processes (one all-reduce),
  so the data-parallel gradient and the logged loss equal those of one process on the global batch.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from train.blocks import drafter_loss, loss_weights, pack_batch, sample_anchors
from train.selector import dflash2_loss
from train.evaluate import acceptance_stats, eval_loss, eval_selector
from train.features import ListFeatures

TRAINER_STATE = "trainer_state.json"
ACCELERATE_STATE = "accelerate_state"


@dataclass
class TrainConfig:
    """Optimisation settings of :func:`train_drafter` (all recorded in the log and summary).

    Defaults are the published recipe (DFlash paper, section 4 and appendix): AdamW lr 6e-4, 4% warmup
    then cosine, grad clip 1.0, 6 epochs, up to 512 anchors per sequence.
    """

    num_anchors: int = 512  # anchors per sequence, resampled each epoch
    batch_size: int = 4  # sequences per micro-batch per process
    grad_accum: int = 1  # micro-batches per optimizer step
    epochs: int = 6
    lr: float = 6e-4
    min_lr_ratio: float = 0.0
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.95)
    clip: float = 1.0
    gamma: Optional[float] = None  # None -> default_gamma(block_size)
    max_minutes: Optional[float] = None  # wall-clock budget; the cosine then runs on max(step, time) progress
    max_steps: Optional[int] = None
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100  # steps between held-out loss + tau measurements (0 = only at the end)
    ckpt_every: int = 100  # steps between checkpoints (0 = only at the end)
    keep_checkpoints: int = 2
    eval_max_new_tokens: int = 64
    progress: bool = True
    selector_alpha: float = 1.0  # DFlash 2 only: weight of the selector loss (train/selector.py)
    selector_lr_scale: float = 1.0  # DFlash 2 only: the candidate selector's lr is lr x this


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`train_drafter`: ``step`` reached and the ``checkpoint`` to resume from (None
    when none was written)."""

    def __init__(self, step: int, checkpoint: Optional[Path]):
        super().__init__(f"interrupted at step {step}")
        self.step, self.checkpoint = step, checkpoint


def make_accelerator(cpu: Optional[bool] = None, mixed_precision: str = "no", log_with=None, project_dir=None):
    """An ``accelerate.Accelerator``; ``cpu`` defaults to "no CUDA device", which makes a launch of N
    processes on a machine without GPUs run N gloo CPU processes (without ``cpu=True`` accelerate would
    start N independent single processes)."""
    from accelerate import Accelerator

    if cpu is None:
        cpu = not torch.cuda.is_available()
    return Accelerator(cpu=cpu, mixed_precision=mixed_precision, log_with=log_with, project_dir=project_dir)


def lr_at(step: int, total_steps: int, elapsed_s: float, cfg: TrainConfig) -> float:
    """Linear warmup over ``warmup_ratio * total_steps`` then cosine to ``min_lr_ratio * lr``.

    Progress is ``max(step / total_steps, elapsed_s / budget)`` when ``cfg.max_minutes`` is set, so a
    time-bounded run still anneals.
    """
    warm = max(1, int(round(cfg.warmup_ratio * total_steps)))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    prog = (step - warm) / max(1, total_steps - warm)
    if cfg.max_minutes:
        prog = max(prog, elapsed_s / (60 * cfg.max_minutes))
    prog = min(1.0, prog)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * prog)))


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The shuffled order of ``n`` examples in ``epoch`` (same on every process)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000003 + epoch))


def anchor_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """Anchors depend only on (seed, epoch, example index): resampled each epoch, identical on resume and
    on whichever process trains the example."""
    return torch.Generator().manual_seed((seed * 1000003 + epoch) * 1000033 + index)


def steps_per_epoch(num_examples: int, global_batch: int) -> int:
    """``num_examples // global_batch``. Raises ValueError when one global batch does not fit."""
    if num_examples < global_batch:
        raise ValueError(f"{num_examples} training sequences cannot fill one global batch of {global_batch} "
                         "(batch x processes x grad-accum); lower --batch or --grad-accum, or add data")
    return num_examples // global_batch


def micro_batch_indices(rows: torch.Tensor, micro: int, rank: int, batch_size: int, num_processes: int) -> list:
    """Example indices of micro-batch ``micro`` on process ``rank`` from one global batch ``rows``."""
    start = (micro * num_processes + rank) * batch_size
    return rows[start:start + batch_size].tolist()


# ----------------------------------------------------------------------------- checkpoints


def latest_checkpoint(ckpt_dir) -> Optional[Path]:
    """The newest complete ``checkpoint-<step>`` folder (one with ``trainer_state.json``), or None."""
    ckpt_dir = Path(ckpt_dir)
    done = [p for p in ckpt_dir.glob("checkpoint-*")
            if p.name.split("-", 1)[1].isdigit() and (p / TRAINER_STATE).exists()]
    return max(done, key=lambda p: int(p.name.split("-")[1])) if done else None


def save_checkpoint(accelerator, ckpt_dir, model, state: dict, keep: int = 2) -> Path:
    """``ckpt_dir/checkpoint-<step>/``: ``save_pretrained`` of the draft (fp32; loads with
    ``AutoModel.from_pretrained(path, trust_remote_code=True)``), ``accelerate_state/`` (model, optimizer,
    RNG of every process: ``accelerator.save_state``) and ``trainer_state.json`` (step, epoch, position).

    Every process must call it. Written as ``checkpoint-<step>.tmp`` and renamed, so a ``checkpoint-<step>``
    folder is complete; the newest ``keep`` are kept.
    """
    ckpt_dir = Path(ckpt_dir)
    path, tmp = ckpt_dir / f"checkpoint-{state['step']}", ckpt_dir / f"checkpoint-{state['step']}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / ACCELERATE_STATE).mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp / ACCELERATE_STATE))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(tmp)
        (tmp / TRAINER_STATE).write_text(json.dumps({"state": state}) + "\n")
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        done = sorted((p for p in ckpt_dir.glob("checkpoint-*")
                       if p.name.split("-", 1)[1].isdigit() and (p / TRAINER_STATE).exists()),
                      key=lambda p: int(p.name.split("-")[1]))
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return path


def read_log(path) -> list[dict]:
    """Records of a JSONL training log (blank lines skipped)."""
    if not path or not Path(path).exists():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _trim_log(path, step: int) -> dict:
    """Drop records logged after ``step`` by an interrupted run; return the last eval record kept."""
    kept = [r for r in read_log(path) if r.get("step", 0) <= step]
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in kept))
    evals = [r for r in kept if "tau" in r or "heldout_loss" in r]
    return evals[-1] if evals else {}


# ----------------------------------------------------------------------------- the loop


def _param_groups(draft, selector_lr_scale: float) -> list:
    """AdamW groups: the backbone (and convolutions) at the schedule's lr, a DFlash 2 drafter's
    ``candidate_selector`` at ``selector_lr_scale`` times it (its codebooks start at zero while the
    backbone of a fine-tune is already trained). Each group carries its ``lr_scale``."""
    backbone, selector = [], []
    for name, p in draft.named_parameters():
        if p.requires_grad:
            (selector if name.startswith("candidate_selector.") else backbone).append(p)
    groups = [{"params": backbone, "lr_scale": 1.0}]
    if selector:
        groups.append({"params": selector, "lr_scale": float(selector_lr_scale)})
    return groups


def _as_source(features):
    return features if callable(features) else ListFeatures(list(features))


def _postfix(rec: dict, last_eval: dict, B: int) -> dict:
    shown = sorted({1, 2, 4, 8, B - 1} & set(range(1, B)))
    out = {"loss": f"{rec['loss']:.3f}", "acc": f"{rec['acc']:.2f}",
           "acc_slot": "/".join(f"{k}:{rec['acc_slot'][k - 1]:.2f}" for k in shown)}
    if "tau" in last_eval:  # shown once measured (restored from the log after --resume)
        out["tau"] = f"{last_eval['tau']:.2f}"
    return out


def train_drafter(draft, target, examples: list, features, cfg: TrainConfig, eval_examples: Optional[list] = None,
                  eval_features=None, eval_prompts: Optional[list] = None, log_path=None, ckpt_dir=None,
                  resume_from=None, accelerator=None, on_step: Optional[Callable[[dict], None]] = None) -> dict:
    """Train ``draft`` in place against the frozen ``target``; returns a summary dict.

    Args:
        draft: ``DFlashDraftModel`` with fp32 master weights. target: frozen causal LM (moved to the
            accelerator's device unless it is already dispatched with a ``device_map``).
        examples: :class:`train.data.Example` list (the same on every process). features: a list of
            ``(T_i, F)`` tensors or a callable ``indices -> list`` (:class:`train.features.LiveFeatures`,
            :class:`train.features.FeatureCache`).
        eval_examples / eval_features: fixed held-out rows for the held-out loss and per-slot accuracy;
            eval_prompts: ``(1, L)`` prompts for tau by ``spec_generate`` (main process, every
            ``cfg.eval_every`` steps and at the end).
        log_path: JSONL log, written by the main process (``loss`` lines every ``cfg.log_every`` steps,
            eval lines with ``heldout_loss``, ``heldout_acc_slot``, ``tau``, ``acceptance_slot``).
        ckpt_dir: where ``checkpoint-<step>`` folders go; resume_from: such a folder to continue from.
        accelerator: an ``accelerate.Accelerator`` (default :func:`make_accelerator`).
        on_step: called on every process after each optimizer step with the step's record.

    Raises:
        ValueError: no examples, a feature list of the wrong length, or fewer examples than one global batch.
        TrainingInterrupted: on Ctrl-C; a single-process run saves a checkpoint first.
    """
    from tqdm import tqdm

    if not examples or (isinstance(features, (list, tuple)) and len(features) != len(examples)):
        n_feat = len(features) if isinstance(features, (list, tuple)) else "a source of"
        raise ValueError(f"need one feature tensor per example, got {len(examples)} examples, {n_feat} features")
    acc = accelerator or make_accelerator()
    P, rank, device = acc.num_processes, acc.process_index, acc.device
    G = cfg.batch_size * P * cfg.grad_accum
    total = cfg.max_steps or steps_per_epoch(len(examples), G) * cfg.epochs
    steps_per_epoch(len(examples), G)
    source = _as_source(features)
    B = draft.config.block_size
    weights = loss_weights(B, cfg.gamma)
    target.requires_grad_(False).eval()
    if not getattr(target, "hf_device_map", None):
        target.to(device)
    draft.to(device)
    draft_config = draft.config
    dflash2 = getattr(draft, "_is_dflash2_class", False)
    loss_fn = functools.partial(dflash2_loss, alpha=cfg.selector_alpha) if dflash2 else drafter_loss
    opt = torch.optim.AdamW(_param_groups(draft, cfg.selector_lr_scale), lr=cfg.lr, betas=tuple(cfg.betas),
                            weight_decay=cfg.weight_decay)
    model, opt = acc.prepare(draft, opt)
    state = {"step": 0, "epoch": 0, "pos": 0, "elapsed_s": 0.0, "tokens": 0}
    last_eval = {}
    if resume_from is not None:
        acc.load_state(str(Path(resume_from) / ACCELERATE_STATE))
        state = json.loads((Path(resume_from) / TRAINER_STATE).read_text())["state"]
        if acc.is_main_process and log_path:
            last_eval = _trim_log(log_path, state["step"])
    main = acc.is_main_process
    log = open(log_path, "a") if (log_path and main) else None

    def log_line(rec):
        if log:
            log.write(json.dumps(rec) + "\n")
            log.flush()
        if acc.trackers:
            acc.log({k: v for k, v in rec.items() if isinstance(v, (int, float))}, step=rec["step"])

    eval_rows = None
    if eval_examples and main:
        ef = _as_source(eval_features)(list(range(len(eval_examples))))
        eval_rows = [(e.input_ids, f, sample_anchors(e.prompt_len, len(e.input_ids), cfg.num_anchors,
                                                     anchor_generator(cfg.seed + 7, 0, i)))
                     for i, (e, f) in enumerate(zip(eval_examples, ef))]

    def evaluate():
        if main:
            rec = {"step": state["step"], "elapsed_s": round(state["elapsed_s"], 1)}
            unwrapped = acc.unwrap_model(model)
            if eval_rows:
                rec["heldout_loss"], a = eval_loss(unwrapped, target, eval_rows, draft_config, weights,
                                                   cfg.batch_size, device)
                rec["heldout_acc_slot"] = [round(x, 4) for x in a[1:]]
                if dflash2:
                    rec.update({k: round(v, 4) for k, v in eval_selector(unwrapped, target, eval_rows, draft_config,
                                                                         weights, cfg.batch_size, device).items()})
            if eval_prompts:
                st = acceptance_stats(unwrapped, target, eval_prompts, cfg.eval_max_new_tokens)
                rec["tau"] = round(st["tau"], 4)
                rec["acceptance_slot"] = [round(x, 4) for x in st["acceptance_slot"]]
            log_line(rec)
            last_eval.clear()
            last_eval.update(rec)
        acc.wait_for_everyone()

    def micro_step(idx, epoch, last):
        rows = [(examples[i].input_ids, f, sample_anchors(examples[i].prompt_len, len(examples[i].input_ids),
                                                           cfg.num_anchors, anchor_generator(cfg.seed, epoch, i)))
                for i, f in zip(idx, source(idx))]
        batch = pack_batch(rows, draft_config, B).to(device)
        sync = contextlib.nullcontext() if last else acc.no_sync(model)
        with sync:
            with acc.autocast():
                lsum, st = loss_fn(model, target, batch, weights, reduction="sum")
            wsum = acc.reduce(st["weight"].detach().float().clone(), "sum").clamp_min(1e-12)
            acc.backward(lsum * P / (wsum * cfg.grad_accum))
        loss = acc.reduce(lsum.detach().float().clone(), "sum") / wsum
        hits = acc.reduce(torch.stack([st["correct"], st["count"]]).to(device), "sum").cpu()
        parts = {}
        if dflash2:  # the two terms of the DFlash 2 loss, and the selector's per-slot counts
            sums = acc.reduce(torch.stack([st["unary"], st["selector"]]).float(), "sum") / wsum
            parts = {"unary_loss": float(sums[0]), "selector_loss": float(sums[1]),
                     "slots": acc.reduce(torch.stack([st["covered"], st["selector_correct"]]).to(device), "sum").cpu()}
        return float(loss), hits, parts

    model.train()
    t_start = time.time() - state["elapsed_s"]
    budget = 60 * cfg.max_minutes if cfg.max_minutes else float("inf")
    bar = tqdm(total=total, initial=state["step"], disable=not (cfg.progress and main), mininterval=5,
               dynamic_ncols=True, desc="train")
    win = {"loss": 0.0, "n": 0, "hits": torch.zeros(2, B)}
    saved_step = state["step"] if resume_from is not None else -1
    if state["step"] == 0 and cfg.eval_every:
        evaluate()
    try:
        while state["step"] < total and time.time() - t_start < budget:
            lr = lr_at(state["step"], total, time.time() - t_start, cfg)
            for g in opt.param_groups:
                g["lr"] = lr * g["lr_scale"]
            if state["pos"] + G > len(examples):
                state["epoch"], state["pos"] = state["epoch"] + 1, 0
            rows = epoch_order(len(examples), cfg.seed, state["epoch"])[state["pos"]: state["pos"] + G]
            step_loss, hits, step_parts = 0.0, torch.zeros(2, B), {}
            for m in range(cfg.grad_accum):
                idx = micro_batch_indices(rows, m, rank, cfg.batch_size, P)
                loss, h, parts = micro_step(idx, state["epoch"], m == cfg.grad_accum - 1)
                step_loss += loss / cfg.grad_accum
                hits += h
                for k, v in parts.items():
                    step_parts[k] = step_parts.get(k, 0) + (v if k == "slots" else v / cfg.grad_accum)
            gnorm = acc.clip_grad_norm_(model.parameters(), cfg.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            state["pos"] += G
            state["step"] += 1
            state["tokens"] += int(hits[1].sum())
            state["elapsed_s"] = time.time() - t_start
            win["loss"] += step_loss
            win["n"] += 1
            win["hits"] += hits
            for k, v in step_parts.items():
                win[k] = win.get(k, 0) + v
            bar.update(1)
            step_rec = {"step": state["step"], "loss": step_loss, "lr": lr, "grad_norm": float(gnorm),
                        **{k: v for k, v in step_parts.items() if k != "slots"}}
            if on_step:
                on_step(step_rec)
            if state["step"] % cfg.log_every == 0 or state["step"] == total:
                a = (win["hits"][0] / win["hits"][1].clamp_min(1))[1:]
                rec = {"step": state["step"], "epoch": state["epoch"], "loss": win["loss"] / win["n"], "lr": lr,
                       "grad_norm": float(gnorm), "acc": float(a.mean()), "acc_slot": [round(float(x), 4) for x in a],
                       "label_tokens": state["tokens"], "elapsed_s": round(state["elapsed_s"], 1)}
                if "slots" in win:  # DFlash 2: both loss terms, gold in the unary top-k, teacher-forced selector top-1
                    n = win["hits"][1].clamp_min(1)
                    rec.update(unary_loss=win["unary_loss"] / win["n"], selector_loss=win["selector_loss"] / win["n"],
                               topk_recall=float(win["slots"][0][1:].sum() / n[1:].sum()),
                               selector_acc=float(win["slots"][1][1:].sum() / n[1:].sum()))
                log_line(rec)
                bar.set_postfix(_postfix(rec, last_eval, B))
                win = {"loss": 0.0, "n": 0, "hits": torch.zeros(2, B)}
            if cfg.eval_every and state["step"] % cfg.eval_every == 0:
                evaluate()
            if ckpt_dir and cfg.ckpt_every and state["step"] % cfg.ckpt_every == 0:
                save_checkpoint(acc, ckpt_dir, model, state, cfg.keep_checkpoints)
                saved_step = state["step"]
    except KeyboardInterrupt:
        bar.close()
        ckpt = latest_checkpoint(ckpt_dir) if ckpt_dir else None
        if ckpt_dir and P == 1 and state["step"] > max(saved_step, 0):
            ckpt = save_checkpoint(acc, ckpt_dir, model, state, cfg.keep_checkpoints)
        if log:
            log.close()
        raise TrainingInterrupted(state["step"], ckpt) from None
    bar.close()
    if last_eval.get("step") != state["step"] and (eval_examples or eval_prompts):  # same on every process
        evaluate()
    if ckpt_dir and saved_step != state["step"]:
        save_checkpoint(acc, ckpt_dir, model, state, cfg.keep_checkpoints)
    if log:
        log.close()
    acc.unwrap_model(model).eval()
    return {"steps": state["step"], "total_steps_planned": total, "epochs_started": state["epoch"] + 1,
            "train_wall_s": round(state["elapsed_s"], 1), "label_tokens": state["tokens"],
            "num_processes": P, "global_batch": G, "final_eval": dict(last_eval), "train_config": asdict(cfg)}
