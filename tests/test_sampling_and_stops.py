"""The sampler's rules, without a model: greedy and seeded draws, Hugging Face's top-k and top-p
filters, and how a row stops (EOS, --ignore_eos, a stop string, max_new_tokens) and streams."""
import pytest
import torch

from galaxy.inference.requests import LENGTH, RUNNING, STOPPED, Progress, Request, TextStream
from galaxy.inference.sampling import Sampling, _top_p, choose, generator_for


class Letters:
    """A tokenizer whose token i is the letter chr(97 + i); token 25 ("z") is special."""
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i) for i in ids if not (skip_special_tokens and i == 25))


def test_greedy_is_argmax_and_draws_repeat_under_a_seed():
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0])
    assert choose(logits, Sampling(), None) == 1
    s = Sampling(temperature=1.0, seed=5)
    draws = [[choose(logits, s, g) for _ in range(20)] for g in (generator_for(s, "cpu"), generator_for(s, "cpu"))]
    assert draws[0] == draws[1] and len(set(draws[0])) > 1


def test_top_k_and_top_p_keep_what_hugging_face_keeps():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper
    scores = torch.randn(50, generator=torch.Generator().manual_seed(0))
    for p in (0.3, 0.8, 0.95):
        want = TopPLogitsWarper(p)(None, scores[None].clone())[0]
        assert torch.equal(torch.isinf(_top_p(scores, p)), torch.isinf(want))
    s = Sampling(temperature=1.0, top_k=3, seed=1)
    g = generator_for(s, "cpu")
    kept = set(torch.topk(scores, 3).indices.tolist())
    assert {choose(scores, s, g) for _ in range(200)} == kept
    assert torch.isinf(TopKLogitsWarper(3)(None, scores[None].clone())[0]).sum() == 47


def rows(*requests):
    return Progress([Request("", (0,), **r) for r in requests], Letters(), frozenset({25}), pad=24)


def step(progress, tokens):
    logits = torch.full((len(tokens), 26), -10.0)
    for i, t in enumerate(tokens):
        logits[i, t] = 10.0
    return progress.record(progress.choose(logits))


def test_rows_stop_at_eos_length_or_a_stop_string():
    progress = rows(dict(max_new_tokens=3), dict(max_new_tokens=3, ignore_eos=True),
                    dict(max_new_tokens=9, stop=("cd",)), dict(max_new_tokens=2))
    assert step(progress, [25, 25, 2, 0]) == [(0, 25, STOPPED), (1, 25, RUNNING), (2, 2, RUNNING), (3, 0, RUNNING)]
    assert step(progress, [1, 25, 3, 1]) == [(1, 25, RUNNING), (2, 3, STOPPED), (3, 1, LENGTH)]
    assert step(progress, [0, 0, 0, 0]) == [(1, 0, LENGTH)]
    assert progress.done
    done = progress.completions()
    assert [c.finish_reason for c in done] == ["stop", "length", "stop", "length"]
    assert [c.tokens for c in done] == [[25], [25, 25, 0], [2, 3], [0, 1]]
    assert [c.text for c in done] == ["", "a", "", "ab"]


@pytest.mark.parametrize("finished", [False, True])
def test_stream_holds_back_what_may_become_a_stop_string(finished):
    stream = TextStream(Letters(), ("xyz",))
    assert stream.piece([0, 1, 2], False) == "a"            # "bc" may start "xyz"? only the last 2 are held
    assert stream.piece([0, 1, 2, 23, 24], finished) == ("bcxy" if finished else "bc")
