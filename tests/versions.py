"""Markers for tests that run on one transformers version of the CI matrix only (.ci/run's lanes:
``tested_versions.TESTED_TRANSFORMERS``; the whole suite on 4.57.1 and 5.25.0, a subset on 5.24.0)."""

import pytest
import transformers
from packaging import version

TRANSFORMERS_MAJOR = version.parse(transformers.__version__).major

# For tests of the project's own tooling (command lines, README commands) whose behaviour does not
# depend on transformers: run once, on the newest version, to keep CI short.
newest_transformers_only = pytest.mark.skipif(
    TRANSFORMERS_MAJOR < 5,
    reason="command-line/README behaviour does not depend on the transformers version; runs once, on transformers 5",
)
