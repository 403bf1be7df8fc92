"""Chat's ``response_format`` (OpenAI) and ``structured_outputs`` (vLLM's extension): the entry stage's constraint.

As in vLLM, ``json_schema`` constrains the output to the schema and ``json_object`` to a JSON object,
whatever ``strict`` says (OpenAI's non-strict mode promises less; the constraint is never weaker);
``text`` constrains nothing. The engine's structured-output backend enforces it (vLLM's, or xgrammar
in the transformers family: :mod:`omni_serve.engines.grammar`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from omni_serve.api.openai.messages import _Strict
from omni_serve.types import StructuredOutputs


class TextFormat(_Strict):
    type: Literal["text"]


class JSONObjectFormat(_Strict):
    type: Literal["json_object"]


class JSONSchema(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="The schema's name (as OpenAI requires one).")
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema", description="The JSON schema the reply must match.")
    strict: bool | None = Field(None, description="Accepted; the reply is always held to the schema.")


class JSONSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JSONSchema


ResponseFormat = Annotated[TextFormat | JSONObjectFormat | JSONSchemaFormat, Field(discriminator="type")]


def constraint(response_format: Any, structured_outputs: StructuredOutputs | None) -> StructuredOutputs | None:
    """The entry stage's structured output: ``response_format``'s, else vLLM's ``structured_outputs``."""
    if isinstance(response_format, JSONSchemaFormat):
        return StructuredOutputs.model_validate({"json": response_format.json_schema.schema_})
    if isinstance(response_format, JSONObjectFormat):
        return StructuredOutputs(json_object=True)
    return structured_outputs
