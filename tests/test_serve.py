"""serve.py end to end: a tiny Llama served at world 2 on gloo under the Galaxy plan (ATT TP, CON SP,
MLP TP, uneven shares), asked over plain HTTP (urllib) and with the openai client.

One server serves the whole module (starting one costs two fresh processes importing torch):
  - GET /v1/models names --model_name;
  - greedy completions, asked at the same time, whole and streamed (they queue and batch), and
    as one list of prompts, are Hugging Face generate's greedy tokens (text, finish_reason, usage);
  - streaming (completions over urllib, chat with the openai client) adds up to the same text,
    ends with a finish_reason (and the usage, when asked) and [DONE];
  - a stop string cuts the text; a seeded sampled request draws what galaxy's sampler draws from
    Hugging Face's logits with that seed, and again the same the second time;
  - malformed requests (not JSON, an unknown field, n=2, a prompt longer than the plan's
    pad_size, more tokens than the model's positions, a wrong route) get 4xx JSON errors naming
    the field, and the server goes on serving;
  - last: killing rank 1 makes requests 503 and rank 0 exit 1 within timeout_s.
"""
import json
import threading
import time

import pytest
import torch

from support.serve_process import Served, call, events

from galaxy.inference.prompts import Prompt, prompt_ids
from galaxy.inference.sampling import Sampling, choose, generator_for

PAD, NEW, TIMEOUT_S = 32, 8, 20
PROMPTS = ["The for statement is used to", "Lists", "A class definition defines"]
GALAXY = dict(att_parallel_method="TP", con_parallel_method="SP", mlp_parallel_method="TP",
              tp_num_attention_heads_list=[2, 2], tp_intermediate_size_list=[200, 144], seq_scatter_list=[18, 14])


@pytest.fixture(scope="module")
def server(tmp_path_factory, sharp_lm):
    """(Served, model folder): the server starts while the test computes its references."""
    tmp, path = tmp_path_factory.mktemp("serve"), sharp_lm("llama")
    config = tmp / "galaxy.json"
    config.write_text(json.dumps(dict(model_path=path, pad_size=PAD, batch_size=4, timeout_s=TIMEOUT_S, **GALAXY)))
    served = Served(str(config), 2, "--model_name", "tiny")
    try:
        yield served, path
    finally:
        served.close()


class Reference:
    """Hugging Face's LlamaForCausalLM on the served folder: greedy generate with its cache, and
    galaxy's sampler fed Hugging Face's logits."""

    def __init__(self, path):
        from transformers import AutoTokenizer, LlamaForCausalLM
        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = LlamaForCausalLM.from_pretrained(path).eval()

    def ids(self, prompt: str, chat: bool = False) -> list[int]:
        messages = (("user", prompt),) if chat else None
        return prompt_ids(self.tok, Prompt(prompt, messages), chat)

    @torch.no_grad()
    def greedy(self, ids, new=NEW) -> dict:
        out = self.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  max_new_tokens=new, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
        tokens = out[:out.index(2) + 1] if 2 in out else out        # up to its EOS (</s> = 2)
        return dict(text=self.tok.decode(tokens, skip_special_tokens=True), tokens=len(tokens),
                    finish_reason="stop" if 2 in tokens else "length")

    @torch.no_grad()
    def sampled(self, ids, sampling: Sampling, new=NEW) -> str:
        ids, gen, tokens = list(ids), generator_for(sampling, "cpu"), []
        for _ in range(new):
            token = choose(self.model(torch.tensor([ids])).logits[0, -1].float(), sampling, gen)
            tokens.append(token)
            ids.append(token)
            if token == 2:
                break
        return self.tok.decode(tokens, skip_special_tokens=True)


def greedy_body(prompt, **more):
    return dict(model="tiny", prompt=prompt, max_tokens=NEW, temperature=0, **more)


