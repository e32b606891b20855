"""Structured output on the API: OpenAI's ``response_format`` and vLLM's ``guided_*`` fields,
turned into one ``StructuredOutput`` (the engine compiles and enforces it)."""

from __future__ import annotations

from foudre.errors import InvalidParameterError
from foudre.sampling_params import StructuredOutput
from foudre.server.protocol import OpenAIError, _SamplingFields

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def structured_output(req: _SamplingFields) -> tuple[StructuredOutput | None, str | None]:
    """The request's structured output and the API field that asked for it (None, None when
    none did). 400 naming the field when more than one asks, or when the value is malformed;
    the engine checks the rest (a schema it cannot compile) when the request is submitted."""
    asked = [name for name in GUIDED_FIELDS if getattr(req, name) is not None]
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        asked.insert(0, "response_format")
    if not asked:
        return None, None
    if len(asked) > 1:
        raise OpenAIError(
            400,
            f"give at most one of response_format, {', '.join(GUIDED_FIELDS)}; got "
            f"{' and '.join(asked)}",
            param=asked[1],
        )
    field = asked[0]
    try:
        if field == "response_format":
            assert fmt is not None
            if fmt.type == "json_object":
                return StructuredOutput(json_object=True), field
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise OpenAIError(
                    400,
                    "response_format of type json_schema needs json_schema.schema",
                    param=field,
                )
            return StructuredOutput(json_schema=fmt.json_schema.schema_), field
        if field == "guided_json":
            return StructuredOutput(json_schema=req.guided_json), field
        if field == "guided_regex":
            return StructuredOutput(regex=req.guided_regex), field
        if field == "guided_choice":
            return StructuredOutput(choice=req.guided_choice), field
        return StructuredOutput(grammar=req.guided_grammar), field
    except InvalidParameterError as e:
        raise OpenAIError(400, f"{field}: {e}", param=field) from None
