"""``/v1/realtime``: OpenAI Realtime sessions over a websocket, each response an ordinary graph request.

:mod:`.events` holds the client events (validated) and the server events (built); :mod:`.vad` the
server VAD (Silero); :mod:`.conversation` the items and how they become the thinker's turns;
:mod:`.session` one session's state machine and its websocket loop.
"""
