"""Earlier audio replies by their ``audio.id``: OpenAI's multi-turn audio, ``{"role": "assistant", "audio": {"id"}}``.

What is kept: each audio reply's transcript (its text), under the reply's audio id, until the
``expires_at`` the reply announced (:data:`omni_serve.api.openai.chat.AUDIO_TTL_S` after it was
made). The transcript is all the thinker needs of its own earlier turn (its chat template takes an
assistant turn as text); the audio itself is not kept. The store is bounded by count and bytes
(:data:`MAX_REPLIES`, :data:`MAX_BYTES` of transcripts): past either, the oldest replies go first,
expired or not.

It lives in one ingress replica's memory: with several ingress replicas, a later request that Serve
routes to another replica does not find the id, and gets a 400 that says so; a client can always send
the turn's text as ``content`` instead (the reply's ``audio.transcript``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from omni_serve.api.openai.errors import bad_request

MAX_REPLIES = 4096
MAX_BYTES = 8 << 20


class AudioReplies:
    """This replica's recent audio replies' transcripts, by audio id (oldest first), bounded in count and bytes."""

    def __init__(
        self, max_replies: int = MAX_REPLIES, max_bytes: int = MAX_BYTES, clock: Callable[[], float] = time.time
    ):
        self.max_replies = max_replies
        self.max_bytes = max_bytes
        self.clock = clock
        self._replies: OrderedDict[str, tuple[str, int]] = OrderedDict()  # id -> (transcript, expires_at)
        self._bytes = 0

    def remember(self, audio_id: str, transcript: str, expires_at: int) -> None:
        size = _size(audio_id, transcript)
        if size > self.max_bytes:
            return  # a transcript larger than the whole store is not kept: naming it is a 400 like any unknown id
        self.forget(audio_id)
        self._replies[audio_id] = (transcript, expires_at)
        self._bytes += size
        while len(self._replies) > self.max_replies or self._bytes > self.max_bytes:
            self.forget(next(iter(self._replies)))

    def forget(self, audio_id: str) -> None:
        kept = self._replies.pop(audio_id, None)
        if kept is not None:
            self._bytes -= _size(audio_id, kept[0])

    def transcript(self, audio_id: str, param: str) -> str:
        """The transcript of the reply ``audio_id`` names; a 400 naming ``param`` if it expired or is not kept here."""
        kept = self._replies.get(audio_id)
        if kept is None:
            raise bad_request(
                f"{param}: no audio reply '{audio_id}' is known here: it was never made, or it was made by another "
                f"ingress replica, or it is older than the {self.max_replies} replies ({self.max_bytes} bytes of "
                "transcripts) one replica keeps; send the reply's transcript as content instead",
                param,
            )
        transcript, expires_at = kept
        if self.clock() >= expires_at:
            raise bad_request(
                f"{param}: audio reply '{audio_id}' expired at {expires_at} (its expires_at); send its transcript as "
                "content instead",
                param,
            )
        return transcript

    def __len__(self) -> int:
        return len(self._replies)

    @property
    def bytes(self) -> int:
        return self._bytes


def _size(audio_id: str, transcript: str) -> int:
    return len(audio_id.encode()) + len(transcript.encode("utf-8", "surrogatepass"))
