"""Vision-language targets (issue 24): greedy spec_generate with images and video equals
``target.generate(do_sample=False)`` token for token, and the image really reaches the target.

Tiny targets built in-process from the real transformers classes (vision tower depth 1, hidden 16,
16x16 pixels in patches of 4; text model vocab 97, hidden 40, 3 layers, peaked attention), a tiny DFlash
drafter (and a DFlash 2 one) saved and loaded back through ``AutoModel`` + ``trust_remote_code``.

* Qwen3-VL, Qwen2.5-VL (4.57 and 5.x) and Qwen3.5 (5.x, hybrid Gated DeltaNet): M-RoPE, whose positions after an
  image are NOT a plain range; images, video, and a left-padded batch whose rows hold different numbers
  of images. Planted bug "positions after the image as a plain range" (``rope=None`` for the verify
  forwards in ``_decode``): every Qwen test here fails.
* Gemma 3 (both versions) and Gemma 4 (5.x; KV-shared layers, per-layer inputs): bidirectional attention
  among the image tokens of the prefill (``token_type_ids`` / ``mm_token_type_ids``), sliding windows,
  plain positions.
* Each test checks that other pixel values give other tokens (the image is not ignored).

The ``image-text-to-text`` pipeline is tested with Gemma 3 (a tiny processor built offline: word-level
tokenizer + the PIL image processor); Qwen's image processors need torchvision, which the test
environment does not install.
"""

import inspect

import pytest
import torch
import transformers

from test_dflash2_generate import dflash2_draft
from tiny import HIDDEN, VOCAB, peak, tiny_draft

IMG, VID, V_START, V_END = 90, 91, 92, 93
NEW = 14
TEXT = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=72, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=10, max_position_embeddings=512)
QWEN_VISION = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, patch_size=4, temporal_patch_size=2,
                   spatial_merge_size=2, out_hidden_size=HIDDEN, num_position_embeddings=16, in_channels=3)
PATCH = 3 * 2 * 4 * 4  # channels x temporal patch x patch x patch: one row of Qwen pixel_values
GRID = (1, 4, 4)  # a 16x16 image: 4x4 patches, merged 2x2 -> 4 image tokens


def _finish(model):
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return peak(model).eval()


def qwen3_vl():
    cfg = transformers.Qwen3VLConfig(
        text_config=dict(TEXT, rope_scaling={"rope_type": "default", "mrope_section": [2, 2, 1],
                                             "mrope_interleaved": True}, rope_theta=10000.0),
        vision_config=dict(QWEN_VISION, deepstack_visual_indexes=[0]), image_token_id=IMG, video_token_id=VID,
        vision_start_token_id=V_START, vision_end_token_id=V_END)
    torch.manual_seed(0)
    return _finish(transformers.Qwen3VLForConditionalGeneration(cfg))


def qwen2_5_vl():
    """Qwen2.5-VL: M-RoPE through its own get_rope_index (windowed vision attention, no deepstack)."""
    mrope = {"type": "mrope", "mrope_section": [2, 2, 1]}
    vision = dict(QWEN_VISION, embed_dim=16, fullatt_block_indexes=[0], window_size=8)
    cfg = transformers.Qwen2_5_VLConfig(text_config=dict(TEXT, rope_scaling=mrope), vision_config=vision,
                                        image_token_id=IMG, video_token_id=VID, vision_start_token_id=V_START,
                                        vision_end_token_id=V_END, **dict(TEXT, rope_scaling=mrope))
    torch.manual_seed(0)
    return _finish(transformers.Qwen2_5_VLForConditionalGeneration(cfg))


def qwen3_5():
    if not hasattr(transformers, "Qwen3_5ForConditionalGeneration"):
        pytest.skip("transformers 4.57 has no Qwen3.5")
    cfg = transformers.Qwen3_5Config(
        text_config=dict(TEXT, layer_types=["linear_attention", "full_attention", "full_attention"],
                         linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                         linear_value_head_dim=8, linear_conv_kernel_dim=3,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 0],
                                          "mrope_interleaved": True, "partial_rotary_factor": 0.5}),
        vision_config=QWEN_VISION, image_token_id=IMG, video_token_id=VID, vision_start_token_id=V_START,
        vision_end_token_id=V_END)
    torch.manual_seed(0)
    return _finish(transformers.Qwen3_5ForConditionalGeneration(cfg))


