"""The shipped pair with a tensor-parallel target: every rank holds a shard of the target (transformers'
``tp_plan="auto"``) and a whole copy of the drafter, and every rank runs the same ``spec_generate``.

    torchrun --nproc-per-node 2 examples/tensor_parallel.py            # 2 CPU ranks (gloo) or 2 GPUs (nccl)

Each rank computes: the target's forwards on its shard (transformers' collectives assemble the logits and
the hidden states the drafter reads, so every rank sees the same full tensors); the drafter's forward in
full (it is small: replicated, not sharded); the acceptance decision (identical on every rank). Rank 0
prints the output, whether it equals the sharded target's own ``generate``, and tokens/s of both.
"""

import json
import os
import time
from pathlib import Path

import torch
import transformers

PAIR = Path(__file__).resolve().parents[1] / "pair"


def main():
    torch.set_num_threads(1)
    if hasattr(transformers, "DistributedConfig"):  # 5.x; the bare tp_plan="auto" is deprecated there
        tp = {"distributed_config": transformers.DistributedConfig(tp_plan="auto")}
    else:  # 4.57
        tp = {"tp_plan": "auto"}
    target = transformers.AutoModelForCausalLM.from_pretrained(PAIR / "target", dtype=torch.float32, **tp).eval()
    draft = transformers.AutoModel.from_pretrained(PAIR / "drafter", trust_remote_code=True,
                                                   dtype=torch.float32).eval().to(target.device)
    tok = transformers.AutoTokenizer.from_pretrained(PAIR / "target")
    prompt = json.loads((PAIR / "heldout_prompts.json").read_text())[1]["prompt"]
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids.to(target.device)
    t0 = time.perf_counter()
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=64)
    t1 = time.perf_counter()
    out = draft.spec_generate(target, ids, max_new_tokens=64, temperature=0.0, return_dict_in_generate=True)
    t2 = time.perf_counter()
    if int(os.environ.get("RANK", 0)) == 0:
        new = out.sequences.shape[1] - ids.shape[1]
        print(tok.decode(out.sequences[0, ids.shape[1]:]))
        print(f"equal to the sharded target's generate: {torch.equal(out.sequences, ref)}; tau {out.tau:.2f}; "
              f"generate {new / (t1 - t0):.0f} tok/s, spec_generate {new / (t2 - t1):.0f} tok/s "
              f"({os.environ.get('WORLD_SIZE', 1)} ranks)")


if __name__ == "__main__":
    main()
