"""GLM-Image (vLLM-Omni pipeline ``glm_image``: an AR stage that plans, a DiT that draws): what its declaration
does not say.

Its AR stage writes a token grid at 32 pixels a token (``glm_image_ar._GLM_IMAGE_GRID_FACTOR``; the AR -> DiT
processor ``ar2diffusion`` parses the same factor), so sizes are multiples of 32; and it writes a preview grid
before the image's own (none when editing), the count vLLM-Omni's ``compute_max_tokens`` gives. Everything else
comes from the declaration and vLLM-Omni's own request shape for AR -> DiT image models
(omni_serve.engines.vllm_omni.prompts).
"""

from __future__ import annotations

from omni_serve.models.vllm_omni.hooks import PipelineHooks


def image_tokens(height: int, width: int, editing: bool) -> int:
    """The tokens GLM-Image's AR writes for an image (vLLM-Omni's own count, with its end token)."""
    from vllm_omni.model_executor.stage_input_processors.glm_image import compute_max_tokens

    return int(compute_max_tokens(height, width, is_i2i=editing))


GLM_IMAGE = PipelineHooks(image_size_multiple=32, image_tokens=image_tokens, reference_model="zai-org/GLM-Image")