def gemma3():
    cfg = transformers.Gemma3Config(
        text_config=dict(TEXT, sliding_window=6, query_pre_attn_scalar=10,
                         layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
        vision_config=dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                           image_size=16, patch_size=4),
        mm_tokens_per_image=4, image_token_index=IMG, boi_token_index=V_START, eoi_token_index=V_END)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():  # initialised to zeros: every image would embed alike
        for name, param in model.named_parameters():
            if name.endswith("mm_input_projection_weight"):
                param.normal_(std=1.0)
    return _finish(model)


def gemma4():
    if not hasattr(transformers, "Gemma4ForConditionalGeneration"):
        pytest.skip("Gemma 4 exists from transformers 5.x on")
    from family_targets import family_target

    text = dict(family_target("gemma4").config.to_dict(), pad_token_id=0)  # KV-shared layers, per-layer inputs
    vision = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=8, patch_size=4, pooling_kernel_size=3, position_embedding_size=64)
    cfg = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None, image_token_id=IMG,
                                    boi_token_id=V_START, eoi_token_id=V_END)
    torch.manual_seed(0)
    return _finish(transformers.Gemma4ForConditionalGeneration(cfg))


def _left_pad(rows):
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def _image(n=1):
    """``n`` pictures of 4 image tokens each, each wrapped in vision start / end."""
    return ([V_START] + [IMG] * 4 + [V_END]) * n


def qwen_inputs(target, rows, images, seed=0, video=False):
    """Prompt rows (lists of ids) and random pixels for ``images`` pictures (or video grids) in total."""
    ids, mask = _left_pad(rows)
    gen = torch.Generator().manual_seed(seed)
    grid = (2, 4, 4) if video else GRID
    pixels = torch.randn(images * grid[0] * 16, PATCH, generator=gen)
    kw = {"pixel_values_videos" if video else "pixel_values": pixels,
          "video_grid_thw" if video else "image_grid_thw": torch.tensor([grid] * images)}
    if "mm_token_type_ids" in inspect.signature(target.forward).parameters:  # 5.x processors return it
        kw["mm_token_type_ids"] = (ids == VID).long() * 2 + (ids == IMG).long()
    return dict(input_ids=ids, attention_mask=mask, **kw)


def gemma_inputs(target, rows, images, seed=0, video=False):
    """Gemma 3: one 3x16x16 picture per image, 4 image tokens each; token_type_ids mark them (bidirectional)."""
    ids, mask = _left_pad(rows)
    gen = torch.Generator().manual_seed(seed)
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=(ids == IMG).long(),
                pixel_values=torch.randn(images, 3, 16, 16, generator=gen))


def gemma4_inputs(target, rows, images, seed=0, video=False):
    """Gemma 4 images: 36 patches of 4x4 pixels on a 6x6 grid each, pooled 3x3 into 4 image tokens."""
    ids, mask = _left_pad(rows)
    gen = torch.Generator().manual_seed(seed)
    grid = torch.stack(torch.meshgrid(torch.arange(6), torch.arange(6), indexing="xy"), -1).reshape(36, 2)
    return dict(input_ids=ids, attention_mask=mask, pixel_values=torch.rand(images, 36, 48, generator=gen),
                image_position_ids=grid[None].expand(images, -1, -1).clone(), mm_token_type_ids=(ids == IMG).long())


