"""`response_format` through the API with the official `openai` client, unchanged: JSON Schema and
json_object answers that parse and validate, mixed in one batch with plain rows that stay as they are
alone, on the base model and an adapter; `chat.completions.parse`; refusals before anything is queued."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pydantic
import pytest

from tests.platform.factories import BASE_MODEL

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 18, "maximum": 130},
        "role": {"enum": ["admin", "user", "guest"]},
        "pets": {"type": "array", "maxItems": 3, "items": {
            "type": "object",
            "properties": {"kind": {"type": "string", "maxLength": 12},
                           "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
            "required": ["kind", "legs"], "additionalProperties": False}},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "pets", "address"],
    "additionalProperties": False,
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
PEOPLE = ["Ann is 31, lives in Oslo and has a cat.", "Bob, an admin aged 45 from Lima, owns two dogs."]
TOPICS = ["the sky", "grass"]


def user(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


@pytest.fixture
def tenant(make_tenant, trained_adapters):
    """A tenant with an adapter trained to answer with JSON (tests/conftest.py)."""
    t = make_tenant()
    assert t.upload("extractor", trained_adapters["json"]).status_code == 201
    return t


@pytest.fixture
def client(server, tenant):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=tenant.key, max_retries=0)


def mixed_calls() -> list[tuple[str, dict]]:
    """12 calls: (kind, create() keywords) for a nested schema, json_object and plain text, each on the base
    model and the adapter, two prompts each."""
    calls = []
    for model in (BASE_MODEL, "extractor"):
        for person, topic in zip(PEOPLE, TOPICS, strict=True):
            calls.append(("schema", dict(model=model, messages=user(f"Extract the person as JSON: {person}"),
                                         response_format=PERSON_FORMAT, max_tokens=160)))
            calls.append(("json_object", dict(
                model=model, response_format={"type": "json_object"}, max_tokens=60,
                messages=user(f'Reply with a JSON object with one key, "color", naming the colour of {topic}.'))))
            calls.append(("plain", dict(model=model, messages=user(f"Say one sentence about {topic}."),
                                        max_tokens=20)))
    return calls


def test_twelve_concurrent_calls_mixing_schemas_json_object_and_plain_text(client, gateway):
    calls = mixed_calls()
    run = lambda kw: client.chat.completions.create(temperature=0, **kw)  # noqa: E731
    plain_alone = {i: run(kw).choices[0] for i, (kind, kw) in enumerate(calls) if kind == "plain"}
    steps_before = gateway.engine.llm.engine.num_steps
    rows_before = gateway.engine.llm.engine.num_batched_rows
    with ThreadPoolExecutor(len(calls)) as pool:
        answers = list(pool.map(run, [kw for _, kw in calls]))
    for (kind, kw), answer in zip(calls, answers, strict=True):
        choice = answer.choices[0]
        assert answer.model == kw["model"]
        if kind == "plain":
            continue
        assert choice.finish_reason == "stop", choice.message.content
        value = json.loads(choice.message.content)
        jsonschema.validate(value, PERSON if kind == "schema" else {"type": "object"})
    for i, choice in plain_alone.items():
        mixed = answers[i].choices[0]
        assert (mixed.message.content, mixed.finish_reason) == (choice.message.content, choice.finish_reason)
    core = gateway.engine.llm.engine
    # the constrained rows ran batched: many rows per step, not one request at a time
    assert (core.num_batched_rows - rows_before) / (core.num_steps - steps_before) > 4


def test_parse_with_a_pydantic_model_returns_the_parsed_object(client):
    class Pet(pydantic.BaseModel):
        kind: str
        legs: int

    class Person(pydantic.BaseModel):
        name: str
        age: int
        pets: list[Pet]

    r = client.chat.completions.parse(model="extractor", messages=user(f"Extract the person: {PEOPLE[0]}"),
                                      response_format=Person, temperature=0, max_tokens=120)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)
    assert choice.message.parsed == Person.model_validate_json(choice.message.content)


def test_an_answer_cut_by_max_tokens_ends_with_length_not_stop(client):
    r = client.chat.completions.create(model=BASE_MODEL, messages=user(f"Extract the person: {PEOPLE[1]}"),
                                       response_format=PERSON_FORMAT, temperature=0, max_tokens=8)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 8
    assert choice.message.content.startswith('{"name":"')
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.content)
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(model=BASE_MODEL, messages=user("Extract: Ann"), max_tokens=3,
                                      response_format=pydantic.create_model("P", name=(str, ...)))


def test_streamed_and_logprobs_follow_the_grammar(client):
    kw = dict(model="extractor", messages=user(f"Extract the person as JSON: {PEOPLE[0]}"),
              response_format=PERSON_FORMAT, temperature=0, max_tokens=160, logprobs=True, top_logprobs=5)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    content = whole.choices[0].logprobs.content
    assert "".join(e.token for e in content) == text
    first = content[0]  # the grammar allows only '{' (and tokens starting with it) first
    assert first.token.startswith("{")
    assert all(t.token.startswith("{") for t in first.top_logprobs)
    for e in content:  # greedy: the sampled token is the most likely allowed one; excluded tokens are not listed
        assert e.top_logprobs[0].logprob == e.logprob and all(t.logprob > float("-inf") for t in e.top_logprobs)


def test_completions_take_response_format_too(client):
    r = client.completions.create(model=BASE_MODEL, prompt="A person as JSON:", temperature=0, max_tokens=160,
                                  extra_body={"response_format": PERSON_FORMAT})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


@pytest.mark.parametrize("response_format, message", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}},
     "The response_format cannot be honoured: invalid JSON schema: Invalid type: frob"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}},
     'The response_format cannot be honoured: invalid JSON schema: Unimplemented keys: ["not"]'),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5,
                                                                       "maximum": 1}}},
     "The response_format cannot be honoured: invalid JSON schema: Unsatisfiable schema: minimum (5) is greater "
     "than maximum (1)"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}}},
     None),  # the regex parser's multi-line reason
    # valid to the validator, but no value can ever be generated: found by the compile's probe, not mid-answer
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$defs": {"a": {"$ref": "#/$defs/a"}},
                                                                       "$ref": "#/$defs/a"}}},
     "The response_format cannot be honoured: invalid JSON schema: NoExtensionBias"),

    ({"type": "json_schema", "json_schema": {"name": "x"}},
     "response_format.json_schema.schema must be a JSON Schema object, got nothing"),
    ({"type": "json_schema", "json_schema": {"name": "has space", "schema": {}}},
     "response_format.json_schema.name must be 1-64 characters of a-z, A-Z, 0-9, _ and -, got 'has space'"),
    ({"type": "json_schema"},
     "response_format.json_schema must be an object with `name` and `schema` when type is 'json_schema'"),
    ({"type": "xml"}, "response_format.type must be one of 'text', 'json_object', 'json_schema', got 'xml'"),
    ({"type": "json_schema", "json_schema": {"name": "enum", "schema": {"enum": [f"v{i}" for i in range(100_000)]}}},
     "The response_format cannot be honoured: invalid JSON schema: initial lexer configuration (grammar) too big "
     "(limit for this grammar: 1000000)"),
])
def test_a_schema_that_cannot_be_honoured_is_a_400_that_costs_no_quota(make_tenant, response_format, message):
    t = make_tenant(rpm=1)
    r = t.chat(response_format=response_format)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format" and error["type"] == "invalid_request_error"
    if message is None:
        assert "regex parse error" in error["message"] and "unclosed group" in error["message"]
    else:
        assert error["message"] == message
    assert t.chat(max_tokens=1).status_code == 200  # the refused call did not take the minute's one request
    # out of requests: a schema the library must judge meets the rate limit first (nothing compiled); a
    # malformed response_format is refused with the body, before any quota
    r = t.chat(response_format=response_format)
    if message is None or message.startswith("The response_format cannot be honoured"):
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    else:
        assert r.status_code == 400 and r.json()["error"]["message"] == message


@pytest.mark.parametrize("depth, param, message", [
    (300, "response_format", "The response_format cannot be honoured: invalid JSON schema: recursion limit exceeded "
                             "at line 1 column 2220"),  # llguidance's bound
    (2000, None, "The request body is not valid JSON: it is nested too deeply to parse."),  # past Python's parser
])
def test_a_schema_nested_too_deeply_is_a_400_not_a_crash(tenant, depth, param, message):
    schema = '{"type":"object","properties":{"a":' * depth + '{"type":"integer"}' + "}}" * depth
    head = json.dumps({"model": BASE_MODEL, "messages": user("Hi"), "max_tokens": 2})[:-1]
    body = head + ', "response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": ' + schema + "}}}"
    r = tenant.client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    assert tenant.chat().status_code == 200


def test_a_grammar_that_fails_mid_answer_is_a_400_not_a_retryable_503():
    from loraplex.engine.structured_output import GrammarError
    from loraplex.platform.completion_response import error_of

    err = error_of(None, f"{GrammarError.__name__}: the grammar failed: lexer error: too many expressions", False)
    assert err.status_code == 400 and err.param == "response_format"
    assert err.message == ("The response_format's grammar failed while generating: the grammar failed: lexer error: "
                           "too many expressions. Simplify the schema.")
    assert error_of(None, "ValueError: something else", False).status_code == 503


def test_nan_in_a_schema_is_refused_not_turned_into_null(tenant):
    head = json.dumps({"model": BASE_MODEL, "messages": user("Hi"), "max_tokens": 2})[:-1]
    body = head + ', "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"enum": [NaN]}}}}'
    r = tenant.client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"] == {
        "message": "The response_format cannot be honoured: the JSON schema contains NaN or Infinity, which JSON does "
                   "not allow", "type": "invalid_request_error", "param": "response_format", "code": None}
