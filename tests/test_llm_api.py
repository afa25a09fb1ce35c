"""The offline API and the live engine: sampling rules, stop conditions, aborts, bad input."""

from __future__ import annotations

import random

import pytest

from tailserve.llm import LLM, LLMEngine, SamplingParams
from torch_helpers import micro_model

KV_GIB = 4096 * 512 / 2**30


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    d = micro_model(tmp_path_factory.mktemp("models"))
    return LLM(str(d), dtype="float32", kv_cache_memory_gib=KV_GIB, check_integrity=True)


def _prompt(seed: int, n: int = 12) -> dict:
    rng = random.Random(seed)
    return {"prompt_token_ids": [1] + [rng.randrange(3, 512) for _ in range(n - 1)]}


def test_text_prompts_are_tokenised_and_outputs_detokenised(llm):
    out = llm.generate("The quick brown fox", SamplingParams(max_tokens=8, temperature=0))[0]
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids == tok.encode("The quick brown fox")
    assert out.text == tok.decode(out.token_ids)
    assert 1 <= len(out.token_ids) <= 8


def test_max_tokens_and_length_finish(llm):
    out = llm.generate(_prompt(1), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate(_prompt(2), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    top1 = llm.generate(_prompt(2), SamplingParams(max_tokens=8, temperature=0.8, top_k=1, ignore_eos=True))[
        0
    ]
    assert greedy.token_ids == top1.token_ids


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm):
    p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    alone = llm.generate(_prompt(3), p)[0].token_ids
    batched = llm.generate(
        [_prompt(4), _prompt(3), _prompt(5)], [SamplingParams(max_tokens=12, temperature=1.0), p, p]
    )
    assert batched[1].token_ids == alone
    other = llm.generate(
        _prompt(3), SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=43, ignore_eos=True)
    )
    assert other[0].token_ids != alone


def test_stop_token_ids_end_the_request(llm):
    ref = llm.generate(_prompt(6), SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0].token_ids
    stop = ref[3]
    out = llm.generate(
        _prompt(6), SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=[stop])
    )[0]
    first = ref.index(stop)
    assert out.token_ids == ref[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_min_tokens_forbids_stop_tokens_until_reached(llm):
    ref = llm.generate(_prompt(6), SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0].token_ids
    stop = ref[0]
    out = llm.generate(
        _prompt(6),
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=[stop], min_tokens=3),
    )[0]
    assert stop not in out.token_ids[:3]
    assert len(out.token_ids) >= 3


