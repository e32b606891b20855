"""Structured output in the engine: every sampled output belongs to its grammar (JSON schemas
validated with ``jsonschema``, regexes, choices, EBNF), unconstrained rows are untouched,
and constraints hold with ``n`` > 1, speculative decoding, preemption and prefix caching."""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

import jsonschema
import pytest
import torch

from foudre import LLM, SamplingParams
from foudre.errors import InvalidParameterError
from foudre.sample import sampler as sampler_module
from foudre.sampling_params import StructuredOutput
from foudre.structured.grammar import (
    GrammarCompiler,
    choice_grammar,
    fill_masks,
    unsupported_schema_features,
)
from tests.speculative.test_rejection import P_THRESHOLD

PROMPT = "Once upon a time"
SCHEMAS: dict[str, dict[str, Any]] = {
    "nested_objects": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 1, "maxLength": 10},
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                },
                "required": ["name", "id"],
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    "bounded_arrays": {
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 100},
                "minItems": 2,
                "maxItems": 4,
            },
            "labels": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
        },
        "required": ["scores"],
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L"]},
            "count": {"const": 3},
        },
        "required": ["color", "size", "count"],
    },
    "number_ranges": {
        "type": "object",
        "properties": {
            "x": {"type": "number", "minimum": -1.5, "maximum": 2.5},
            "y": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
            "p": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["x", "y", "p"],
    },
    "required_and_optional": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 100},
            "nickname": {"type": "string", "maxLength": 8},
            "email": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["id"],
    },
}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=512)


def _sample(llm: LLM, spec: StructuredOutput, count: int = 200, **kw: Any) -> list[Any]:
    """``count`` completions at temperature 1.0 (one seed each), in one batch."""
    kw.setdefault("max_tokens", 256)
    params = [
        SamplingParams(temperature=1.0, seed=i, structured_output=spec, **kw) for i in range(count)
    ]
    return [o.outputs[0] for o in llm.generate([PROMPT] * count, params)]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_200_samples_validate_against_the_schema(llm: LLM, name: str) -> None:
    schema = SCHEMAS[name]
    outs = _sample(llm, StructuredOutput(json_schema=schema))
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)  # strict JSON: no raw control chars
    assert len({o.text for o in outs}) >= 5  # sampled, not one answer repeated


@pytest.mark.slow
def test_regex_choice_and_grammar_outputs_match(llm: LLM) -> None:
    pattern = r"(\d{3}-[a-z]{2,5}|[A-Z][a-z]+!)"
    for out in _sample(llm, StructuredOutput(regex=pattern)):
        assert out.finish_reason == "stop" and re.fullmatch(pattern, out.text), out.text
    choices = ["yes", "no", "maybe", "it depends", "日本"]
    outs = _sample(llm, StructuredOutput(choice=choices))
    assert all(o.text in choices and o.finish_reason == "stop" for o in outs)
    assert len({o.text for o in outs}) >= 3
    grammar = 'root ::= "The " animal " " verb "."\nanimal ::= "cat" | "dog" | "owl"\n'
    grammar += 'verb ::= "sat" | "ran" | "slept"'
    spoken = re.compile(r"The (cat|dog|owl) (sat|ran|slept)\.")
    assert all(spoken.fullmatch(o.text) for o in _sample(llm, StructuredOutput(grammar=grammar)))


def test_json_object_mode(llm: LLM) -> None:
    outs = _sample(llm, StructuredOutput(json_object=True), count=40, max_tokens=64)
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert stopped
    assert all(isinstance(json.loads(o.text), dict) for o in stopped)
    assert all(o.text.startswith("{") for o in outs)


def test_free_rows_get_the_same_tokens_next_to_constrained_ones(llm: LLM) -> None:
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went"]
    free = [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=40) for i in range(3)]
    free += [SamplingParams(temperature=0.0, max_tokens=40)]
    alone = [o.outputs[0].token_ids for o in llm.generate([*prompts, PROMPT], free)]
    spec = StructuredOutput(json_schema=SCHEMAS["nested_objects"])
    constrained = [
        SamplingParams(temperature=t, seed=i, max_tokens=60, structured_output=spec)
        for i, t in enumerate([1.0, 0.0, 1.0, 0.7])
    ]
    mixed_params = [p for pair in zip(free, constrained, strict=True) for p in pair]
    mixed_prompts = [p for q in [*prompts, PROMPT] for p in (q, q)]
    outs = [o.outputs[0] for o in llm.generate(mixed_prompts, mixed_params)]
    assert [o.token_ids for o in outs[0::2]] == alone
    for o in outs[1::2]:
        jsonschema.validate(json.loads(o.text), SCHEMAS["nested_objects"])


