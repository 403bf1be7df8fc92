"""What a route asks of the server beside its body: the context its conversion function is given.

Each route's module turns its validated body into the internal request (:class:`OmniRequest`) in one
function beside its reply (``chat_request`` beside ``ChatReply``, and so on: SGLang's
``_convert_to_internal_request``). What those functions need of the server, the graph's facts and the
steps every route shares, is this protocol; the ingress deployment is what implements it
(:class:`omni_serve.api.ingress.Ingress`), so a route module never imports the server and no Ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from starlette.requests import Request

    from omni_serve.api.openai.audio_replies import AudioReplies
    from omni_serve.api.openai.messages import MediaRules
    from omni_serve.api.openai.sampling import SamplingRequest
    from omni_serve.graph.request import OmniRequest
    from omni_serve.types import Modality, SamplingParams


class RouteContext(Protocol):
    model: str  # the graph's served_model_name
    modalities: set[Modality]  # what the graph's final outputs can answer
    text_stage: str | None  # the stage whose final output is the reply's text
    entry_stage: str
    entry_prompt: str  # what the entry stage's prompt is made of (GraphConfig.entry_prompt)
    media_rules: MediaRules
    audio_replies: AudioReplies  # this replica's audio replies, for the turns that name them

    def request(self, http: Request, arrived: float | None = None, **fields: Any) -> OmniRequest:
        """The internal request with its server-minted id, its deadline and its stage log."""
        ...

    async def voice(self, requested: str | None, param: str) -> str | None:
        """The graph's voice a request names (a 400 naming ``param`` when it has none of that name)."""
        ...

    def sampling(self, body: SamplingRequest) -> dict[str, SamplingParams]:
        """Each stage's sampling for the body's sampling fields (a 400 naming a field out of bounds)."""
        ...

    def sampling_defaults(self, seed: int | None) -> dict[str, SamplingParams]:
        """Each stage's default sampling, with the client's seed in each."""
        ...
