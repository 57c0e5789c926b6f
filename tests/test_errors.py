"""Bad input gets a clear one-line error: UserInputError (a ValueError) in Python, exit status 2 and no
traceback on the command line."""

import json
import re
import subprocess
import sys

import pytest

from gemmaserve import LLM, SamplingParams, UserInputError
from gemmaserve.config.engine import EngineConfig


def _cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gemmaserve", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(seed="x"), "seed"),
])
def test_sampling_params_reject_bad_values(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(dtype="float16"), "float16"),
    (dict(dtype="int8"), "dtype"),
    (dict(page_size=0), "page_size"),
    (dict(max_model_len=1), "max_model_len"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(kv_cache_manager="v9"), "kv_cache_manager"),
    (dict(model=""), "model"),
])
def test_engine_config_rejects_bad_values(kwargs, needle):
    with pytest.raises(UserInputError, match=needle):
        EngineConfig(**kwargs)


def test_unknown_model_and_missing_path():
    with pytest.raises(UserInputError, match="neither a known alias"):
        LLM(model="gemma-nonexistent")
    with pytest.raises(UserInputError, match="neither a known alias"):
        LLM(model="/no/such/dir")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(UserInputError, match="unsupported architecture.*LlamaForCausalLM"):
        LLM(model=str(tmp_path))


def test_unsupported_gguf_architecture(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "llama.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UserInputError, match="unsupported GGUF architecture 'llama'"):
        LLM(model=str(path))


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="GGUF"):
        LLM(model=str(bad))


def test_unknown_llm_option():
    with pytest.raises(UserInputError, match="unexpected keyword"):
        LLM(not_an_option=3)


def test_generate_rejects_bad_prompts_before_running(llm_270m):
    with pytest.raises(UserInputError, match="no prompts"):
        llm_270m.generate([])
    with pytest.raises(UserInputError, match="prompt 1: empty prompt"):
        llm_270m.generate(["fine", "   "])
    with pytest.raises(UserInputError, match="must be a string"):
        llm_270m.generate([123])
    with pytest.raises(UserInputError, match="2 SamplingParams for 1 prompts"):
        llm_270m.generate(["a"], [SamplingParams(), SamplingParams()])
    long_prompt = "word " * (llm_270m.engine._max_model_len + 10)
    with pytest.raises(UserInputError, match="prompt 1: prompt is .* tokens long; max_model_len is"):
        llm_270m.generate(["ok", long_prompt])
    assert not llm_270m.engine.has_unfinished_requests()  # nothing half-submitted


def test_request_larger_than_kv_budget_is_rejected_at_admission(tmp_path):
    from helpers import fresh_seed, save_checkpoint, tiny_hf_model

    path = save_checkpoint(tiny_hf_model(fresh_seed()), tmp_path / "tiny")
    llm = LLM(model=str(path), kv_cache_memory=64 * 1024, page_size=4)
    with pytest.raises(UserInputError, match=r"needs .* of KV cache for .* tokens, but the KV cache has"):
        llm.generate(["abc"], SamplingParams(max_tokens=4000))
    assert llm.generate(["abc"], SamplingParams(max_tokens=4))[0].outputs[0].finish_reason == "length"


def test_budget_smaller_than_one_page_fails_at_startup(tmp_path):
    from helpers import fresh_seed, save_checkpoint, tiny_hf_model

    path = save_checkpoint(tiny_hf_model(fresh_seed()), tmp_path / "tiny")
    with pytest.raises(UserInputError, match="too small for this model: one token in every layer needs"):
        LLM(model=str(path), kv_cache_memory=100)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_help_offers_only_the_dtypes_that_work(command):
    """Every --dtype that --help offers is taken; float16 is refused with its reason, so it is not offered."""
    res = _cli(command, "--help")
    offered = re.search(r"--dtype \{([^}]*)\}", res.stdout).group(1).split(",")
    assert "auto" in offered and "float16" not in offered and "fp16" not in offered
    for dtype in offered:
        assert EngineConfig(dtype=dtype).dtype == dtype
    for refused in ("float16", "fp16", "half"):
        with pytest.raises(UserInputError, match=f"dtype {refused} overflows on Gemma activations"):
            EngineConfig(dtype=refused)


@pytest.mark.parametrize("args, needle", [
    (["generate"], "required: PROMPT"),
    (["generate", ""], "empty prompt"),
    (["generate", "x", "--max-tokens", "0"], "--max-tokens: must be >= 1"),
    (["generate", "x", "--temperature", "-1"], "temperature"),
    (["generate", "x", "--top-p", "0"], "top_p"),
    (["generate", "x", "--top-k", "-2"], "top_k"),
    (["generate", "x", "--model", "no-such-model"], "neither a known alias"),
    (["generate", "x", "--kv-cache-memory", "lots"], "invalid size"),
    (["generate", "x", "--dtype", "float16"], "float16 overflows"),
    (["bench", "decode", "--batch-sizes", "a,b"], "--batch-sizes must be"),
    (["bench", "decode", "--model", "no-such-model"], "neither a known alias"),
])
def test_cli_errors_are_one_line_with_status_2(args, needle, capsys):
    """In-process (`cli.main`, as the console script calls it): each case would otherwise pay a Python
    and torch start; the next test runs two of them as real processes."""
    from gemmaserve import cli

    try:
        code = cli.main(list(args))
    except SystemExit as exc:   # argparse's own errors exit from inside parse_args
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert needle in lines[0] and "Traceback" not in err