def test_n_samples_each_follow_the_grammar(llm: LLM) -> None:
    schema = SCHEMAS["enums"]
    params = SamplingParams(
        n=6, temperature=1.0, seed=3, max_tokens=64, structured_output=StructuredOutput(schema)
    )
    [out] = llm.generate([PROMPT], params)
    assert len(out.outputs) == 6
    for comp in out.outputs:
        jsonschema.validate(json.loads(comp.text), schema)


def test_greedy_structured_output_survives_preemption_and_prefix_hits() -> None:
    spec = StructuredOutput(json_schema=SCHEMAS["bounded_arrays"])
    prompts = [PROMPT + " there was a girl who", PROMPT + " there was a boy who"] * 3
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_output=spec)
    ref = [o.outputs[0].token_ids for o in LLM(max_model_len=128).generate(prompts, params)]
    tight = LLM(max_model_len=128, num_kv_blocks=16, block_size=8, max_num_batched_tokens=32)
    out = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert out == ref
    m = tight.metrics()
    assert m["num_preemptions"] > 0 and m["prefix_cache_hits"] > 0
    assert m["num_free_blocks"] == m["num_total_blocks"]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decoding_keeps_greedy_constrained_output(llm: LLM, method: str) -> None:
    spec = StructuredOutput(json_schema=SCHEMAS["nested_objects"])
    params = [SamplingParams(temperature=0.0, max_tokens=80, structured_output=spec)] * 2
    params += [SamplingParams(temperature=0.0, max_tokens=40)]  # a free row beside them
    prompts = [PROMPT, "The little dog", "Lily and Tom went"]
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    spec_llm = LLM(max_model_len=512, speculative_method=method, num_speculative_tokens=4)
    assert [o.outputs[0].token_ids for o in spec_llm.generate(prompts, params)] == ref
    assert spec_llm.metrics()["spec_draft_tokens"] > 0
    sampled = _sample(spec_llm, spec, count=24)
    for out in sampled:
        jsonschema.validate(json.loads(out.text), SCHEMAS["nested_objects"])


@pytest.mark.slow
def test_speculative_sampling_keeps_the_constrained_distribution(llm: LLM) -> None:
    """Two-sample χ² test: the outputs of a 16-string language sampled with and without draft
    model speculation (whose unconstrained drafts are often refused) follow one law."""
    spec = StructuredOutput(regex=r"[a-d][a-d]")
    plain = Counter(o.text for o in _sample(llm, spec, count=800, max_tokens=8))
    spec_llm = LLM(max_model_len=512, speculative_method="draft", num_speculative_tokens=3)
    params = [
        SamplingParams(temperature=1.0, seed=10_000 + i, max_tokens=8, structured_output=spec)
        for i in range(800)
    ]
    drafted = Counter(o.outputs[0].text for o in spec_llm.generate([PROMPT] * 800, params))
    assert spec_llm.metrics()["spec_draft_tokens"] > 0
    keys = sorted(set(plain) | set(drafted))
    assert all(re.fullmatch("[a-d][a-d]", k) for k in keys)
    table = torch.tensor(
        [[plain[k] for k in keys], [drafted[k] for k in keys]], dtype=torch.float64
    )
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    keep = expected[0] > 0
    stat = ((table - expected)[:, keep] ** 2 / expected[:, keep]).sum()
    df = int(keep.sum()) - 1
    p = float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2.0))
    assert p > P_THRESHOLD, (p, plain, drafted)


def test_grammar_end_finishes_with_stop_even_against_min_tokens_and_ignore_eos(llm: LLM) -> None:
    spec = StructuredOutput(choice=["yes", "no"])
    eos = next(iter(llm.engine.eos_token_ids))
    for kw in ({}, {"ignore_eos": True}, {"min_tokens": 20}):
        [out] = llm.generate([PROMPT], SamplingParams(max_tokens=50, structured_output=spec, **kw))
        comp = out.outputs[0]
        assert comp.text in ("yes", "no") and comp.finish_reason == "stop", kw
        assert comp.stop_reason == eos
    # max_tokens still cuts a constrained output
    [out] = llm.generate(
        [PROMPT], SamplingParams(max_tokens=3, structured_output=StructuredOutput(json_object=True))
    )
    assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (dict(json_schema={"type": "strin"}), "Unsupported type"),
        (dict(json_schema={"type": "integer", "minimum": 5, "maximum": 1}), "minimum"),
        (dict(json_schema={"type": "array", "uniqueItems": True}), "uniqueItems at #"),
        (dict(json_schema={"properties": {"a": {"not": {}}}}), "not at #/properties/a"),
        (dict(json_schema={"$ref": "http://x.org/s.json"}), "local"),
        (dict(regex="([a-"), "regex"),
        (dict(regex=r"[^\s\S]"), "admits no output"),
        (dict(grammar="root ::= missing"), "not defined"),
        (dict(grammar='start ::= "a"'), "root"),
    ],
)
def test_bad_grammars_are_refused_naming_the_field(
    llm: LLM, spec: dict[str, Any], words: str
) -> None:
    with pytest.raises(InvalidParameterError, match=re.escape(words)) as info:
        llm.generate([PROMPT], SamplingParams(structured_output=StructuredOutput(**spec)))
    assert info.value.param == "structured_output"
    assert not llm.engine.has_unfinished_requests()