def test_serves_hf_greedy_tokens_streams_and_refuses_bad_requests(server):
    served, path = server
    ref = Reference(path)
    want = [ref.greedy(ref.ids(p)) for p in PROMPTS]
    served.wait_serving()
    status, models = call(served.url("/v1/models"))
    assert status == 200 and models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]

    answers, streamed = [None] * len(PROMPTS), [None] * len(PROMPTS)   # asked together: they queue and batch

    def ask(i):
        answers[i] = call(served.url("/v1/completions"), greedy_body(PROMPTS[i]))

    def ask_streamed(i):
        streamed[i] = events(served.url("/v1/completions"), greedy_body(PROMPTS[i], stream=True))
    threads = [threading.Thread(target=f, args=(i,)) for i in range(len(PROMPTS)) for f in (ask, ask_streamed)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for chunks, w in zip(streamed, want):
        assert chunks[-1] == "[DONE]" and chunks[-2]["choices"][0]["finish_reason"] == w["finish_reason"]
        assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == w["text"]
    for (status, body), w, p in zip(answers, want, PROMPTS):
        assert status == 200, body
        choice = body["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (w["text"], w["finish_reason"]), p
        assert body["usage"] == dict(prompt_tokens=len(ref.ids(p)), completion_tokens=w["tokens"],
                                     total_tokens=len(ref.ids(p)) + w["tokens"])
    status, body = call(served.url("/v1/completions"), greedy_body(PROMPTS))
    assert status == 200 and [c["text"] for c in body["choices"]] == [w["text"] for w in want]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]

    bad = [(b"{not json", "not JSON", None),
           (dict(prompt="x", logprobs=1), "'logprobs' is not supported", "logprobs"),
           (dict(prompt="x", n=2), "n must be 1", "n"),
           (dict(prompt="word " * 30), f"more than the {PAD} of pad_size", "prompt"),
           (dict(prompt="x", max_tokens=600), "exceed the model's 512 positions", "prompt"),
           (dict(prompt="x", temperature="hot"), "temperature must be a number", "temperature")]
    for body, words, param in bad:
        raw = body if isinstance(body, bytes) else None
        status, answer = call(served.url("/v1/completions"), body if raw is None else None, raw=raw)
        assert status == 400 and words in answer["error"]["message"] and answer["error"]["param"] == param, answer
    status, answer = call(served.url("/v1/embeddings"), dict(input="x"))
    assert status == 404 and "no route" in answer["error"]["message"]

    check_with_openai_client(served, ref)


def check_with_openai_client(served, ref):
    """The openai package's client against the same server (after the errors above: it still serves)."""
    import openai
    client = openai.OpenAI(base_url=served.url("/v1"), api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list()] == ["tiny"]
    messages = [{"role": "user", "content": "Lists"}]
    want = ref.greedy(ref.ids("Lists", chat=True))
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=NEW, temperature=0)
    assert (whole.choices[0].message.content, whole.choices[0].finish_reason) == (want["text"], want["finish_reason"])
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=NEW, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    *pieces, last = list(stream)
    assert pieces[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in pieces) == want["text"]
    assert pieces[-1].choices[0].finish_reason == want["finish_reason"]
    assert last.choices == [] and last.usage.completion_tokens == want["tokens"] == whole.usage.completion_tokens

    text = ref.greedy(ref.ids(PROMPTS[0]))["text"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=NEW, temperature=0, stop=[stop])
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == (text[:text.index(stop)], "stop")

    sampling = Sampling(temperature=1.0, top_p=0.9, seed=11)
    drawn = [client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=NEW, temperature=1.0, top_p=0.9,
                                       seed=11).choices[0].text for _ in range(2)]
    assert drawn == [ref.sampled(ref.ids(PROMPTS[1]), sampling)] * 2
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.completions.create(model="tiny", prompt="x", n=2)


def test_a_dead_rank_makes_requests_503_and_rank_0_exit(server):
    served, _ = server
    served.wait_serving()
    served.procs[1].kill()
    served.procs[1].wait()
    killed = time.monotonic()
    status, body = call(served.url("/v1/completions"), greedy_body("Lists"))
    assert status == 503 and "lost a rank" in body["error"]["message"], body
    assert served.procs[0].wait(timeout=TIMEOUT_S + 10) == 1
    assert time.monotonic() - killed < TIMEOUT_S
    assert "a collective failed" in served.stderr()