@pytest.mark.parametrize("args, needle", [(["generate"], "required: PROMPT"),
                                          (["generate", "x", "--dtype", "float16"], "float16 overflows")])
def test_cli_errors_exit_the_process_with_status_2(args, needle):
    res = _cli(*args)
    assert res.returncode == 2, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert needle in lines[0] and "Traceback" not in res.stderr


def test_cli_prompt_longer_than_max_model_len():
    res = _cli("generate", "--max-model-len", "8", "one two three four five six seven eight nine ten")
    assert res.returncode == 2
    assert "max_model_len is 8" in res.stderr and "Traceback" not in res.stderr


def test_internal_failure_of_one_request_spares_the_others(tmp_path, monkeypatch):
    """A forward pass that fails because of one sequence, and a detokenizer that fails on one request:
    those requests finish with "error", the rest of their batch gives the tokens it gives alone."""
    from helpers import fresh_seed, save_checkpoint, tiny_hf_model

    path = save_checkpoint(tiny_hf_model(fresh_seed()), tmp_path / "tiny")
    llm = LLM(model=str(path), page_size=4)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = ["abc def", "poison runner", "ghi", "poison detok"]
    expected = {p: llm.generate([p], params)[0].outputs[0].token_ids for p in prompts}
    eng = llm.engine
    launch = eng._runner.launch

    def flaky_launch(plan, only=None):
        seqs = plan.seqs if only is None else [plan.seqs[i] for i in only]
        if any(s.req_id == "poison runner" for s in seqs):
            raise RuntimeError("injected forward failure")
        return launch(plan, only)

    monkeypatch.setattr(eng._runner, "launch", flaky_launch)
    for p in prompts:
        eng.add_request(p, params, request_id=p)
    det = eng._outputs.state("poison detok").detokenizer
    monkeypatch.setattr(det, "step", lambda ids: (_ for _ in ()).throw(ValueError("injected detokenizer failure")))
    final = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out.outputs[0]
    assert final["poison runner"].finish_reason == "error" and "injected forward" in final["poison runner"].error
    assert final["poison detok"].finish_reason == "error" and "injected detokenizer" in final["poison detok"].error
    for p in ("abc def", "ghi"):
        assert final[p].finish_reason == "length" and final[p].token_ids == expected[p]
    eng._kv.check_integrity()
    st = eng._kv.stats()
    assert st.pages_used == 0 and st.pages_free + st.pages_cached == st.num_pages


@pytest.mark.parametrize("part, needle", [
    ({"type": {}, "text": "hi"}, r"messages\[0\]\.content\[1\]\.type must be a string .* got \{\}"),
    ({"type": ["text"], "text": "hi"}, r"messages\[0\]\.content\[1\]\.type must be a string .* got \['text'\]"),
    ({"type": None, "text": "hi"}, r"messages\[0\]\.content\[1\]\.type must be a string"),
    ("hi", r"messages\[0\]\.content\[1\] must be an object"),
    ({"type": "text", "text": {}}, r"messages\[0\]\.content\[1\]: only text"),
])
def test_chat_content_parts_of_the_wrong_shape_are_user_errors(part, needle):
    """LLM.chat's (and the server's) reading of content parts: a part whose `type` is a dict or a list was looked
    up in a dict of kinds, a TypeError (unhashable type) rather than an error naming the field."""
    from gemmaserve.models.chat_template import parse_chat

    messages = [{"role": "user", "content": [{"type": "text", "text": "ok"}, part]}]
    with pytest.raises(UserInputError, match=needle):
        parse_chat(messages, {}, python_objects=True)


def test_a_template_failing_on_chat_template_kwargs_is_a_user_error():
    """chat_template_kwargs take any JSON value: one the checkpoint's template cannot use (a TypeError inside
    Jinja, not a TemplateError) is the request's error, not an internal one."""
    from types import SimpleNamespace

    from gemmaserve.models.chat_template import ChatFormatter, ChatMessage

    tok = SimpleNamespace(chat_template="{{ bos_token }}{% if budget > 3 %}long{% endif %}{{ messages[0].content }}",
                          bos_token_id=1, eos_token_id=2, special_text=lambda i: {1: "<bos>", 2: "<eos>"}[i])
    chat = ChatFormatter(tok)
    assert chat.render([ChatMessage("user", "hi")], template_kwargs={"budget": 5}) == "<bos>longhi"
    with pytest.raises(UserInputError, match="chat template: TypeError"):
        chat.render([ChatMessage("user", "hi")], template_kwargs={"budget": {"a": 1}})
