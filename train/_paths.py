"""The repository's flat Hub files (``configuration_dflash``, ``modeling_dflash``, ``generation_utils``),
importable from ``train/`` whether it runs from a checkout (the files sit at the repository root) or
from an installed ``dflash_hf`` package."""
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # the flat Hub files live at the repository root
    sys.path.insert(0, str(_ROOT))

from configuration_dflash import DFlashConfig  # noqa: E402
from generation_utils import spec_generate  # noqa: E402
from modeling_dflash import DFlashDraftModel  # noqa: E402
from target_cache import linear_layer_ids  # noqa: E402
from target_families import draft_block_embedding, draft_logits, layer_windows  # noqa: E402
from target_taps import _decoder_parts as decoder_parts  # noqa: E402
from target_taps import capture_target_features, run_target  # noqa: E402

__all__ = ["DFlashConfig", "DFlashDraftModel", "capture_target_features", "decoder_parts", "draft_block_embedding",
           "draft_logits", "layer_windows", "linear_layer_ids", "run_target", "spec_generate"]
