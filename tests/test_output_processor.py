"""The output processor: text, stop strings and logprobs from committed token ids, the same whether the
scheduler commits one token per step or several (a speculative step), on the real Gemma vocabulary."""

from __future__ import annotations

import random

import pytest

from gemmaserve.engine.output_processor import OutputProcessor
from gemmaserve.engine.request import Request, TokenLogprob
from gemmaserve.engine.sampling_params import SamplingParams

from helpers import fresh_seed
from test_detokenizer import tok  # noqa: F401  (the fixture)

TEXT = "The quick brown fox jumps over the lazy dog, then naps. 日本語 and more text after that."


def _run(tok, params: SamplingParams, ids: list[int], sizes) -> tuple:
    """Commit `ids` in runs of the given sizes (as the scheduler does: a run stops where the request
    finishes), then read each run as the engine does. Returns what a user would see."""
    req = Request("r", "r", 0, "", [2], params, frozenset({tok.eos_token_id}), 1 << 20)
    out = OutputProcessor(tok)
    out.add(req)
    deltas, pos = [], 0
    for size in sizes:
        run = ids[pos:pos + size]
        pos += size
        lps = []
        for t in run:
            if req.is_finished:
                break
            req.append_token(t)
            lps.append(TokenLogprob(t, -0.5, ()))
        ended = out.process(req, lps)
        if ended is not None:
            req.finish(ended.reason, ended.stop_reason)
        o = out.output(req)
        deltas.append(o.outputs[0].delta_text)
        if o.finished:
            c = o.outputs[0]
            assert "".join(deltas) == c.text
            return c.text, c.token_ids, c.finish_reason, c.stop_reason, [lp.token_id for lp in c.logprobs or []]
    raise AssertionError("never finished")


@pytest.mark.parametrize("case", ["stop_string", "stop_token", "eos", "length", "held_back_stop"])
def test_runs_of_any_size_give_the_output_of_one_token_per_step(tok, case):  # noqa: F811
    rng = random.Random(fresh_seed())
    ids = tok.encode(TEXT)[1:]
    kw = dict(max_tokens=10_000, logprobs=0)
    if case == "stop_string":
        kw["stop"] = ["lazy d"]                      # ends inside a token's text
    elif case == "stop_token":
        kw["stop_token_ids"] = [ids[9]]
    elif case == "eos":
        ids = ids[:12] + [tok.eos_token_id] + ids[12:]
    elif case == "length":
        kw["max_tokens"] = 11
    else:
        kw["stop"] = ["日本語"]                      # its bytes arrive over several tokens
    params = SamplingParams(**kw)
    one = _run(tok, params, ids, [1] * len(ids))
    for _ in range(5):
        sizes = [rng.randrange(1, 7) for _ in ids]
        assert _run(tok, params, ids, sizes) == one, sizes
    text, token_ids, reason, stop_reason, lp_ids = one
    assert lp_ids == token_ids   # a logprob for every reported token, none for the tokens a stop string cut
    if case in ("stop_string", "held_back_stop"):
        assert (reason, stop_reason) == ("stop", kw["stop"][0]) and kw["stop"][0] not in text
        assert len(token_ids) < len(ids) and tok.decode(token_ids).find(kw["stop"][0]) >= 0
    elif case == "stop_token":
        assert (reason, stop_reason, token_ids) == ("stop", ids[9], ids[:10])
    elif case == "eos":
        assert (reason, token_ids[-1], len(token_ids)) == ("stop", tok.eos_token_id, 13)
    else:
        assert (reason, len(token_ids)) == ("length", 11)
