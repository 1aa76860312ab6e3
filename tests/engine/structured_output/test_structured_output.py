"""Structured output in the engine: every constrained output parses and validates, batched with
unconstrained requests in the same steps, greedy and seeded sampling, through preemption."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.conftest import STORIES_260K, engine_config
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.sample.sampling_params import InvalidRequestError, SamplingParams
from tokenloom.engine.structured_output.spec import constraint_from_request

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 10}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green", "blue"]}},
        "required": ["colour"],
        "additionalProperties": False,
    },
    "bounded_array": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3}
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}, "score": {"type": "number"}},
        "required": ["age", "score"],
        "additionalProperties": False,
    },
}
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went", "One day"]
MAX_TOKENS = 96  # enough for every schema above on this model; a cut-off output must say "length"


@pytest.fixture(scope="module")
def engine(stories_dir) -> Engine:
    return Engine(engine_config(stories_dir, scheduler=dict(max_num_seqs=16)))


@pytest.fixture(scope="module")
def stories_dir():
    if not (STORIES_260K / "config.json").is_file():
        pytest.skip(f"stories260K not found at {STORIES_260K} (it ships in the project's shared/ folder)")
    return STORIES_260K


def _check(schema: dict, output) -> None:
    if output.finish_reason == "length":
        return  # cut by max_tokens: the only case allowed not to parse
    assert output.finish_reason == "stop", output
    jsonschema.validate(json.loads(output.text), schema)


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 7)])
def test_json_schemas_validate_batched_with_unconstrained_requests(engine, temperature, seed):
    params, schemas = [], []
    for name, schema in SCHEMAS.items():
        for prompt in PROMPTS[:2]:
            params.append(
                SamplingParams(
                    temperature=temperature, seed=seed, max_tokens=MAX_TOKENS, structured_outputs={"json": schema}
                )
            )
            schemas.append(schema)
    free = SamplingParams(temperature=temperature, seed=seed, max_tokens=24)
    prompts = [p for _ in SCHEMAS for p in PROMPTS[:2]] + PROMPTS
    outputs = engine.generate(prompts, params + [free] * len(PROMPTS))
    finished = [o.outputs[0] for o in outputs]
    for schema, output in zip(schemas, finished):
        _check(schema, output)
    assert sum(o.finish_reason == "stop" for o in finished[: len(schemas)]) >= len(schemas) // 2
    # The unconstrained requests in the same steps are untouched by the constraint.
    alone = engine.generate(PROMPTS, [free] * len(PROMPTS)) if seed is not None or temperature == 0 else None
    if alone is not None:
        assert [o.outputs[0].token_ids for o in outputs[len(schemas) :]] == [o.outputs[0].token_ids for o in alone]


def test_choice_and_regex_hold(engine):
    choice = ["positive", "negative", "neutral"]
    outputs = engine.generate(
        PROMPTS,
        [
            SamplingParams(temperature=1.0, seed=i, max_tokens=16, structured_outputs={"choice": choice})
            for i in range(4)
        ],
    )
    assert all(o.outputs[0].text in choice and o.outputs[0].finish_reason == "stop" for o in outputs)
    pattern = r"[A-Z][a-z]{2,5}-\d{3}"
    outputs = engine.generate(
        PROMPTS,
        [
            SamplingParams(temperature=0.8, seed=i, max_tokens=24, structured_outputs={"regex": pattern})
            for i in range(4)
        ],
    )
    assert all(re.fullmatch(pattern, o.outputs[0].text) for o in outputs), [o.outputs[0].text for o in outputs]
    grammar = 'root ::= answer " because " reason\nanswer ::= "yes" | "no"\nreason ::= [a-z]+ "."'
    outputs = engine.generate(
        PROMPTS,
        [
            SamplingParams(temperature=0.8, seed=i, max_tokens=40, structured_outputs={"grammar": grammar})
            for i in range(4)
        ],
    )
    texts = [o.outputs[0].text for o in outputs if o.outputs[0].finish_reason == "stop"]
    assert texts and all(re.fullmatch(r"(yes|no) because [a-z]+\.", t) for t in texts), texts


def test_json_object_parses(engine):
    outputs = engine.generate(
        PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=64, structured_outputs={"json_object": True})
    )
    for output in outputs:
        if output.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(output.outputs[0].text), dict)


def test_constraint_survives_preemption(stories_dir):
    """A pool too small for every sequence at once forces preemption mid-constraint."""
    engine = Engine(
        engine_config(
            stories_dir,
            model=dict(max_model_len=128),
            kv_cache=dict(num_blocks=12, block_size=16, swap_space_gb=0),
            scheduler=dict(max_num_seqs=8),
        )
    )
    schema = SCHEMAS["bounded_array"]
    outputs = engine.generate(
        PROMPTS * 2, SamplingParams(temperature=0.0, max_tokens=64, structured_outputs={"json": schema})
    )
    assert engine.counters.num_preemptions > 0
    for output in outputs:
        _check(schema, output.outputs[0])


def test_logit_bias_forces_and_bans_tokens(engine):
    greedy = engine.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0]
    banned = greedy.token_ids[0]
    output = engine.generate(
        ["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=8, logit_bias={banned: -100.0})
    )[0].outputs[0]
    assert banned not in output.token_ids[:1] and output.token_ids != greedy.token_ids
    forced = engine.generate(
        ["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=4, logit_bias={300: 100.0})
    )[0].outputs[0]
    assert forced.token_ids == [300] * 4


def test_logit_bias_outside_the_vocabulary_is_refused(engine):
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.add_request("x", "hi", params=SamplingParams(max_tokens=2, logit_bias={10**6: 1.0}))


@pytest.mark.parametrize(
    "body,match",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}},
            "response_format.json_schema.schema cannot be used for structured output",
        ),
        ({"structured_outputs": {"regex": "(?<=a)b"}}, "Lookbehind is not supported"),
        ({"structured_outputs": {"choice": []}}, "list of 1 to"),
        ({"structured_outputs": {"json": {}, "regex": "a"}}, "exactly one of"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "give only one"),
        ({"response_format": {"type": "xml"}}, "not supported"),
    ],
)
def test_bad_constraints_name_what_to_change(body, match):
    with pytest.raises(InvalidRequestError, match=re.escape(match) if "(" not in match else match.replace("(", r"\(")):
        constraint_from_request(body)


def test_text_response_format_is_no_constraint():
    assert constraint_from_request({"response_format": {"type": "text"}}) is None
    assert constraint_from_request({"guided_choice": ["a", "b"]}) == {"choice": ["a", "b"]}


def test_tokenloom_run_lines_take_structured_output(engine, tmp_path):
    from tokenloom.offline.offline_run import run_file

    schema = SCHEMAS["enum"]
    lines = [
        {
            "custom_id": "schema",
            "prompt": "Once upon a time",
            "max_tokens": 40,
            "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
        },
        {
            "custom_id": "choice",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "Is it a dog?", "max_tokens": 8, "structured_outputs": {"choice": ["yes", "no"]}},
        },
        {"custom_id": "bad", "prompt": "x", "structured_outputs": {"regex": "(?<=a)b"}},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = run_file(engine, src, tmp_path / "out.jsonl", progress=False)
    results = {r["custom_id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert summary.requests_ok == 2 and summary.requests_failed == 1
    jsonschema.validate(json.loads(results["schema"]["text"]), schema)
    assert results["choice"]["text"] in ("yes", "no")
    assert "Lookbehind is not supported" in results["bad"]["error"]["message"]


@pytest.mark.parametrize(
    "string_schema", [{"type": "string"}, {"type": "string", "maxLength": 8}, {"type": "string", "minLength": 1}]
)
def test_json_strings_never_admit_raw_control_characters(string_schema):
    """JSON forbids raw 0x00-0x1F inside strings; a length-bounded string must not let them in either
    (engine/structured_output/json_string_fix.py)."""
    from tokenloom.engine.models.demo.random_checkpoint import build_tokenizer
    from tokenloom.engine.sample.sampler import unpack_bitmask
    from tokenloom.engine.structured_output.guided_sequences import GuidedSequences

    tokenizer = build_tokenizer()  # byte-level BPE: single tokens for every control byte
    guided = GuidedSequences(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    schema = {"type": "object", "properties": {"s": string_schema}, "required": ["s"]}
    guided.add(0, guided.compile({"json": schema}))
    for token in tokenizer.encode('{"s": "', add_special_tokens=False):
        assert guided.accept(0, token)
    allowed = unpack_bitmask(guided.fill_bitmask([0]), len(tokenizer))[0].nonzero().flatten().tolist()
    control = [t for t in allowed if any(b < 0x20 for b in tokenizer.decode([t]).encode())]
    assert allowed and control == []