def test_structured_output_checks_its_form() -> None:
    for bad in (
        dict(),
        dict(regex="a", choice=["a"]),
        dict(json_schema="{not json"),
        dict(json_schema=[1, 2]),
        dict(choice=[]),
        dict(choice=["a", 3]),
        dict(regex=""),
    ):
        with pytest.raises(InvalidParameterError) as info:
            StructuredOutput(**bad)  # type: ignore[arg-type]
        assert info.value.param == "structured_output"
    with pytest.raises(InvalidParameterError):
        SamplingParams(structured_output={"regex": "a"})  # type: ignore[arg-type]
    assert StructuredOutput(json_schema='{"type": "integer"}').json_schema == {"type": "integer"}
    assert (
        StructuredOutput(json_schema={"b": 1, "a": 2}).key()
        != StructuredOutput(json_schema={"a": 2, "b": 1}).key()
    )  # property order is part of the grammar


def test_no_tokenizer_no_structured_output() -> None:
    llm = LLM(skip_tokenizer_init=True, max_model_len=64)
    with pytest.raises(InvalidParameterError, match="tokenizer"):
        llm.generate([[1, 2, 3]], SamplingParams(structured_output=StructuredOutput(regex="a")))


def test_compiled_grammars_are_cached_by_spec(llm: LLM) -> None:
    compiler = llm.engine.inputs.grammars()
    spec = {"type": "object", "properties": {"cached": {"type": "boolean"}}}
    before = compiler.num_compiled
    for _ in range(3):
        llm.generate([PROMPT], SamplingParams(structured_output=StructuredOutput(spec)))
    assert compiler.num_compiled == before + 1


def test_unconstrained_steps_do_no_grammar_work(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: Any) -> None:
        raise AssertionError("fill_masks called for an unconstrained batch")

    monkeypatch.setattr(sampler_module, "fill_masks", fail)
    [out] = llm.generate([PROMPT], SamplingParams(max_tokens=5))
    assert len(out.outputs[0].token_ids) == 5


def _tiny_compiler() -> GrammarCompiler:
    # tokens: 0 EOS, 1 "a", 2 "b", 3 "ab", 4 "c", 5 special
    return GrammarCompiler([b"", b"a", b"b", b"ab", b"c", b""], [0], vocab_size=8)


