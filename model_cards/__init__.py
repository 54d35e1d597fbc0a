"""Model cards for DFlash drafters: a Jinja template rendered with ``huggingface_hub.ModelCard``.

    from model_cards.render import render_model_card, load_acceptance

``python -m model_cards.render`` is the command line; ``model_cards/README.md`` documents the
metadata choices and the ``acceptance.json`` schema. Nothing is imported here, so that running the
module with ``-m`` does not import it twice.
"""
