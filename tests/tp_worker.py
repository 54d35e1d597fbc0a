"""One rank of tests/test_tensor_parallel.py, started by ``torchrun --nproc-per-node 2`` (gloo on CPU).

Loads the tiny target saved by the test with transformers' tensor parallelism (``tp_plan="auto"``: through
``DistributedConfig`` on 5.x, the bare argument on 4.57), the drafter through ``AutoModel`` +
``trust_remote_code``, and writes what this rank computed to ``<out>/rank<k>.json``: the target's own greedy
``generate`` and ``spec_generate`` (batch 1, a left-padded ragged batch, trees) and a seeded sampled call.
The ranks are handed different device constants (rank 0 GPU-like: positions nearly free; rank 1 compute-bound:
every verified position costs about a plain step), so their own cost models
disagree: the verify-length policy must still choose the same widths on both (``verify_cost.shared_cost``).
"""

import json
import os
import sys

import torch
import transformers

torch.set_num_threads(1)
target_dir, draft_dir, out_dir = sys.argv[1:4]
rank = int(os.environ["RANK"])
if hasattr(transformers, "DistributedConfig"):
    tp = {"distributed_config": transformers.DistributedConfig(tp_plan="auto")}
else:
    tp = {"tp_plan": "auto"}
target = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, **tp).eval()
draft = transformers.AutoModel.from_pretrained(draft_dir, trust_remote_code=True, dtype=torch.float32).eval()
cost_module = sys.modules[type(draft).__module__.rsplit(".", 1)[0] + ".verify_cost"]  # the remote-code copy
speeds = [cost_module.DeviceSpeed(8e-6, 3e-13, 2.5e-15, 2.5e-15), cost_module.DeviceSpeed(1e-9, 1e-12, 1e-6, 1e-6)]
cost_module.device_speed = lambda device, dtype: speeds[rank]
try:
    from torch.distributed.tensor import DTensor
except ImportError:
    DTensor = ()
report = {"sharded": any(isinstance(p, DTensor) for p in target.parameters())}
one = torch.tensor([[5, 17, 33, 2, 61, 8, 40]])
ragged = torch.tensor([[0, 0, 0, 9, 4, 71, 22], [5, 17, 33, 2, 61, 8, 40]])
mask = (torch.arange(7)[None] >= torch.tensor([[3], [0]])).long()
calls = {"batch1": (one, torch.ones_like(one)), "ragged": (ragged, mask)}
for name, (ids, m) in calls.items():
    ref = target.generate(ids, attention_mask=m, do_sample=False, max_new_tokens=24)
    out = draft.spec_generate(target, ids, attention_mask=m, max_new_tokens=24, temperature=0.0,
                              return_dict_in_generate=True)
    tree = draft.spec_generate(target, ids, attention_mask=m, max_new_tokens=24, temperature=0.0, tree_budget=6)
    report[name] = {"generate": ref.tolist(), "spec": out.sequences.tolist(), "tree": tree.tolist(),
                    "widths": out.row_draft_lengths}
sampled = draft.spec_generate(target, one, max_new_tokens=24, do_sample=True, temperature=1.0, top_k=20,
                              generator=torch.Generator().manual_seed(7), return_dict_in_generate=True)
report["sampled"] = sampled.sequences.tolist()
report["sampled_widths"] = sampled.row_draft_lengths
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
