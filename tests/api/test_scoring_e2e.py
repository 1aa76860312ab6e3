"""Scoring through the API with the official `openai` SDK (uvicorn + Postgres + Redis + a real
worker): `echo` with `logprobs` and `max_tokens: 0`, prompts as token-id lists and lists of them,
vLLM's `prompt_logprobs`, the tokenizer endpoints, and the 400s of bad scoring requests. Every
prompt logprob equals transformers' log-softmax on the same checkpoint."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
import transformers

from tests.api.conftest import MAX_MODEL_LEN

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def sdk(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=stack.admin_key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hf(stack):
    model = transformers.AutoModelForCausalLM.from_pretrained(stack.checkpoint, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(stack.checkpoint)
    return model, tokenizer


def transformers_logprobs(model, ids: list[int]) -> tuple[list[float], list[float]]:
    """(logprob of each token after the first, the top logprob at each of those positions)."""
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return chosen.tolist(), logprobs.max(dim=-1).values.tolist()


def test_echo_with_logprobs_and_max_tokens_0_scores_each_prompt_like_transformers(sdk, stack, hf):
    model, _ = hf
    prompts = [[1, 17, 42, 99, 5, 250, 31], [1, 8, 8, 8, 300], [1, 64, 2, 77, 120, 9, 9, 14, 3]]
    reply = sdk.completions.create(
        model=stack.model, prompt=prompts, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert reply.usage.prompt_tokens == sum(map(len, prompts)) and reply.usage.completion_tokens == 0
    for choice, prompt in zip(reply.choices, prompts):
        logprobs = choice.logprobs
        assert choice.finish_reason == "length" and len(logprobs.tokens) == len(prompt)
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        expected, top = transformers_logprobs(model, prompt)
        assert logprobs.token_logprobs[1:] == pytest.approx(expected, abs=TOLERANCE)
        assert [max(t.values()) for t in logprobs.top_logprobs[1:]] == pytest.approx(top, abs=TOLERANCE)


def test_echo_prepends_the_prompt_to_generated_text_and_logprobs(sdk, stack, hf):
    model, _ = hf
    prompt = "Once upon a time"
    plain = sdk.completions.create(
        model=stack.model, prompt=prompt, max_tokens=4, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    echoed = sdk.completions.create(
        model=stack.model,
        prompt=prompt,
        max_tokens=4,
        temperature=0,
        logprobs=2,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    choice = echoed.choices[0]
    assert choice.text == prompt + plain.choices[0].text
    num_prompt = echoed.usage.prompt_tokens
    assert len(choice.logprobs.tokens) == num_prompt + 4
    assert choice.logprobs.token_logprobs[num_prompt:] == pytest.approx(
        plain.choices[0].logprobs.token_logprobs, abs=TOLERANCE
    )


def test_prompt_logprobs_and_a_list_of_text_prompts(stack, hf):
    model, tokenizer = hf
    with httpx.Client(
        base_url=stack.base_url, headers={"Authorization": f"Bearer {stack.admin_key}"}, timeout=60
    ) as client:
        reply = client.post(
            "/v1/completions",
            json={
                "model": stack.model,
                "prompt": ["first prompt", "a second one"],
                "max_tokens": 2,
                "n": 2,
                "temperature": 0,
                "echo": True,
                "logprobs": 0,
            },
        ).json()
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2, 3]  # prompt number x n + choice number
    assert reply["choices"][2]["text"].startswith("a second one")
    ids = tokenizer("a second one").input_ids
    expected, _ = transformers_logprobs(model, ids)
    assert reply["choices"][2]["logprobs"]["token_logprobs"][1 : len(ids)] == pytest.approx(expected, abs=TOLERANCE)


def test_tokenizer_endpoints_match_the_checkpoints_tokenizer(stack, hf):
    _, tokenizer = hf
    headers = {"Authorization": f"Bearer {stack.admin_key}"}
    with httpx.Client(base_url=stack.base_url, headers=headers, timeout=60) as client:
        tokenized = client.post("/tokenize", json={"prompt": "Hello there", "return_token_strs": True}).json()
        bare = client.post("/tokenize", json={"prompt": "Hello there", "add_special_tokens": False}).json()
        text = client.post("/detokenize", json={"tokens": bare["tokens"]}).json()
        info = client.get("/tokenizer_info").json()
        anonymous = httpx.get(f"{stack.base_url}/tokenizer_info")
        outside = client.post("/detokenize", json={"tokens": [10**6]})
        both = client.post("/tokenize", json={"prompt": "x", "messages": [{"role": "user", "content": "x"}]})
    assert tokenized["tokens"] == tokenizer("Hello there").input_ids and tokenized["count"] == len(tokenized["tokens"])
    assert tokenized["token_strs"] == tokenizer.convert_ids_to_tokens(tokenized["tokens"])
    assert tokenized["max_model_len"] == MAX_MODEL_LEN
    assert bare["tokens"] == tokenizer("Hello there", add_special_tokens=False).input_ids
    assert text["prompt"] == tokenizer.decode(bare["tokens"])
    assert info["eos_token"] == tokenizer.eos_token and info["bos_token"] == tokenizer.bos_token
    assert info["model_max_length"] == MAX_MODEL_LEN
    assert anonymous.status_code == 401
    assert outside.status_code == 400 and "outside the vocabulary" in outside.json()["error"]["message"]
    assert both.status_code == 400


@pytest.mark.parametrize(
    "fields, status, needle",
    [
        ({"prompt": [], "max_tokens": 1}, 400, "prompt is an empty list"),
        ({"prompt": [[1, 5], [1, 10**6]], "max_tokens": 1}, 400, "prompt[1]: prompt token ids"),
        ({"prompt": "x", "max_tokens": 1, "echo": True, "stream": True}, 400, "echo is not supported with stream"),
        ({"prompt": ["a", "b"], "max_tokens": 1, "stream": True}, 400, "stream: true takes one prompt"),
        ({"prompt": "x", "max_tokens": 0, "prompt_logprobs": 21}, 422, "prompt_logprobs"),
        ({"prompt": "x", "max_tokens": -1}, 422, "max_tokens"),
    ],
)
def test_bad_scoring_requests_get_an_error_naming_the_problem(stack, fields, status, needle):
    with httpx.Client(
        base_url=stack.base_url, headers={"Authorization": f"Bearer {stack.admin_key}"}, timeout=60
    ) as client:
        reply = client.post("/v1/completions", json={"model": stack.model, **fields})
        after = client.post("/v1/completions", json={"model": stack.model, "prompt": "still fine", "max_tokens": 1})
    assert reply.status_code == status and needle in reply.json()["error"]["message"], reply.text
    assert after.status_code == 200  # nothing else failed


def test_chat_refuses_echo(sdk, stack):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(
            model=stack.model, messages=[{"role": "user", "content": "hi"}], max_tokens=1, extra_body={"echo": True}
        )
    assert "echo applies to /v1/completions" in info.value.body["message"]
