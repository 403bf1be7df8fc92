"""``/v1/realtime``: OpenAI Realtime sessions over a websocket, each response an ordinary graph request.

One module per concept: :mod:`.connection` (the websocket: its event loop, time limit and outbox),
:mod:`.admission` (who may open a session; the replica's sessions), :mod:`.session` (one session's
state, budgets and client events), :mod:`.session_graph` (what it uses of its ingress),
:mod:`.settings` (its settings and ``session.update``),
:mod:`.input_audio` (the input audio buffer and its turns), :mod:`.vad` (the server VAD, Silero, on
worker threads), :mod:`.conversation` (the items and how they become the thinker's turns),
:mod:`.responses` (``response.create`` to ``response.done``), :mod:`.transcription`
(``input_audio_transcription``), :mod:`.budget` (per-second budgets), :mod:`.events` (the client
events, validated, and the server events, built).
"""
