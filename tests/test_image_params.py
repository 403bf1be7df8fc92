"""An edit's size ``auto`` as the model can make it (omni_serve.models.image_params.fitted_size): pure arithmetic.

OpenAI and vLLM-Omni edit a photo of any size; the model makes sides in multiples of its VAE and patch
factor and at most ``max_pixels``, so ``auto`` is the source's size scaled down to fit and rounded.
"""

from __future__ import annotations

import pytest

from omni_serve.models.image_params import fitted_size


@pytest.mark.parametrize(
    ("source", "multiple", "max_pixels", "fitted"),
    [
        ((64, 48), 16, 512 * 512, (64, 48)),  # already a size the model makes: kept
        ((1000, 750), 16, 2048 * 2048, (992, 752)),  # a photo: rounded to 16
        ((1000, 750), 16, 512 * 512, (576, 448)),  # over max_pixels: scaled down, about the aspect kept
        ((5, 3), 16, 512 * 512, (16, 16)),  # tiny: at least one multiple a side
        ((4000, 10), 32, 256 * 256, (2048, 32)),  # a sliver: its short side one multiple, its long one cut to fit
    ],
)
def test_auto_is_the_source_size_the_model_can_make(source, multiple, max_pixels, fitted) -> None:
    width, height = fitted_size(*source, multiple, max_pixels)
    assert (width, height) == fitted
    assert width % multiple == height % multiple == 0 and width * height <= max(max_pixels, multiple * multiple)
