"""Second turn of a two-turn chat on the shipped pair, with and without continuing from turn 1's cache.

    python bench/chat_reuse.py            # 8 held-out prompts, 128 new tokens per turn, 3 rounds, 1 thread

Turn 1 is a held-out prompt; turn 2 appends the next held-out prompt to turn 1's output. Turn 2 runs three
ways on the same input, interleaved: without a cache (the whole conversation prefilled), from turn 1's
returned cache (draft context kept), and from that cache stripped of its draft context (what a cache the
user prefilled gives the draft). Prints median wall time of turn 2, target tokens computed, tau; checks
every output against the no-cache one. Run from the repository root.
"""

import copy
import json
import statistics
import time

import torch
import transformers
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

FIELD = "cache" if int(transformers.__version__.split(".")[0]) >= 5 else "past_key_values"


def main(n_prompts=8, new=128, rounds=3):
    torch.set_num_threads(1)
    draft = AutoModel.from_pretrained("pair/drafter", trust_remote_code=True, dtype=torch.float32).eval()
    target = AutoModelForCausalLM.from_pretrained("pair/target", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained("pair/target")
    computed = []
    target.register_forward_pre_hook(lambda m, a, kw: computed.append(kw["input_ids"].shape[1]), with_kwargs=True)
    texts = [p["prompt"] for p in json.load(open("pair/heldout_prompts.json"))][: n_prompts + 1]
    encode = lambda t: tok(t, return_tensors="pt", add_special_tokens=False)["input_ids"]  # noqa: E731
    runs = {"no cache": [], "cache": [], "cache, no draft context": []}
    for i in range(n_prompts):
        first = draft.spec_generate(target, encode(texts[i]), max_new_tokens=new, temperature=0.0,
                                    return_dict_in_generate=True, adaptive_block_size=False)
        turn2 = torch.cat([first.sequences, encode("\n\n" + texts[i + 1])], dim=1)
        bare = copy.deepcopy(getattr(first, FIELD))
        del bare.dflash_draft_context
        passed = {"no cache": None, "cache": getattr(first, FIELD), "cache, no draft context": bare}
        reference = None
        for r in range(rounds):
            for name in list(runs)[r % 3:] + list(runs)[: r % 3]:  # rotate the order each round
                kw = {} if passed[name] is None else {FIELD: copy.deepcopy(passed[name])}
                computed.clear()
                start = time.perf_counter()
                out = draft.spec_generate(target, turn2, max_new_tokens=new, temperature=0.0,
                                          return_dict_in_generate=True, adaptive_block_size=False, **kw)
                seconds = time.perf_counter() - start
                reference = out.sequences if reference is None else reference
                assert torch.equal(out.sequences, reference), (i, name)
                runs[name].append((seconds, sum(computed), computed[0], out.tau, turn2.shape[1]))
    for name, rows in runs.items():
        print(f"{name:24s} turn 2: median {statistics.median(r[0] for r in rows) * 1000:6.0f} ms, "
              f"target tokens {statistics.mean(r[1] for r in rows):6.1f} (prefill {statistics.mean(r[2] for r in rows):5.1f}"
              f" of {statistics.mean(r[4] for r in rows):5.1f} in), tau {statistics.mean(r[3] for r in rows):.2f}")


if __name__ == "__main__":
    main()