def test_stop_strings_cut_the_text(llm):
    ref = llm.generate(_prompt(7, 20), SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    assert len(ref.text) > 6
    stop = ref.text[3:6]
    out = llm.generate(
        _prompt(7, 20), SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop])
    )[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == ref.text[: ref.text.find(stop)]


@pytest.mark.parametrize("ignore_eos,min_tokens,stops_at", [(False, 0, 2), (True, 0, None), (False, 3, 4)])
def test_eos_stops_unless_ignored_or_too_early(ignore_eos, min_tokens, stops_at):
    from tailserve.core.executor import StepResult
    from tailserve.core.request import Request
    from tailserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
    from tailserve.llm.stop_checker import StopChecker, TextState

    class Detok:
        def push(self, token: int) -> str:
            return "x"

    tokens = iter([5, 2, 6, 2, 7, 8])  # EOS (2) second and fourth

    class Fake:
        def execute(self, out):
            return StepResult(0.0, {"r": next(tokens)})

    params = SamplingParams(max_tokens=6, ignore_eos=ignore_eos, min_tokens=min_tokens)
    checker = StopChecker(Fake(), eos_token_ids=(2,))
    request = Request("r", 3, 6, 0.0, prompt_token_ids=[1, 3, 4], sampling_params=params)
    checker.states["r"] = TextState(Detok(), params)
    checker.requests["r"] = request
    stopped_at = None
    for i in range(6):
        result = checker.execute(SchedulerOutput([ScheduledRequest(request, 1, 3 + i)]))
        request.num_output_tokens += 1
        if "r" in result.stopped:
            stopped_at = request.num_output_tokens
            break
    assert stopped_at == stops_at


def test_streaming_deltas_add_up(llm):
    engine = llm.engine
    engine.add_request(
        "s1", _prompt(8)["prompt_token_ids"], SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    )
    ids, text, final = [], "", None
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids += out.new_token_ids
            text += out.new_text
            if out.finished:
                final = out
    assert final is not None and ids == final.token_ids and text == final.text
    assert final.first_token_time >= final.arrival_time and final.finish_time >= final.first_token_time
    assert len(final.token_times) == 9


def test_abort_frees_blocks_and_reports(llm):
    engine = llm.engine
    engine.add_request("a1", _prompt(9)["prompt_token_ids"], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("a2", _prompt(10)["prompt_token_ids"], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort_request("a1", "client disconnected")
    engine.abort_request("a2", "client disconnected")
    engine.abort_request("never-added")
    outs = engine.step()
    assert {o.request_id for o in outs if o.finished} == {"a1", "a2"}
    assert all(o.finish_reason == "abort" and o.status_reason == "client disconnected" for o in outs)
    assert not engine.has_unfinished_requests()
    kv = engine.scheduler.kv_cache
    assert not kv.num_held("a1") and not kv.num_held("a2")
    engine.check_integrity()


@pytest.mark.parametrize(
    "prompt,params,message",
    [
        ([1] * 300, SamplingParams(max_tokens=4), "maximum context length is 256 tokens"),
        ([1] * 200, SamplingParams(max_tokens=100), "maximum context length"),
        ([], SamplingParams(), "empty"),
        ([1, 99999], SamplingParams(), "out of vocabulary"),
    ],
)
def test_bad_requests_are_refused_with_a_reason(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request("bad", prompt, params)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"top_k": -5}, "top_k"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_simulated_executor_paces_placeholder_tokens(tmp_path):
    d = micro_model(tmp_path)
    engine = LLMEngine.from_args(str(d), executor="sim", hardware="H100-SXM", sim_model="Llama-3-8B")
    engine.add_request("x", "hello world", SamplingParams(max_tokens=5))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    final = outs[-1]
    assert final.finished and final.finish_reason == "length" and len(final.token_ids) == 5
    # Five iterations of an 8B model on an H100 take milliseconds each on the wall clock.
    assert final.finish_time - final.arrival_time > 0.005


def test_simulated_executor_takes_the_calibration_it_is_given(tmp_path):
    d = micro_model(tmp_path)
    kwargs = {"executor": "sim", "hardware": "h100", "sim_model": "llama-3-8b"}
    fitted = LLMEngine.from_args(str(d), **kwargs)
    generic = LLMEngine.from_args(str(d), calibration="generic", **kwargs)
    assert fitted.deployment["calibration"] == "auto" and generic.deployment["calibration"] == "generic"
    assert generic.deployment["model"] == "Llama-3-8B" and generic.deployment["hardware"] == "H100-SXM"
    # The generic roofline and the GPU's fitted curve price a decode step differently.
    step = [e.stop_checker.inner.sim.cost_model.decode_time(8, 512) for e in (fitted, generic)]
    assert step[0] != step[1]


def test_unknown_policy_and_flag_are_clear(tmp_path):
    d = micro_model(tmp_path)
    with pytest.raises(ValueError, match="unknown policy"):
        LLM(str(d), policy="nope")
    with pytest.raises(ValueError, match="has no flag"):
        LLM(str(d), policy="vllm", not_a_flag=3)


# ---- vLLM's Python API shape ------------------------------------------------------------------
def test_top_level_import_is_lazy_and_does_not_load_torch():
    import subprocess
    import sys

    code = (
        "import sys; import tailserve; from tailserve import LLM, SamplingParams, RequestOutput; "
        "print('torch' in sys.modules, LLM.__module__, SamplingParams().max_tokens)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "tailserve.llm.llm", "16"]


def test_generate_returns_vllm_shaped_outputs(llm):
    import tailserve

    params = tailserve.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    text, ids = llm.generate(["The quick brown fox", _prompt(9)], params)
    assert text.prompt == "The quick brown fox" and ids.prompt is None  # as vLLM for token ids
    assert ids.prompt_token_ids == _prompt(9)["prompt_token_ids"]
    (completion,) = text.outputs
    assert completion.index == 0 and completion.text == text.text and completion.token_ids == text.token_ids
    assert len(completion.token_ids) == 6 and completion.finish_reason == "length" and completion.finished()
    m = text.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
    assert m.finished_time == m.last_token_time and m.time_in_queue >= 0


def test_chat_renders_the_tokenizer_template(llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    (out,) = llm.chat(messages, params)
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert out.prompt == rendered and "Hi there" in rendered
    assert out.prompt_token_ids == tok.encode(rendered, add_special_tokens=False)
    # The same tokens through generate give the same greedy output; a list of conversations works.
    again = llm.generate({"prompt_token_ids": out.prompt_token_ids}, params)[0]
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
    assert len(llm.chat([messages, messages[1:]], params)) == 2
    with pytest.raises(ValueError, match="no messages"):
        llm.chat([], params)
