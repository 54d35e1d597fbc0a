"""Quantized targets and drafters on CPU, through ``from_pretrained(quantization_config=...)`` as users load
them: greedy ``spec_generate`` equals that quantized target's own ``generate`` (the product is the target's
output, quantized or not), chain and trees, for every quantization library installed here (bitsandbytes
8-bit and 4-bit, torchao int8 weight-only, optimum-quanto int8); a quantized drafter runs exactly too.
A library that is not installed is skipped with its name (``pip install -e ".[quantization]"``). Also a
target split by ``device_map`` with layers and head offloaded (the CPU's stand-in for several devices).

Planted bug caught: the draft casting its inputs to ``fc.weight.dtype`` (int8 under bitsandbytes: the
states are garbage, and only the closeness test sees it, since the output stays the target's).
"""

import importlib.util

import pytest
import torch
import transformers

from tiny import peak, tiny_draft, tiny_target

HIDDEN = 64  # bitsandbytes' 4-bit CPU kernels need every quantized output width divisible by 64
IDS = torch.tensor([[5, 17, 33, 2, 61, 8, 40, 11]])
RAGGED = torch.tensor([[0, 0, 0, 9, 4, 71, 22, 3], [5, 17, 33, 2, 61, 8, 40, 11]])
RAGGED_MASK = (torch.arange(8)[None] >= torch.tensor([[3], [0]])).long()


def _has(name):
    return importlib.util.find_spec(name) is not None


def _bnb(bits):
    return transformers.BitsAndBytesConfig(load_in_8bit=bits == 8, load_in_4bit=bits == 4)


def _torchao():
    from torchao.quantization import Int8WeightOnlyConfig
    return transformers.TorchAoConfig(Int8WeightOnlyConfig())


def _quanto():
    return transformers.QuantoConfig(weights="int8")


QUANTIZATIONS = {
    "bitsandbytes-8bit": ("bitsandbytes", lambda: _bnb(8)),
    "bitsandbytes-4bit": ("bitsandbytes", lambda: _bnb(4)),
    "torchao-int8-weight-only": ("torchao", _torchao),
    "quanto-int8": ("optimum.quanto", _quanto),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    shape = dict(hidden_size=HIDDEN, head_dim=16, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128)
    target = peak(tiny_target(seed=2, **shape))
    target.save_pretrained(root / "target")
    tiny_draft(target_layer_ids=[0, 2], **shape).save_pretrained(root / "drafter")
    return root


def _load(folders, name, what="target"):
    module, make = QUANTIZATIONS[name]
    if not _has(module.split(".")[0]) or not _has(module):
        pytest.skip(f"{module} is not installed (pip install -e '.[quantization]')")
    if what == "target":
        return transformers.AutoModelForCausalLM.from_pretrained(folders / "target", quantization_config=make(),
                                                                 dtype=torch.float32).eval()
    return transformers.AutoModel.from_pretrained(folders / "drafter", trust_remote_code=True,
                                                  quantization_config=make(), dtype=torch.float32).eval()


@pytest.mark.parametrize("name", sorted(QUANTIZATIONS))
def test_quantized_target_greedy_equals_its_own_generate(folders, name):
    target = _load(folders, name)
    draft = transformers.AutoModel.from_pretrained(folders / "drafter", trust_remote_code=True,
                                                   dtype=torch.float32).eval()
    for ids, mask in ((IDS, torch.ones_like(IDS)), (RAGGED, RAGGED_MASK)):
        ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
        for extra in ({}, {"tree_budget": 6}):
            out = draft.spec_generate(target, ids, attention_mask=mask, max_new_tokens=20, temperature=0.0, **extra)
            assert torch.equal(out, ref), (name, extra, ids.shape)


@pytest.mark.parametrize("name", sorted(QUANTIZATIONS))
def test_quantized_drafter_runs_exactly(folders, name):
    draft = _load(folders, name, what="drafter")
    target = transformers.AutoModelForCausalLM.from_pretrained(folders / "target", dtype=torch.float32).eval()
    ref = target.generate(IDS, attention_mask=torch.ones_like(IDS), do_sample=False, max_new_tokens=20)
    out = draft.spec_generate(target, IDS, max_new_tokens=20, temperature=0.0, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref), name
    assert out.num_draft_forwards > 0


@pytest.mark.parametrize("name", sorted(QUANTIZATIONS))
def test_quantized_drafter_computes_what_its_float_self_computes(folders, name):
    """The quantized drafter's block states stay close to the float drafter's on the same inputs (the
    loop's exactness cannot see a drafter that computes garbage: it only stops accepting)."""
    from transformers import DynamicCache
    quantized = _load(folders, name, what="drafter")
    plain = transformers.AutoModel.from_pretrained(folders / "drafter", trust_remote_code=True,
                                                   dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    noise, context = torch.randn(1, 4, HIDDEN, generator=gen), torch.randn(1, 6, 2 * HIDDEN, generator=gen)
    states = [m(position_ids=torch.arange(10)[None], noise_embedding=noise, target_hidden=context,
                past_key_values=DynamicCache(), use_cache=True) for m in (quantized, plain)]
    cosine = torch.nn.functional.cosine_similarity(states[0].flatten(), states[1].flatten(), dim=0)
    assert cosine > 0.95, (name, float(cosine))


def test_split_target_with_offloaded_layers_and_head(tmp_path):
    """A target split by ``device_map``: its second half of layers and its head offloaded to disk (accelerate
    brings each in for its forward), as a target bigger than one device is run; taps are read from layers
    on both sides of the split, and the draft reads the offloaded head. Greedy == the split target's generate
    (and the whole target's), chain and trees."""
    target = tiny_target(peaked=True, seed=5)
    target.save_pretrained(tmp_path / "t")
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.layers.2": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "disk"}
    split = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "t", device_map=device_map,
                                                              offload_folder=str(tmp_path / "off")).eval()
    assert split.lm_head.weight.device.type == "meta" and split.model.layers[2].mlp.up_proj.weight.device.type == "meta"
    split.generation_config.eos_token_id = split.generation_config.pad_token_id = None
    ids = torch.tensor([[5, 17, 33, 2, 61, 8, 40, 11]])
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20)
    assert torch.equal(split.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20), ref)
    draft = tiny_draft(target_layer_ids=[0, 2])
    for extra in ({}, {"tree_budget": 6}):
        assert torch.equal(draft.spec_generate(split, ids, max_new_tokens=20, temperature=0.0, **extra), ref), extra
