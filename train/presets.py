"""Named flag sets for ``python -m train.train_drafter --preset NAME`` (explicit flags override them).

* ``smoke``: a quick end-to-end run against the shipped ``pair/target`` (a few dozen target responses, a
  1-layer drafter, a feature cache, an eval with tau): checks an installation in about a minute on CPU.
* ``pair``: stage 1 of the shipped ``pair/drafter``: short prompts (``--name pair-short``).
* ``pair-long``: stage 2 of the shipped ``pair/drafter`` (with ``--reproduce-pair`` it is written
  back into ``pair/``): the stage-1 drafter fine-tuned on target continuations of prompts left-extended to 64..1152 tokens with
  training-split source (75% of them; the rest stay short), sequences up to 1312 tokens. A
  long-context stage by continued training of a short-context model on longer sequences, as in
  Xiong et al. 2023, "Effective Long-Context Scaling of Foundation Models" (section 2: continual
  pretraining from Llama 2 checkpoints on longer sequences); applying it to a DFlash drafter is our
  own choice. Pass ``--init`` with the stage-1 drafter folder.
* ``pair-dflash2``: a DFlash 2 drafter for the embedded pair, fine-tuned from the shipped ``pair/drafter``
  (it keeps its taps; identity convolutions and a zero successor codebook are added, so training starts
  at its greedy drafts, train/selector.py) on the stage-2 data of ``pair-long`` (training-split prompts
  only, the held-out guard of train/data.py applies; the run's own eval split of training prompts is the
  validation split). Backbone lr 1e-4 and selector lr 1e-3 (``selector_lr_scale`` 10: its codebooks start
  at zero, the backbone is already trained): in a 40-step smoke on 48 sequences this pair kept the
  validation unary loss within 2% (1.679 -> 1.709) while the selector's validation top-1 rose, where
  lr 5e-4 for both raised the unary loss 5% (-> 1.763); a first choice, not a full sweep. Selector alpha
  1 (SpecForge's default); the training wall clock capped at 45 minutes so the whole run (data,
  features, training) fits in 60 minutes on 2 cores. Resumable with ``--resume``.
* ``dflash-b16`` / ``dflash-b10`` / ``dflash-b8``: the published recipe for real targets (DFlash paper,
  section 4 and appendix): 5 draft layers, 5 target taps spread over the depth, AdamW lr 6e-4, cosine
  with 4% warmup, grad clip 1.0, 6 epochs, sequences up to 3072 tokens, up to 512 anchors per sequence,
  loss decay gamma 7 / 5 / 4 for block size 16 / 10 / 8, bf16 mixed precision. They need ``--target`` and
  ``--data`` (a chat dataset).
"""

_PUBLISHED = dict(layers=5, target_layer_ids=None, lr=6e-4, warmup_ratio=0.04, min_lr_ratio=0.0, clip=1.0,
                  epochs=6, max_len=3072, anchors=512, batch=1, grad_accum=8, max_new_tokens=2048,
                  gen_batch=32, num_eval_prompts=32, eval_tau_prompts=8, eval_max_new_tokens=256,
                  mixed_precision="bf16", features="live", ckpt_every=1000, eval_every=1000, log_every=20,
                  sampled_fraction=0.0, init="target", target=None)

PRESETS = {
    "smoke": dict(target="pair/target", layers=1, block_size=16, target_layer_ids="1,3,5", num_prompts=48,
                  num_eval_prompts=8, max_new_tokens=48, sampled_fraction=0.25, gen_batch=32, max_len=512,
                  anchors=8, batch=4, grad_accum=1, epochs=3, lr=3e-3, eval_every=0, eval_tau_prompts=4,
                  eval_max_new_tokens=32, ckpt_every=6, log_every=3, features="cache", cache_dtype="bfloat16",
                  threads=1, mixed_precision="no"),
    "pair": dict(target="pair/target", layers=2, block_size=16, target_layer_ids="1,3,5", num_prompts=960,
                 num_eval_prompts=48, max_new_tokens=160, sampled_fraction=0.25, gen_batch=48, max_len=512,
                 anchors=32, batch=6, grad_accum=1, epochs=20, lr=2e-3, max_minutes=30, threads=2, eval_every=150,
                 eval_tau_prompts=4, eval_max_new_tokens=64, ckpt_every=50, log_every=10, features="cache",
                 cache_dtype="float32", mixed_precision="no"),
    "pair-long": dict(target="pair/target", layers=2, block_size=16, target_layer_ids="1,3,5", num_prompts=960,
                      num_eval_prompts=48, max_new_tokens=128, sampled_fraction=0.25, gen_batch=32, max_len=1312,
                      long_prompts="64:1152", long_fraction=0.75, anchors=32, batch=4, grad_accum=1, epochs=20,
                      lr=1e-3, warmup_ratio=0.02, max_minutes=35, threads=2, eval_every=250, eval_tau_prompts=4,
                      eval_max_new_tokens=64, ckpt_every=50, log_every=10, features="cache", cache_dtype="float32",
                      mixed_precision="no"),
    "pair-dflash2": dict(target="pair/target", init="pair/drafter", dflash2=True, conv_kernel_size=2, selector_top_k=16,
                         selector_alpha=1.0, layers=2, block_size=16, target_layer_ids="1,3,5", num_prompts=960,
                         num_eval_prompts=48, max_new_tokens=128, sampled_fraction=0.25, gen_batch=32, max_len=1312,
                         long_prompts="64:1152", long_fraction=0.75, anchors=32, batch=4, grad_accum=1, epochs=20,
                         lr=1e-4, selector_lr_scale=10.0, warmup_ratio=0.02, max_minutes=45, threads=2,
                         eval_every=250, eval_tau_prompts=4,
                         eval_max_new_tokens=64, ckpt_every=50, log_every=10, features="cache", cache_dtype="float32",
                         mixed_precision="no"),
    "dflash-b16": dict(_PUBLISHED, block_size=16, gamma=7.0),
    "dflash-b10": dict(_PUBLISHED, block_size=10, gamma=5.0),
    "dflash-b8": dict(_PUBLISHED, block_size=8, gamma=4.0),
}


def spread_layer_ids(num_target_layers: int, n: int = 5) -> list[int]:
    """Tap layers for a target of ``num_target_layers`` layers, never its last layer: the published rule
    (notes section 2, the z-lab / SpecForge legacy rule) of ``n`` ids spread evenly from layer 1 to layer
    ``L - 3`` (the published Qwen3-8B drafter, 36 layers: ``[1, 9, 17, 25, 33]``). A target too shallow for
    ``n`` distinct taps gets ``L - 3`` of them (6 layers: ``[1, 2, 3]``), and one tap at ``L // 2`` below 5
    layers (the published rule for a single tap).

    Why never the last layer: engines feed its tap differently (vLLM before the final norm, this package
    and the authors' code after it, SGLang not at all), so a drafter that taps it is served differently.

    Raises:
        ValueError: a target with fewer than 2 layers (its only layer is its last).
    """
    if num_target_layers < 2:
        raise ValueError(f"a {num_target_layers}-layer target has no layer but its last to tap; pass --target-layer-ids")
    n = min(n, num_target_layers - 3)
    if n <= 1:
        return [num_target_layers // 2 if num_target_layers > 2 else 0]
    last = num_target_layers - 3
    return [1 + round(i * (last - 1) / (n - 1)) for i in range(n)]