def _allowed(bitmask: torch.Tensor, row: int, vocab: int = 8) -> list[int]:
    return [t for t in range(vocab) if int(bitmask[row, t // 32]) >> (t % 32) & 1]


def test_fill_masks_walks_drafts_and_rolls_back() -> None:
    compiler = _tiny_compiler()
    m = compiler.matcher(StructuredOutput(regex="a+bc"))
    free_rows: list[int] = []
    # request 1: drafts "a", "ab", "b" (the last is refused after "a ab"); request 2: free
    masks = fill_masks([(m, [1, 3, 2]), (None, free_rows)], 8)
    assert masks is not None
    assert masks.rows == [0, 1, 2]
    assert _allowed(masks.bitmask, 0) == [1, 3]  # "a" or "ab"
    assert _allowed(masks.bitmask, 1) == [1, 2, 3]  # after "a": more a's, or b
    assert _allowed(masks.bitmask, 2) == [4]  # after "a" "ab": only "c", so draft "b" fails
    assert _allowed(masks.bitmask, 3) == list(range(8))  # past the refused draft: never used
    assert _allowed(masks.bitmask, 4) == list(range(8))  # the free row is untouched
    # the matcher is back at the start: "b" is still refused, "a" accepted
    assert not m.accept(2) and m.accept(1)
    assert fill_masks([(None, [1])], 8) is None


def test_masks_apply_and_let_the_grammar_end_a_row_min_tokens_holds() -> None:
    compiler = _tiny_compiler()
    m = compiler.matcher(StructuredOutput(choice=["c"]))
    assert m.accept(4)
    masks = fill_masks([(m, [])], 8)
    assert masks is not None and _allowed(masks.bitmask, 0) == [0]
    assert masks.allows_only(0, [0]) and not masks.allows_only(0, [1])
    logits = torch.zeros(1, 8)
    masks.apply(logits)
    assert logits[0].isfinite().tolist() == [True] + [False] * 7


def test_unsupported_schema_features_and_choice_grammar() -> None:
    schema = {
        "type": "object",
        "properties": {
            "not": {"type": "integer", "multipleOf": 2},  # a property named "not" is fine
            "x": {"type": "number", "multipleOf": 0.5},
            "y": {"if": {}, "then": {}},
        },
        "$defs": {"z": {"type": "array", "uniqueItems": True}},
    }
    assert sorted(unsupported_schema_features(schema)) == [
        "if at #/properties/y",
        "multipleOf on a non-integer at #/properties/x",
        "then at #/properties/y",
        "uniqueItems at #/$defs/z",
    ]
    assert unsupported_schema_features(SCHEMAS["nested_objects"]) == []
    assert choice_grammar(['a"b', "\\", "é😀"]) == (
        'root ::= "a\\"b" | "\\\\" | "\\u00e9\\U0001f600"'
    )


def test_allowed_tokens_that_cannot_begin_the_grammar_are_refused(llm: LLM) -> None:
    """A grammar with ``allowed_token_ids`` that leave it no first token is refused at
    admission, naming both fields; allowed tokens that can begin it are served."""
    tok = llm.engine.tokenizer
    assert tok is not None
    no, yes = tok.encode("no", False), tok.encode("yes", False)
    spec = StructuredOutput(choice=["yes"])
    with pytest.raises(InvalidParameterError, match="structured_output") as info:
        llm.generate([PROMPT], SamplingParams(structured_output=spec, allowed_token_ids=no))
    assert info.value.param == "allowed_token_ids"
    assert not llm.engine.has_unfinished_requests()
    json_spec = StructuredOutput(json_object=True)
    with pytest.raises(InvalidParameterError):
        llm.generate([PROMPT], SamplingParams(structured_output=json_spec, allowed_token_ids=no))
    stops = sorted(llm.engine.eos_token_ids)
    params = SamplingParams(structured_output=spec, allowed_token_ids=[*yes, *stops], max_tokens=8)
    [out] = llm.generate([PROMPT], params)
    assert out.outputs[0].text == "yes"


UTF8_CASES = [
    # (spec, bytes after which the grammar is complete, valid UTF-8)
    (StructuredOutput(json_schema={"type": "string", "maxLength": 4}), b'"\xed\xae\x9e"', False),
    (
        StructuredOutput(json_schema={"type": "string", "maxLength": 2}),
        b'"\xe2\x82\xac\xf0\x9f\x98\x80"',
        True,
    ),
    (
        StructuredOutput(json_schema={"type": "string", "pattern": "[^x]+"}),
        b'"\xed\xa0\x80"',
        False,
    ),
    (
        StructuredOutput(json_schema={"type": "string", "pattern": "^a.b$"}),
        b'"a\xed\xbf\xbfb"',
        False,
    ),
    (
        StructuredOutput(json_schema={"type": "string", "pattern": "^a.b$"}),
        b'"a\xc3\xa9b"',
        True,
    ),
    (StructuredOutput(json_object=True), b'{"k": "\xed\xa0\x80"}', False),
    (StructuredOutput(json_object=True), b'{"\xc3\xa9": "\xee\x80\x80"}', True),
    (StructuredOutput(regex="a.+"), b"a\xed\xa0\x80", False),
    (StructuredOutput(regex="[\\u0000-\\uffff]+"), b"\xed\x9f\xbf\xef\xbf\xbd", True),
    (StructuredOutput(regex="[\\u0000-\\uffff]+"), b"\xed\xa0\x80", False),
    (StructuredOutput(grammar="root ::= [^a]+"), b"\xed\xa0\x80", False),
    (StructuredOutput(grammar='root ::= "[^a]" [^a]'), b"[^a]b", True),
]


@pytest.mark.parametrize(("spec", "output", "valid"), UTF8_CASES)
def test_grammars_admit_only_valid_utf8(spec: StructuredOutput, output: bytes, valid: bool) -> None:
    """A grammar over a byte vocabulary admits an output iff it is valid UTF-8 (xgrammar's
    classes decode surrogates U+D800-U+DFFF like other code points: ``ED A0 80`` is not UTF-8
    and decodes to replacement characters)."""
    vocab = [bytes([b]) for b in range(256)] + [b"</s>"]
    matcher = GrammarCompiler(vocab, [256], 257).matcher(spec)
    accepted = all(matcher.accept(b) for b in output) and matcher.accept(256)
    assert accepted == valid
    try:
        output.decode("utf-8")
    except UnicodeDecodeError:
        assert not valid