FAMILIES = {"qwen3_vl": (qwen3_vl, qwen_inputs), "qwen2_5_vl": (qwen2_5_vl, qwen_inputs), "qwen3_5": (qwen3_5, qwen_inputs),
            "gemma3": (gemma3, gemma_inputs), "gemma4": (gemma4, gemma4_inputs)}


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    """The tiny DFlash drafter, saved and loaded back through AutoModel + trust_remote_code."""
    folder = tmp_path_factory.mktemp("vl") / "drafter"
    tiny_draft().save_pretrained(folder)
    return str(folder), transformers.AutoModel.from_pretrained(folder, trust_remote_code=True,
                                                             dtype=torch.float32).eval()


def _assert_exact_and_seeing(draft, target, make, rows, images, **extra):
    """spec_generate == generate on the prompt, and other pixels give other tokens."""
    outs = []
    for seed in (0, 1):
        inputs = make(target, rows, images, seed=seed, **extra)
        ref = target.generate(**inputs, max_new_tokens=NEW, do_sample=False)
        out = draft.spec_generate(target=target, **inputs, max_new_tokens=NEW)
        assert out.tolist() == ref.tolist(), f"seed {seed}"
        outs.append(out)
    assert outs[0].tolist() != outs[1].tolist(), "the image did not change the output"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_equals_generate_with_an_image(drafter, family):
    build, make = FAMILIES[family]
    _assert_exact_and_seeing(drafter[1], build(), make, [[5, 6, *_image(), 7, 8, 9]], 1)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_ragged_batch_with_different_numbers_of_images_per_row(drafter, family):
    build, make = FAMILIES[family]
    rows = [[5, *_image(), 7, 8], [5, *_image(2), 7, 8, 9, 10], [11, 12, 13, *_image(), 14]]
    _assert_exact_and_seeing(drafter[1], build(), make, rows, 4)


def test_sampling_path_with_images_keeps_the_targets_tokens(drafter):
    """do_sample=True with top_k=1: the speculative-sampling path (draws, rejection test) under M-RoPE
    positions must give generate's greedy tokens whatever the draws."""
    target = qwen3_vl()
    inputs = qwen_inputs(target, [[5, *_image(), 7, 8], [9, *_image(2), 10]], 3)
    ref = target.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    out = drafter[1].spec_generate(target=target, **inputs, max_new_tokens=NEW, do_sample=True, top_k=1,
                                   generator=torch.Generator().manual_seed(0))
    assert out.tolist() == ref.tolist()


@pytest.mark.parametrize("family", ["qwen3_vl", "gemma3"])
def test_text_only_prompt_to_a_vision_language_target(drafter, family):
    """No image: the text path (plain positions, the loop's own masks) stays exact on the wrapper."""
    target = FAMILIES[family][0]()
    ids, mask = _left_pad([[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]])
    ref = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    out = drafter[1].spec_generate(target=target, input_ids=ids, attention_mask=mask, max_new_tokens=NEW)
    assert out.tolist() == ref.tolist()


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_greedy_equals_generate_with_a_video(drafter, family):
    build, make = FAMILIES[family]
    frames = [V_START] + [VID] * 4 + [V_END, V_START] + [VID] * 4 + [V_END]  # 2 temporal groups, 4 tokens each
    _assert_exact_and_seeing(drafter[1], build(), make, [[5, 6, *frames, 7, 8]], 1, video=True)


@pytest.mark.parametrize("family", ["qwen3_vl", "gemma3"])
def test_custom_generate_route_with_an_image(drafter, family):
    """``target.generate(custom_generate=<drafter folder>, assistant_model=draft, pixel_values=...)``."""
    folder, draft = drafter
    build, make = FAMILIES[family]
    target = build()
    outs = []
    for seed in (0, 1):
        inputs = make(target, [[5, *_image(), 7, 8], [9, 10, 11, *_image(), 12]], 2, seed=seed)
        ref = target.generate(**inputs, max_new_tokens=NEW, do_sample=False)
        out = target.generate(**inputs, max_new_tokens=NEW, do_sample=False, custom_generate=folder,
                              trust_remote_code=True, assistant_model=draft)
        assert out.tolist() == ref.tolist()
        outs.append(out)
    assert outs[0].tolist() != outs[1].tolist()


