"""The trained model the oracle tests run on: SmolLM2-135M-Instruct's GGUF (onegraph.models).

Tests take it through `smollm2_gguf()`, which skips when the file is not here, or fails when
$ONEGRAPH_REQUIRE_REAL_MODEL=1 (CI fetches it first and sets that, so a lost download cannot
turn the oracle tests into skips)."""
import os

import pytest


def smollm2_gguf() -> str:
    from onegraph.models import find_demo_model, how_to_fetch
    path = find_demo_model()
    if path is None:
        message = f"SmolLM2-135M-Instruct GGUF not here: {how_to_fetch()}"
        if os.environ.get("ONEGRAPH_REQUIRE_REAL_MODEL") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return path
