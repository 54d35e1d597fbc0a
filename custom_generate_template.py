"""DFlash speculative decoding behind ``generate()`` (transformers' Hub ``custom_generate`` entry).

    draft = AutoModel.from_pretrained(DRAFTER, trust_remote_code=True)
    out = target.generate(input_ids, custom_generate=DRAFTER, trust_remote_code=True,
                          assistant_model=draft, max_new_tokens=256)

DRAFTER is this drafter's Hub repo id or local folder. transformers gives this function the target and
generate()'s arguments but not the repo it was loaded from, so the loaded drafter comes in as
``assistant_model``. The arguments go to ``draft.spec_generate`` unchanged (greedy output equals
``target.generate``; sampling is exact speculative sampling). Written by ``DFlashDraftModel.save_pretrained``.
"""


def generate(model, assistant_model=None, **generate_arguments):
    """``model``: the target causal LM; ``assistant_model``: the loaded DFlash drafter."""
    if not hasattr(assistant_model, "spec_generate_from_generate_arguments"):
        what = "no assistant_model" if assistant_model is None else f"assistant_model={type(assistant_model).__name__}"
        raise ValueError(
            f"custom_generate with a DFlash drafter needs the loaded drafter as assistant_model=, got {what}"
            + ("" if assistant_model is None else ": this is not a DFlash drafter: load it with trust_remote_code=True")
            + " (draft = AutoModel.from_pretrained(<drafter repo or folder>, trust_remote_code=True), then "
            "generate(..., assistant_model=draft))"
        )
    return assistant_model.spec_generate_from_generate_arguments(model, **generate_arguments)
