"""The project's own classes, imported from the repository root (or the installed ``dflash_hf``).

``REMOTE_CODE_FILES`` are exactly the files that ``save_pretrained`` copies next to a converted
checkpoint (the modeling file and its relative imports) and that ``auto_map`` points into.
"""

try:  # run from the repository root: `python -m convert.convert_checkpoint ...`
    from configuration_dflash import DFlashConfig
    from generation_arguments import NOT_A_DRAFTER
    from generation_utils import capture_target_features, spec_generate
    from modeling_dflash import DFlash2DraftModel, DFlashDraftModel
except ImportError:  # installed with `pip install .` (the flat Hub files live in the `dflash_hf` package)
    from dflash_hf.configuration_dflash import DFlashConfig
    from dflash_hf.generation_arguments import NOT_A_DRAFTER
    from dflash_hf.generation_utils import capture_target_features, spec_generate
    from dflash_hf.modeling_dflash import DFlash2DraftModel, DFlashDraftModel

from .sources import REMOTE_CODE_FILES  # defined in the light module, so that `--help` needs no torch
# Also written by ``save_pretrained``: the Hub ``custom_generate`` entry (``generate(custom_generate=...)``).
CUSTOM_GENERATE_FILE = "custom_generate/generate.py"

__all__ = ["CUSTOM_GENERATE_FILE", "DFlash2DraftModel", "DFlashConfig", "DFlashDraftModel", "NOT_A_DRAFTER", "REMOTE_CODE_FILES", "capture_target_features", "spec_generate"]
