"""The declaration side of the ``vllm_omni`` engine family: vLLM-Omni's pipelines, as omni_serve reads them.

- :mod:`.pipelines`: the registry read (``OMNI_PIPELINES``): pipelines, their stages, what can be served;
- :mod:`.payload`: ``OmniPayload`` <-> :class:`~omni_serve.payload.HandoffPayload`, and the views of
  vLLM-Omni's objects its processors read;
- :mod:`.edges`: a handoff between two stages, built by the pipeline's declared input processors,
  whole or per chunk;
- :mod:`.hooks`: what a declaration does not say, per model; :mod:`.qwen_omni`: Qwen3-Omni's and
  Qwen2.5-Omni's.

Importing this package is cheap; :mod:`.pipelines` imports vLLM-Omni's registry when first asked.
"""