def gemma3_processor():
    """A Gemma 3 processor built offline: a word-level tokenizer over the tiny vocabulary with Gemma's image
    tokens at the target's ids, and the PIL image processor at 16x16 (no torchvision needed)."""
    import warnings

    from tokenizers import Tokenizer, models, pre_tokenizers

    image = {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"}
    words = ["<eos>", "<pad>", "<bos>", "[UNK]"] + [f"w{i}" for i in range(IMG - 4)]
    words += [image["image_token"], "x91", image["boi_token"], image["eoi_token"]]
    words += [f"x{i}" for i in range(len(words), VOCAB)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                                unk_token="[UNK]", extra_special_tokens=image,
                                                additional_special_tokens=list(image.values()))
    for name, value in image.items():  # 4.57 reads them as tokenizer attributes
        setattr(fast, name, value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 5.x: "falling back to Gemma3ImageProcessorPil" without torchvision
        pixels = transformers.Gemma3ImageProcessor(size={"height": 16, "width": 16})
    return transformers.Gemma3Processor(image_processor=pixels, tokenizer=fast, image_seq_length=4)


def test_image_text_to_text_pipeline_with_the_drafter(drafter):
    """``pipeline("image-text-to-text")`` + ``generate_kwargs`` naming the custom_generate route: the same
    text as the plain pipeline, the drafter ran, and another image gives another text."""
    import numpy as np
    from PIL import Image

    folder, draft = drafter
    pipe = transformers.pipeline("image-text-to-text", model=gemma3(), processor=gemma3_processor())
    calls, texts = [], []
    hook = draft.register_forward_hook(lambda module, args, output: calls.append(1))
    try:
        for seed in (0, 1):
            image = Image.fromarray((np.random.RandomState(seed).rand(16, 16, 3) * 255).astype("uint8"))
            text = "w1 w2 <start_of_image> w3"
            plain = pipe(images=image, text=text, max_new_tokens=NEW, generate_kwargs=dict(do_sample=False))
            fast = pipe(images=image, text=text, max_new_tokens=NEW, generate_kwargs=dict(
                do_sample=False, custom_generate=folder, trust_remote_code=True, assistant_model=draft))
            assert fast == plain
            texts.append(fast[0]["generated_text"])
    finally:
        hook.remove()
    assert calls, "the pipeline never called the drafter"
    assert texts[0] != texts[1], "the image did not change the text"


def test_dflash2_drafter_with_an_image(tmp_path):
    """A DFlash 2 drafter runs the same loop: exact with an M-RoPE target and an image."""
    dflash2_draft().save_pretrained(tmp_path / "d2")
    draft = transformers.AutoModel.from_pretrained(tmp_path / "d2", trust_remote_code=True, dtype=torch.float32).eval()
    assert type(draft).__name__ == "DFlash2DraftModel"
    _assert_exact_and_seeing(draft, qwen3_vl(), qwen_inputs, [[5, *_image(), 7, 8], [9, *_image(), 10, 11, 12]], 2)


def test_multimodal_inputs_with_the_static_loop_are_refused_by_name(drafter):
    target = qwen3_vl()
    inputs = qwen_inputs(target, [[5, *_image(), 7]], 1)
    with pytest.raises(NotImplementedError, match="multimodal inputs .* static loop"):
        drafter[1].spec_generate(target=target, **inputs, max_new_tokens=4, cache_implementation="static")


def test_readme_vision_block_runs(tmp_path, monkeypatch):
    """The README's vision block runs as written from another folder (its own assert: spec_generate ==
    generate)."""
    monkeypatch.chdir(tmp_path)
    from test_readme import readme_blocks

    code = readme_blocks()["vision"]
    if "mm_token_type_ids" not in inspect.signature(transformers.Qwen3VLModel.forward).parameters:
        code = code.replace(", mm_token_type_ids=(input_ids == IMAGE).long()", "")  # as the README says for 4.57
    exec(compile(code, "README:vision", "exec"), {})
