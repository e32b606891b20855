"""Reasoning output through the engine and the server: a grammar that starts after the
reasoning (``StructuredOutput.starts_after``), and the chat and Responses routes of a server
over a random-weight Qwen3 whose chat template opens ``<think>``, with the official ``openai``
client.

The model is random, so what it thinks is whatever it samples; a seed makes it the same each
time, and ``logit_bias`` on ``</think>`` makes it close its reasoning after some tokens. The
routes' split is checked against the raw output of the same prompt and seed from
``/v1/completions`` (which splits nothing), cut at ``</think>`` by the test itself.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import torch

from foudre.errors import InvalidParameterError
from foudre.sampling_params import SamplingParams, StructuredOutput
from foudre.structured.grammar import GatedMatcher, GrammarCompiler, fill_masks
from tests.conftest import REPO, make_hf_model
from tests.server.conftest import InProcessServer

EMBEDDED_TOKENIZER = REPO / "foudre" / "assets" / "models" / "target" / "tokenizer.json"
THINK, END = 2048, 2049  # the ids of <think> and </think>, added to the embedded tokenizer
# a Qwen3-style template whose generation prompt opens the reasoning (as thinking models' do)
TEMPLATE = """\
{%- for message in messages %}
{%- if message.role == "assistant" %}<|im_start|>assistant
{{ message.content.split("</think>")[-1].lstrip() }}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
<think>
{% endif %}"""
SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "owl"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 20},
    },
    "required": ["kind", "age"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a pet."}]
BIAS = {str(END): 4.0}  # </think> comes after some tokens of reasoning (seeds 0 and 1)


def _allowed(bitmask: torch.Tensor, row: int, vocab: int = 8) -> list[int]:
    return [t for t in range(vocab) if int(bitmask[row, t // 32]) >> (t % 32) & 1]


def test_gated_grammar_is_free_until_its_trigger_then_constrains() -> None:
    # tokens: 0 EOS, 1 "a", 2 "b", 3 "ab", 4 "c", 5 "</", 6 "t>"
    compiler = GrammarCompiler([b"", b"a", b"b", b"ab", b"c", b"</", b"t>"], [0], vocab_size=8)
    m = compiler.matcher(StructuredOutput(regex="a+bc", starts_after=[5, 6]))
    assert isinstance(m, GatedMatcher)
    bitmask = torch.zeros(1, 1, dtype=torch.int32)
    m.fill(bitmask, 0)
    assert _allowed(bitmask, 0) == list(range(8))  # free
    for token in (4, 4, 5, 2, 5):  # "cc</b</": the trigger is not complete yet
        assert m.accept(token)
    assert not m.is_terminated
    m.fill(bitmask, 0)
    assert _allowed(bitmask, 0) == list(range(8))
    assert m.accept(6)  # "t>": the grammar starts
    m.fill(bitmask, 0)
    assert _allowed(bitmask, 0) == [1, 3]
    assert not m.accept(4) and m.accept(1) and m.accept(2)
    # rolling back past the trigger frees it again; forward once more gives the same states
    m.rollback(3)
    m.fill(bitmask, 0)
    assert _allowed(bitmask, 0) == list(range(8))
    assert m.accept(6) and m.accept(3) and m.accept(4)
    assert m.accept(0) and m.is_terminated
    # speculative drafts across the trigger: free rows, then the grammar's, matcher left as is
    g = compiler.matcher(StructuredOutput(regex="a+bc", starts_after=[5, 6]))
    masks = fill_masks([(g, [5, 6, 1])], 8)
    assert masks is not None
    assert [_allowed(masks.bitmask, r) for r in range(4)] == [
        list(range(8)),
        list(range(8)),
        [1, 3],
        [1, 2, 3],
    ]
    assert g.opened_at is None and g.history == []


def test_an_opener_decides_at_the_first_token_whether_the_output_thinks() -> None:
    """With ``opened_by`` (``<think>``, here token 4 "c"): an output that begins with it is free
    until the trigger; one that begins otherwise is the grammar's from its first token (a
    model answering without thinking is still constrained), the opener allowed beside it."""
    compiler = GrammarCompiler([b"", b"a", b"b", b"ab", b"c", b"</", b"t>"], [0], vocab_size=8)
    spec = StructuredOutput(regex="a+bc", starts_after=[5, 6], opened_by=4)
    m = compiler.matcher(spec)
    bitmask = torch.zeros(1, 1, dtype=torch.int32)
    m.fill(bitmask, 0)
    assert _allowed(bitmask, 0) == [1, 3, 4]  # the grammar's first tokens, and the opener
    assert m.accept(1)  # "a": no reasoning: the grammar's
    m.fill(bitmask, 0)
    assert _allowed(bitmask, 0) == [1, 2, 3]
    assert not m.accept(5)  # "</" is not the grammar's
    assert m.accept(2) and m.accept(4) and m.accept(0) and m.is_terminated
    m.rollback(4)  # back to the start: undecided again
    m.fill(bitmask, 0)
    assert _allowed(bitmask, 0) == [1, 3, 4]
    assert m.accept(4)  # the opener: free until the trigger
    m.fill(bitmask, 0)
    assert _allowed(bitmask, 0) == list(range(8))
    assert m.accept(2) and m.accept(5) and m.accept(6)
    m.fill(bitmask, 0)
    assert _allowed(bitmask, 0) == [1, 3]
    with pytest.raises(InvalidParameterError, match="opened_by"):
        StructuredOutput(regex="a", opened_by=4)


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Qwen3 over the embedded byte-level tokenizer plus ``<think>`` and
    ``</think>`` (ordinary added tokens, as Qwen3's are), with ``TEMPLATE``."""
    path = make_hf_model(
        tmp_path_factory.mktemp("qwen3-think"),
        "qwen3",
        vocab_size=2056,
        bos_token_id=0,
        eos_token_id=0,
        max_position_embeddings=1024,
        head_dim=16,
    )
    tok = json.loads(EMBEDDED_TOKENIZER.read_text())
    for i, text in ((THINK, "<think>"), (END, "</think>")):
        tok["added_tokens"].append(
            {
                "id": i,
                "content": text,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": False,
            }
        )
    (path / "tokenizer.json").write_text(json.dumps(tok))
    config = {
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "add_bos_token": False,
        "chat_template": TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def think_llm(thinking_model: Path) -> Iterator[Any]:
    from foudre.engine.llm import LLM

    llm = LLM(model=str(thinking_model), max_model_len=1024)
    yield llm
    llm.shutdown()


def _prompt(llm: Any, content: str = "Describe a pet.") -> list[int]:
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": content}], True, None)
    ids: list[int] = tok.encode(text, add_special_tokens=False)
    return ids


def test_a_grammar_after_the_reasoning_forces_valid_json_after_free_text(think_llm: Any) -> None:
    prompt = _prompt(think_llm)
    for seed in (0, 1):
        gated = StructuredOutput(json_schema=SCHEMA, starts_after=[END])
        params = SamplingParams(
            max_tokens=120, seed=seed, logit_bias={END: 4.0}, structured_output=gated
        )
        [out] = think_llm.generate([prompt], params)
        comp = out.outputs[0]
        assert comp.finish_reason == "stop"
        assert END in comp.token_ids
        reasoning, _, answer = comp.text.partition("</think>")
        assert reasoning and not reasoning.lstrip().startswith("{")  # free: not JSON
        jsonschema.validate(json.loads(answer), SCHEMA)
        # the same request with the grammar from the first token: JSON at once, no reasoning
        whole = SamplingParams(
            max_tokens=120,
            seed=seed,
            logit_bias={END: 4.0},
            structured_output=StructuredOutput(json_schema=SCHEMA),
        )
        [plain] = think_llm.generate([prompt], whole)
        assert plain.outputs[0].text.startswith("{") and END not in plain.outputs[0].token_ids


def test_an_output_that_does_not_think_is_constrained_from_its_first_token(
    think_llm: Any,
) -> None:
    """A prompt that leaves the model free to think or not (no ``<think>`` opened by the
    template): the chat route gates the grammar with ``opened_by`` (``<think>``); a model that
    answers at once (``<think>`` banned) gives valid JSON, one that opens ``<think>`` reasons
    freely first. Without ``opened_by`` the banned case was never constrained."""
    from foudre.server.reasoning import Qwen3ReasoningParser

    tok = think_llm.get_tokenizer()
    text = tok.apply_chat_template(MESSAGES, True, None).removesuffix("<think>\n")
    parser = Qwen3ReasoningParser()
    assert parser.opening_marker(text) == "<think>" and not parser.reasoning_ended(text)
    assert parser.opening_marker(text + "<think>\n") is None
    prompt = tok.encode(text, add_special_tokens=False)
    spec = StructuredOutput(json_schema=SCHEMA, starts_after=[END], opened_by=THINK)
    # (thinking: </think> outbids <think>, which the grammar's mask leaves as the first token)
    for bias, thinks in (({THINK: -100.0}, False), ({THINK: 50.0, END: 100.0}, True)):
        params = SamplingParams(max_tokens=150, seed=0, logit_bias=bias, structured_output=spec)
        [out] = think_llm.generate([prompt], params)
        comp = out.outputs[0]
        assert comp.finish_reason == "stop"
        assert (comp.token_ids[0] == THINK) == thinks
        answer = comp.text.partition("</think>")[2] if thinks else comp.text
        jsonschema.validate(json.loads(answer), SCHEMA)


def test_speculative_decoding_keeps_the_gated_grammars_greedy_output(
    think_llm: Any, thinking_model: Path
) -> None:
    """n-gram drafts accepted and rejected across the end of the reasoning: the gate opens and
    closes with verification's rollbacks, and the output is the plain run's, token for token."""
    from foudre.engine.llm import LLM

    prompts = [_prompt(think_llm, c) for c in ("Describe a pet.", "Hello", "Tell me a story")]
    gated = StructuredOutput(json_schema=SCHEMA, starts_after=[END])
    params = SamplingParams(
        temperature=0.0, max_tokens=150, logit_bias={END: 0.5}, structured_output=gated
    )
    ref = [o.outputs[0] for o in think_llm.generate(prompts, params)]
    spec_llm = LLM(
        model=str(thinking_model),
        max_model_len=1024,
        speculative_method="ngram",
        num_speculative_tokens=3,
    )
    try:
        got = [o.outputs[0] for o in spec_llm.generate(prompts, params)]
        assert spec_llm.metrics()["spec_accepted_tokens"] > 0
    finally:
        spec_llm.shutdown()
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    closed = [c for c in ref if END in c.token_ids]
    assert closed  # some reasoning ended, then its answer followed the grammar
    for comp in closed:
        answer = comp.text.partition("</think>")[2]
        if comp.finish_reason == "stop":
            jsonschema.validate(json.loads(answer), SCHEMA)
        else:
            assert answer.startswith("{")


@pytest.fixture(scope="module")
def think_server(thinking_model: Path) -> Iterator[InProcessServer]:
    from foudre.config import EngineConfig
    from tests.server.test_structured_server import _serve, _stop

    srv = _serve(EngineConfig(model=str(thinking_model), max_model_len=1024))
    yield srv
    _stop(srv)


def _client(srv: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _raw(srv: InProcessServer, seed: int, max_tokens: int) -> tuple[str, str, list[int]]:
    """The output of the chat prompt with ``seed``, unsplit (``/v1/completions`` over the
    prompt's ids): its reasoning and answer cut at ``</think>`` here, and its token ids."""
    import httpx

    ids = httpx.post(srv.url + "/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    out = _client(srv).completions.create(
        model="tools", prompt=ids, max_tokens=max_tokens, seed=seed, logit_bias=BIAS, logprobs=0
    )
    text = out.choices[0].text
    assert "</think>" in text, "the seed must close the reasoning for this test to check"
    reasoning, _, answer = text.partition("</think>")
    assert out.choices[0].logprobs is not None
    return reasoning.strip(), answer.lstrip(), list(out.choices[0].logprobs.tokens or [])


def _chat(srv: InProcessServer, **kw: Any) -> Any:
    return _client(srv).chat.completions.create(model="tools", messages=MESSAGES, **kw)  # type: ignore[arg-type]


def test_chat_splits_reasoning_from_content_streamed_and_not(think_server: InProcessServer) -> None:
    # no --reasoning-parser: the template's <think> picks qwen3
    assert think_server.server.config.app.state.reasoning_parser == (
        "qwen3 (detected from the chat template)"
    )
    for seed in (0, 1):
        reasoning, answer, pieces = _raw(think_server, seed, 40)
        done = _chat(think_server, max_tokens=40, seed=seed, logit_bias=BIAS)
        message = done.choices[0].message
        assert message.reasoning_content == reasoning  # type: ignore[attr-defined]
        assert message.content == answer
        details = done.usage.completion_tokens_details
        assert details.reasoning_tokens == pieces.index("</think>") + 1
        chunks = list(
            _chat(
                think_server,
                max_tokens=40,
                seed=seed,
                logit_bias=BIAS,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens_details
        assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == (
            details.reasoning_tokens
        )
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        streamed_reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        assert streamed_reasoning == reasoning
        assert "".join(d.content or "" for d in deltas) == answer
        assert sum(bool(getattr(d, "reasoning_content", None)) for d in deltas) > 1  # streamed


def test_response_format_constrains_the_answer_only(think_server: InProcessServer) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    for stream in (False, True):
        kw: dict[str, Any] = dict(max_tokens=150, seed=1, logit_bias=BIAS, response_format=fmt)
        if stream:
            deltas = [
                c.choices[0].delta for c in _chat(think_server, stream=True, **kw) if c.choices
            ]
            reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
            content = "".join(d.content or "" for d in deltas)
        else:
            message = _chat(think_server, **kw).choices[0].message
            reasoning, content = message.reasoning_content, message.content or ""  # type: ignore[attr-defined]
        assert reasoning and not reasoning.startswith("{")
        jsonschema.validate(json.loads(content), SCHEMA)


def test_responses_reasoning_items_created_and_streamed(think_server: InProcessServer) -> None:
    reasoning, answer, pieces = _raw(think_server, 0, 40)
    client = _client(think_server)
    kw: dict[str, Any] = dict(model="tools", input="Describe a pet.", max_output_tokens=40)
    # the Responses API has no seed or logit_bias: they go as extra fields, as chat takes them
    extra = {"seed": 0, "logit_bias": BIAS}
    done = client.responses.create(**kw, extra_body=extra)
    assert [item.type for item in done.output] == ["reasoning", "message"]
    item = done.output[0]
    assert item.summary == [] and item.content is not None  # type: ignore[union-attr]
    assert [(c.type, c.text) for c in item.content] == [("reasoning_text", reasoning)]  # type: ignore[union-attr]
    assert done.output_text == answer
    assert done.usage is not None
    assert done.usage.output_tokens_details.reasoning_tokens == pieces.index("</think>") + 1
    kinds, deltas, final = [], [], None
    for event in client.responses.create(**kw, extra_body=extra, stream=True):
        kinds.append(event.type)
        if event.type == "response.reasoning_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response  # incomplete: cut by max_output_tokens
    assert final is not None
    assert "".join(deltas) == reasoning and len(deltas) > 1
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == reasoning  # type: ignore[union-attr]
    assert final.output_text == answer
    # a follow-up that passes the reasoning item back, as the SDK hands it, is accepted
    follow = client.responses.create(
        model="tools",
        input=[*[o.model_dump(exclude_none=True) for o in done.output], _user("And another?")],
        max_output_tokens=5,
    )
    assert follow.status in ("completed", "incomplete")


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def test_messages_thinking_blocks_created_and_streamed(think_server: InProcessServer) -> None:
    """Thinking blocks come back where the request enables ``thinking`` (as Anthropic's API
    returns them), not otherwise; a conversation that passes them back (the tool loop appends
    the response's content) is accepted."""
    import anthropic

    # greedy: the same output through chat and messages (no </think> within 12 tokens)
    chat = _chat(think_server, max_tokens=12, temperature=0.0).choices[0].message
    reasoning = chat.reasoning_content  # type: ignore[attr-defined]
    assert reasoning and chat.content is None
    client = anthropic.Anthropic(
        base_url=think_server.url, api_key="unused", max_retries=0, timeout=120
    )
    kw: dict[str, Any] = dict(model="tools", max_tokens=12, messages=MESSAGES, temperature=0.0)
    plain = client.messages.create(**kw)
    assert [b.type for b in plain.content] == ["text"] and plain.content[0].text == ""  # type: ignore[union-attr]
    kw["thinking"] = {"type": "enabled", "budget_tokens": 1024}
    msg = client.messages.create(**kw)
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == reasoning  # type: ignore[union-attr]
    assert msg.content[1].text == ""  # type: ignore[union-attr]
    with client.messages.stream(**kw) as stream:
        for _ in stream:
            pass
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == reasoning  # type: ignore[union-attr]
    turns = [*MESSAGES, {"role": "assistant", "content": msg.content}]
    turns.append({"role": "user", "content": "And another?"})
    again = client.messages.create(**{**kw, "messages": turns, "max_tokens": 3})
    assert again.stop_reason in ("max_tokens", "end_turn")


HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>"]


def test_gpt_oss_without_a_template_renders_with_harmony_and_keeps_its_markers(
    thinking_model: Path, tmp_path: Path
) -> None:
    """A server with ``--reasoning-parser gpt_oss`` over a model without a chat template: the
    prompt is harmony's rendering (as ``/tokenize`` shows it), the output is decoded with its
    special tokens (the random model does not follow the format, so it is all answer)."""
    from foudre.config import EngineConfig
    from tests.server.test_reasoning_parsers import _harmony
    from tests.server.test_structured_server import _serve, _stop

    parser = _harmony()  # skips without the vocabulary
    model = tmp_path / "harmony"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        (model / name).write_bytes((thinking_model / name).read_bytes())
    tok = json.loads((thinking_model / "tokenizer.json").read_text())
    for i, text in enumerate(HARMONY_TOKENS, start=2050):
        entry = {**tok["added_tokens"][-1], "id": i, "content": text, "special": True}
        tok["added_tokens"].append(entry)
    (model / "tokenizer.json").write_text(json.dumps(tok))
    config = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "add_bos_token": False}
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    srv = _serve(EngineConfig(model=str(model), max_model_len=1024), reasoning_parser="gpt_oss")
    try:
        import httpx

        body = {"messages": [{"role": "system", "content": "Be brief."}, *MESSAGES]}
        ids = httpx.post(srv.url + "/tokenize", json=body).json()["tokens"]
        assert ids.count(2050) == 4  # <|start|>: system, developer, user, assistant
        rendered = httpx.post(srv.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
        assert rendered.startswith("systemYou are ChatGPT")  # harmony's system message
        assert rendered.endswith("developer# Instructions\n\nBe brief.userDescribe a pet.assistant")
        biased = {str(i): 2.0 for i in range(2050, 2056)}  # special tokens, kept in the text
        marked = 0
        for seed in range(3):
            message = (
                _client(srv)
                .chat.completions.create(
                    model="tools", messages=body["messages"], max_tokens=30, seed=seed,
                    logit_bias=biased,
                )
                .choices[0]
                .message
            )  # fmt: skip
            raw = _client(srv).completions.create(
                model="tools", prompt=ids, max_tokens=30, seed=seed, logit_bias=biased,
                extra_body={"skip_special_tokens": False},
            ).choices[0].text  # fmt: skip
            marked += any(t in raw for t in HARMONY_TOKENS)
            got = (message.reasoning_content, message.content)  # type: ignore[attr-defined]
            assert got == parser.extract(raw)  # the text parsed is the one with its markers
            if not raw.startswith("<"):  # not harmony: all of it is answer, markers included
                assert got == (None, raw)
        assert marked  # some output holds special tokens: they were not skipped
        # a forced call is refused (harmony writes calls on their own channel), naming it
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        with pytest.raises(openai.BadRequestError) as refused:
            _client(srv).chat.completions.create(
                model="tools",
                messages=MESSAGES,
                tools=[tool],
                tool_choice="required",  # type: ignore[arg-type, list-item]
            )
        assert refused.value.body["param"] == "tool_choice"  # type: ignore[index]
    finally:
        _stop(srv)


def test_a_forced_tool_call_is_written_after_the_reasoning(think_server: InProcessServer) -> None:
    tool = {"type": "function", "function": {"name": "describe", "parameters": SCHEMA}}
    for choice in ({"type": "function", "function": {"name": "describe"}}, "required"):
        message = (
            _chat(
                think_server,
                max_tokens=150,
                seed=1,
                logit_bias=BIAS,
                tools=[tool],
                tool_choice=choice,
            )
            .choices[0]
            .message
        )
        assert message.reasoning_content and not message.reasoning_content.startswith("{")  # type: ignore[attr-defined]
        assert message.tool_calls is not None and len(message.tool_calls) == 1
        call = message.tool_calls[0].function
        assert call.name == "describe"
        jsonschema.validate(json.loads(call.arguments), SCHEMA)
