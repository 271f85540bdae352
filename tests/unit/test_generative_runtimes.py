"""The generative runtimes on the shipped arith models: each loads the GGUF files, they agree
with each other token by token, and each honours max_tokens, stop strings, cancellation,
the context limit and sampling (temperature, top_p, seed), and counts the prompt's tokens.
The expected answers are arithmetic's own (stratus.tools.arith.solve)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from stratus.convert.inference import InferRequest
from stratus.errors import InvalidInput, ModelLoadError, NotFound
from stratus.families.chat import Message
from stratus.families.generation import GenerationParams, Token
from stratus.families.repository import ModelRepository
from stratus.runtimes import GENERATORS, generative_order, load_generator
from stratus.runtimes.base import LoadOptions
from stratus.runtimes.decoding import greedy_step, sampled_step, stop_at
from stratus.runtimes.generative import Finished, GenerativeRunner
from stratus.tiers import Tier
from stratus.tools.arith import solve
from tests.gguf_kv import templated_arith

MODELS = Path(__file__).resolve().parents[2] / "models"
PROMPTS = ["37+48=", "90-45=", "12+5=", "81-19="]
RUNTIMES = [
    pytest.param(
        name,
        marks=pytest.mark.skipif(
            not GENERATORS[name].availability().available, reason=GENERATORS[name].availability().reason
        ),
    )
    for name in ("openvino_genai", "llama_cpp")
]


OPENED: list[GenerativeRunner] = []  # closed after each test (their pipelines hold threads and memory)


@pytest.fixture(autouse=True)
def close_runners() -> Iterator[None]:
    yield
    while OPENED:
        OPENED.pop().close()


def runner(runtime: str, variant: str = "arith-large-fp16") -> GenerativeRunner:
    repository = ModelRepository.load(MODELS)
    family = repository.family("arith")
    options = LoadOptions(tier=Tier.CLOUD, cache_dir=Path("/nonexistent"))
    model = load_generator(family, repository.variant(variant), options, runtimes=[runtime])
    OPENED.append(model)
    return model


def generate(model: GenerativeRunner, prompt: str, **params: object) -> tuple[list[Token], str]:
    tokens: list[Token] = []
    finished = model.generate(prompt, GenerationParams(**params), lambda t: tokens.append(t) or True)  # type: ignore[arg-type, func-returns-value]
    return tokens, finished.reason


def text(tokens: list[Token]) -> str:
    return "".join(t.text for t in tokens)


def test_the_greedy_step_picks_the_top_token_with_its_log_probability_and_margin() -> None:
    logits = np.array([1.0, 3.0, 2.0, -1.0])
    chosen, token = greedy_step(logits)
    probabilities = np.exp(logits) / np.exp(logits).sum()
    assert chosen == 1
    assert token.logprob == pytest.approx(math.log(probabilities[1]))
    assert token.margin == pytest.approx(probabilities[1] - probabilities[2])


def test_stop_strings_are_found_at_their_first_start() -> None:
    assert stop_at("12\n\n34", ["\n\n"]) == 2
    assert stop_at("12 34", ["\n", " 3"]) == 2
    assert stop_at("1234", ["\n", ""]) is None


def test_devices_try_llama_cpp_first_servers_openvino_genai() -> None:
    assert [r for r, _ in generative_order(Tier.DEVICE)] == ["llama_cpp", "openvino_genai"]
    assert [r for r, _ in generative_order(Tier.EDGE)] == ["openvino_genai", "llama_cpp"]
    assert generative_order(Tier.CLOUD) == generative_order(Tier.EDGE)


def test_a_runtime_list_without_a_generative_runtime_loads_none() -> None:
    with pytest.raises(NotFound, match=r"no generative runtime among the runtimes allowed here \(litert\)"):
        runner("litert")


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_each_runtime_answers_arithmetic_and_stops_at_the_end(runtime: str) -> None:
    model = runner(runtime)
    assert model.runtime == runtime
    right = 0
    for prompt in PROMPTS:
        tokens, reason = generate(model, prompt, max_tokens=4)
        assert reason == "stop" and tokens[-1].text == ""  # the end-of-sequence token, scored too
        assert all(t.logprob <= 0.0 for t in tokens)
        right += "".join(t.text for t in tokens) == solve(prompt)
    assert right >= 3  # the large model is right on 98% of held-out prompts


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_an_answer_ended_by_its_last_allowed_token_is_a_stop_not_a_cut(runtime: str) -> None:
    """"99+99=" is answered in three digits then the end of the sequence: four tokens, at
    max_tokens 4. It was reported "length" (cut short) on OpenVINO GenAI, which counts the end
    among the generated tokens."""
    model = runner(runtime)
    tokens, reason = generate(model, "99+99=", max_tokens=4)
    assert (len(text(tokens)), len(tokens), tokens[-1].text, reason) == (3, 4, "", "stop")  # 3 digits, the end
    cut, reason = generate(model, "99+99=", max_tokens=3)
    assert (text(cut), reason) == (text(tokens), "length")  # the end was not reached within 3


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_each_runtime_honours_max_tokens_cancellation_and_the_context(runtime: str) -> None:
    model = runner(runtime)
    before, _ = generate(model, "37+48=", max_tokens=4)  # what it answers untouched
    tokens, reason = generate(model, "37+48=", max_tokens=1)
    assert (len(tokens), reason) == (1, "length")
    seen: list[Token] = []
    cancelled = model.generate("37+48=", GenerationParams(max_tokens=4), lambda t: seen.append(t) is not None)
    assert cancelled.reason == "cancelled"
    assert len(seen) == 1  # stopped at the first token it was told to
    with pytest.raises(InvalidInput, match="exceeds the context of 512 tokens"):
        generate(model, "1+" * 300 + "1=", max_tokens=4)
    after, _ = generate(model, "37+48=", max_tokens=4)  # a refusal or a cancel leaves it as it was
    assert [(t.text, t.logprob) for t in after] == [(t.text, t.logprob) for t in before]


def test_the_runtimes_agree_token_by_token() -> None:
    available = [
        name for name in ("openvino_genai", "llama_cpp") if GENERATORS[name].availability().available
    ]
    if len(available) < 2:
        pytest.skip("needs both openvino_genai and llama_cpp (make llama-env)")
    for variant in ("arith-small", "arith-large-fp16"):
        first, second = (runner(name, variant) for name in available)
        for prompt in PROMPTS:
            a, _ = generate(first, prompt, max_tokens=4)
            b, _ = generate(second, prompt, max_tokens=4)
            assert [t.text for t in a] == [t.text for t in b]
            assert [t.logprob for t in a] == pytest.approx(
                [t.logprob for t in b], abs=1e-2
            )  # F16 activations in llama.cpp


@pytest.mark.skipif(not GENERATORS["llama_cpp"].availability().available, reason="llama_cpp is not installed")
def test_llama_cpp_gives_the_top_two_margin() -> None:
    model = runner("llama_cpp")
    tokens, _ = generate(model, "37+48=", max_tokens=4)
    assert all(t.margin is not None and 0.0 <= t.margin <= 1.0 for t in tokens)
    assert tokens[0].margin <= math.exp(tokens[0].logprob)  # type: ignore[operator]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_each_runtime_stops_once_a_stop_string_is_made_and_its_tokens_are_cut(runtime: str) -> None:
    """The stop string's tokens are emitted (the caller cuts them, one split over several
    tokens too), and nothing is generated after them."""
    model = runner(runtime)
    whole, _ = generate(model, "37+48=", max_tokens=4)
    answer = text(whole)  # "85", then the end-of-text token
    assert len(answer) == 2
    made, reason = generate(model, "37+48=", max_tokens=4, stop=(answer[1:],))
    assert (text(made), reason, len(made)) == (answer, "stop", 2)  # stopped at once: no end-of-text token
    kept = model.tokens("37+48=", GenerationParams(max_tokens=4, stop=(answer[1:],)))
    assert [(t.text, t.logprob) for t in kept] == [(whole[0].text, pytest.approx(whole[0].logprob))]
    spanning = model.tokens("37+48=", GenerationParams(max_tokens=4, stop=(answer,)))
    assert spanning == []  # the stop was the whole answer, over two tokens


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_each_runtime_counts_the_prompt_with_its_tokenizer(runtime: str) -> None:
    import llama_cpp

    vocabulary = llama_cpp.Llama(str(MODELS / "arith" / "arith-large-fp16.gguf"), vocab_only=True, verbose=False)
    model = runner(runtime)
    for prompt in ("37+48=", "1+1=", "99-98= "):
        finished = model.generate(prompt, GenerationParams(max_tokens=1), lambda t: True)
        assert finished.prompt_tokens == len(vocabulary.tokenize(prompt.encode(), add_bos=False, special=False))
    vocabulary.close()


def test_a_sampled_step_draws_within_top_p_and_scores_by_the_models_own_distribution() -> None:
    logits = np.array([3.0, 2.0, 1.0, 0.0])
    raw = logits - np.log(np.exp(logits).sum())
    rng = np.random.default_rng(0)

    def draws(**settings: float) -> list[tuple[int, Token]]:
        params = GenerationParams(max_tokens=1, **settings)  # type: ignore[arg-type]
        return [sampled_step(logits, params, rng) for _ in range(400)]

    nucleus = draws(temperature=1.0, top_p=0.9)  # p = .64, .24, .09, .03: the first three reach 0.9
    assert {chosen for chosen, _ in nucleus} == {0, 1, 2}
    assert all(token.logprob == pytest.approx(raw[chosen]) for chosen, token in nucleus)
    assert {chosen for chosen, _ in draws(temperature=1.0, top_p=0.5)} == {0}  # the first alone reaches 0.5
    hot = draws(temperature=100.0)  # nearly uniform: the last token is drawn too, scored as the model sees it
    assert {chosen for chosen, _ in hot} == {0, 1, 2, 3}
    assert all(token.logprob == pytest.approx(raw[chosen]) for chosen, token in hot)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_each_runtime_samples_reproducibly_from_a_seed_and_honours_top_p(runtime: str) -> None:
    model = runner(runtime, "arith-small")
    greedy, _ = generate(model, "zz", max_tokens=6)

    def sampled(seed: int, top_p: float = 1.0) -> list[Token]:
        return generate(model, "zz", max_tokens=6, temperature=2.0, top_p=top_p, seed=seed)[0]

    answers = {seed: sampled(seed) for seed in range(8)}
    assert all(text(sampled(seed)) == text(answer) for seed, answer in list(answers.items())[:3])
    assert len({text(a) for a in answers.values()}) > 1  # different seeds, different draws
    differing = [seed for seed, answer in answers.items() if text(answer) != text(greedy)]
    # the same seeds with only the top token left to draw from: greedy's answer
    assert differing and all(text(sampled(seed, top_p=1e-6)) == text(greedy) for seed in differing[:3])
    # each token's log-probability is the model's own, not the heated one: the draws that
    # begin as greedy does give its first token's log-probability
    firsts = [a[0].logprob for a in answers.values() if a and a[0].text == greedy[0].text]
    assert firsts and all(lp == pytest.approx(greedy[0].logprob, abs=1e-3) for lp in firsts)


def test_verify_runs_each_generative_variant_in_each_runtime_and_grades_it(tmp_path: Path) -> None:
    from stratus.tools.datasets import Split
    from stratus.tools.verify.generative import (
        bundled_prompts_held_out,
        usable_generators,
        verify_generative_family,
    )
    from stratus.tools.verify.report import VerifyReport, format_report

    family = ModelRepository.load(MODELS).family("arith")
    held_out = bundled_prompts_held_out(family)
    assert held_out is not None and len(held_out.x) == 1000
    some = Split(held_out.x[:60], held_out.y[:60])
    usable, _ = usable_generators()
    rows = verify_generative_family(family, some, usable, tmp_path)
    expected = {
        (variant, runtime)
        for variant in ("arith-small", "arith-medium", "arith-large-fp16")
        for runtime in usable
    }
    assert {
        (r.name, r.runtime) for r in rows
    } == expected  # arith-large itself is HF only: nothing here runs it
    report = VerifyReport(rows=tuple(rows), skipped={})
    assert report.ok, format_report(report)
    assert all(solve(p) == a for p, a in zip(some.x, some.y, strict=True))  # the labels are arithmetic's
    # Graded here, independently: arith-small's answers on the same prompts, in one runtime.
    small = next(r for r in rows if r.name == "arith-small")
    model = runner(small.runtime, "arith-small")
    answers = ["".join(t.text for t in generate(model, prompt, max_tokens=4)[0]) for prompt in some.x]
    graded = sum(answer == label for answer, label in zip(answers, some.y, strict=True))
    assert small.accuracy == pytest.approx(graded / 60), (small.accuracy, graded)
    accuracy = {r.name: r.accuracy for r in rows}
    assert accuracy["arith-small"] < accuracy["arith-large-fp16"]  # type: ignore[operator]
    assert accuracy["arith-large-fp16"] >= 0.9  # type: ignore[operator]  # 98% on all 1,000 held-out prompts
    assert all(r.latency_ms["b1"] > 0 and r.size_kib > 50 for r in rows)
    assert all(r.kv_cache in ("f32", "f16", "default") and r.kv_cache in r.status for r in rows)
    disagreeing = dataclasses.replace(rows[0], runtime_agreement=0.95)
    assert disagreeing.failed
    assert disagreeing.status == "runtimes disagree: served alike on 95.0% of prompts < 99.0%"
    worse = dataclasses.replace(rows[0], accuracy_gap=0.05)  # one runtime answers worse: broken
    assert worse.failed and worse.status == "runtimes disagree: accuracy 0.050 below another runtime's > 0.010"
    assert not dataclasses.replace(rows[0], runtime_agreement=0.99, accuracy_gap=0.01).failed


@pytest.mark.skipif(not GENERATORS["openvino_genai"].availability().available, reason="openvino_genai is not installed")
def test_the_plugins_own_refusal_of_an_f32_cache_falls_back_on_a_bf16_cpu() -> None:
    """OpenVINO's CPU plugin itself, asked for an f32 cache with its own arithmetic: on a CPU
    where that arithmetic is bf16 (AVX512-BF16/AMX) it refuses, and the next precision opens;
    elsewhere f32 opens. This is why the runner asks for F32 arithmetic as well."""
    import openvino_genai as genai

    from stratus.families.cpu import cpu_flags
    from stratus.runtimes.openvino_genai_rt import open_with_kv_cache

    path = MODELS / "arith" / "arith-small.gguf"

    def plugin_arithmetic(kv_cache: str | None) -> object:
        scheduler = genai.SchedulerConfig()
        scheduler.cache_size = 1
        config = {} if kv_cache is None else {"KV_CACHE_PRECISION": kv_cache}
        return genai.ContinuousBatchingPipeline(str(path), scheduler, "CPU", config)

    _, chosen = open_with_kv_cache(plugin_arithmetic, path)
    bf16_cpu = bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})
    assert chosen == ("f16" if bf16_cpu else "f32")
    assert runner("openvino_genai", "arith-small").kv_cache_precision == "f32"  # F32 arithmetic: f32 opens


def test_prompts_both_runtimes_escalate_are_served_alike_whatever_their_text() -> None:
    from stratus.tools.verify.generative import _served_alike

    assert _served_alike("85", "86", 0.1, 0.2, threshold=0.5)  # both climb: the tier above answers
    assert not _served_alike("85", "86", 0.9, 0.8, threshold=0.5)  # both accept different text
    assert not _served_alike("85", "85", 0.9, 0.2, threshold=0.5)  # one accepts, one climbs
    assert _served_alike("85", "85", 0.9, 0.8, threshold=0.5)
    assert not _served_alike("85", "86", 0.1, 0.2, threshold=None)  # the top tier accepts everything


def test_openvino_genai_falls_back_to_a_kv_cache_the_cpu_plugin_accepts() -> None:
    """The refusal an AVX-512/AMX CPU gives (its text as OpenVINO 2025 words it): the next
    precision in the order is tried, and what was chosen is said."""
    from stratus.runtimes.openvino_genai_rt import KV_CACHE_ORDER, open_with_kv_cache, pipeline_config

    refused = (
        "Exception from src/inference/src/cpp/core.cpp:117:\nCheck 'key_cache_type == ov::element::bf16' "
        "failed at executor_pa.cpp:2847:\nexpect kvcache type bf16, current: f32 , f32"
    )
    tried: list[str | None] = []

    def plugin(kv_cache: str | None) -> str:
        tried.append(kv_cache)
        if kv_cache == "f32":
            raise RuntimeError(refused)
        return f"pipeline({kv_cache})"

    assert open_with_kv_cache(plugin, Path("m.gguf")) == ("pipeline(f16)", "f16")
    assert tried == ["f32", "f16"]
    assert KV_CACHE_ORDER[0] == "f32" and pipeline_config("f32") == {
        "INFERENCE_PRECISION_HINT": "f32",
        "KV_CACHE_PRECISION": "f32",
    }
    assert pipeline_config(None) == {}  # the last resort: the plugin's own arithmetic and cache

    def broken(kv_cache: str | None) -> str:
        raise RuntimeError(f"cannot read m.gguf ({kv_cache})")

    with pytest.raises(ModelLoadError) as refusal:
        open_with_kv_cache(broken, Path("m.gguf"))
    assert str(refusal.value) == (
        "openvino_genai cannot load m.gguf: kv cache f32: cannot read m.gguf (f32); "
        "kv cache f16: cannot read m.gguf (f16); kv cache default: cannot read m.gguf (None)"
    )


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_generations_at_once_give_what_each_gives_alone(runtime: str) -> None:
    """OpenVINO GenAI steps concurrent generations as one batch (llama.cpp takes turns);
    either way each thread gets exactly its own answer, and a cancel stops only its own."""
    from concurrent.futures import ThreadPoolExecutor

    from stratus.tools.arith import arith_splits

    model = runner(runtime, "arith-medium")
    prompts = [p for p, _ in arith_splits().held_out[:48]]
    alone = [generate(model, p, max_tokens=4)[0] for p in prompts]

    def one(index: int) -> list[Token] | str:
        if index % 7 == 3:  # some are cancelled after their first token
            return model.generate(prompts[index], GenerationParams(max_tokens=4), lambda t: False).reason
        return generate(model, prompts[index], max_tokens=4)[0]

    with ThreadPoolExecutor(max_workers=8) as pool:
        together = list(pool.map(one, range(len(prompts))))
    for index, (mine, reference) in enumerate(zip(together, alone, strict=True)):
        if index % 7 == 3:
            assert mine == "cancelled"
            continue
        assert isinstance(mine, list)
        assert [t.text for t in mine] == [t.text for t in reference], prompts[index]
        assert [t.logprob for t in mine] == pytest.approx([t.logprob for t in reference], abs=1e-4)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_burst_of_requests_through_local_generators_answers_each_alike(
    runtime: str, tmp_path: Path
) -> None:
    """Up to the runtime's ``parallel`` generations run at once, the others wait their turn;
    every request gets its own answer, as it would alone."""
    import asyncio

    from stratus.execution.generators import LocalGenerators
    from stratus.tools.arith import arith_splits
    from stratus.wire import inference_pb2 as pb

    repository = ModelRepository.load(MODELS)
    generators = LocalGenerators(
        repository,
        tier=Tier.EDGE,
        variants=None,
        options=LoadOptions(tier=Tier.EDGE, cache_dir=tmp_path, concurrency=2),
        runtimes=[runtime],
    )
    prompts = [p for p, _ in arith_splits().held_out[:24]]

    def request(prompt: str) -> InferRequest:
        from stratus.convert import codec
        from stratus.convert.text import text_array

        message = pb.ModelInferRequest(model_name="arith")
        codec.encode_request_inputs(message, {"text_input": text_array(prompt)})
        return InferRequest.from_wire(message)

    async def run() -> tuple[list[str], list[str]]:
        alone = [(await generators.generate(request(p))).text for p in prompts]
        together = await asyncio.gather(*(generators.generate(request(p)) for p in prompts))
        return alone, [g.text for g in together]

    try:
        assert generators.runners["arith-medium"].runtime == runtime
        alone, together = asyncio.run(run())
    finally:
        generators.close()
    assert together == alone
    assert sum(text == solve(p) for text, p in zip(alone, prompts, strict=True)) >= 16  # real answers, mostly right


JOINED = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
CONVERSATION = (
    Message(role="user", content="12+"),
    Message(role="assistant", content=""),
    Message(role="user", content="30="),
)


def templated_runner(runtime: str, tmp_path: Path, template: str) -> GenerativeRunner:
    """arith-medium from a copy of the family whose GGUF carries ``template``."""
    repository = ModelRepository.load(templated_arith(tmp_path / "models", {"arith-medium": template}))
    options = LoadOptions(tier=Tier.EDGE, cache_dir=Path("/nonexistent"))
    model = load_generator(repository.family("arith"), repository.variant("arith-medium"), options, runtimes=[runtime])
    OPENED.append(model)
    return model


def converse(model: GenerativeRunner, fallback: str) -> tuple[list[Token], Finished]:
    tokens: list[Token] = []
    finished = model.converse(CONVERSATION, fallback, GenerationParams(max_tokens=4), lambda t: tokens.append(t) or True)  # type: ignore[func-returns-value]
    return tokens, finished


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_each_runtime_generates_from_the_conversation_its_gguf_template_renders(runtime: str, tmp_path: Path) -> None:
    model = templated_runner(runtime, tmp_path, JOINED)
    tokens, finished = converse(model, "30=")
    alone, _ = generate(model, "12+30=", max_tokens=4)
    assert finished.templated and text(tokens) == text(alone) == solve("12+30=")
    assert finished.prompt_tokens == generate_finished(model, "12+30=")[1].prompt_tokens
    plain = runner(runtime, "arith-medium")  # the shipped file: no template, the last user message
    tokens, finished = converse(plain, "30=")
    assert not finished.templated and text(tokens) == text(generate(plain, "30=", max_tokens=4)[0])
    assert finished.prompt_tokens == generate_finished(plain, "30=")[1].prompt_tokens


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_rendered_prompts_special_token_text_is_that_token_and_no_bos_is_added(runtime: str, tmp_path: Path) -> None:
    model = templated_runner(runtime, tmp_path, "{{ bos_token }}" + JOINED + "{{ eos_token }}")
    _, finished = converse(model, "30=")
    # <s> and </s> one token each (as text, llama.cpp would make three and four of them)
    assert finished.prompt_tokens == 1 + generate_finished(model, "12+30=")[1].prompt_tokens + 1


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_template_that_raises_refuses_the_conversation(runtime: str, tmp_path: Path) -> None:
    model = templated_runner(runtime, tmp_path, "{{ raise_exception('one user message only') }}")
    with pytest.raises(InvalidInput, match=r"arith-medium\.gguf refused the conversation: TemplateError: one user message only"):
        converse(model, "30=")


def generate_finished(model: GenerativeRunner, prompt: str) -> tuple[list[Token], Finished]:
    tokens: list[Token] = []
    finished = model.generate(prompt, GenerationParams(max_tokens=1), lambda t: tokens.append(t) or True)  # type: ignore[func-returns-value]
    return tokens, finished
