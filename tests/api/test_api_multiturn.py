"""A conversation through the official client, the way chat apps hold one: each turn the client
echoes the assistant's answer back (its content; in the second case its reasoning_content as
well, which a thinking template drops once a new user turn arrives). cached_tokens grows every
turn and covers everything the turn shares with the previous turn's prompt but at most 2 tokens
(the resume lands on the divergence, not on the page before it). The Qwen3.5 demo models (dense
and MoE) do the same with their own template, which opens thinking in every generation prompt
and drops it from earlier turns: the next prompt parts from this one inside its generation
prompt."""

import shutil

import openai
import pytest

from tokenizers import Tokenizer

from cairn.cluster.api import APIOptions, build_app
from cairn.cluster.api.chat_template import ChatTemplate
from cairn.cluster.api.engine_client import LocalEngineClient
from cairn.cluster.api.server import BackgroundServer
from cairn.workers import EngineFront

MODEL, TURNS = "tiny", 4
QUESTIONS = ["How do I build a cairn that lasts through the winter storms on the ridge?",
             "And how tall should it be so hikers see it in fog?",
             "Which stones hold best when they are wet?",
             "How often should someone check on it?"]


@pytest.fixture(scope="module")
def thinking_model_dir(tiny_model_dir, tmp_path_factory):
    """The demo checkpoint with a template that opens <think> in the generation prompt (as
    thinking-only Qwen3 and DeepSeek-R1 templates do), so every answer starts as reasoning."""
    out = tmp_path_factory.mktemp("thinking-model")
    for f in tiny_model_dir.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    source = (out / "chat_template.jinja").read_text()
    forced = source.replace(r"{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}",
                            r"{{- '<think>\n\n</think>\n\n' -}}{%- else -%}{{- '<think>\n' -}}{%- endif -%}")
    assert forced != source
    (out / "chat_template.jinja").write_text(forced)
    return out


def converse(model_dir, echo_reasoning: bool):
    engine = EngineFront.from_pretrained(model_dir, num_pages=1024)
    template, tok = ChatTemplate.from_dir(model_dir), Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    shared = []  # tokens each turn's prompt shares with the previous one's
    with BackgroundServer(build_app(LocalEngineClient(engine), model_dir,
                                    APIOptions(served_model_name=MODEL))) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        messages = [{"role": "system", "content": "You are a patient guide to stone cairns. " * 5}]
        prompts, cached, reasoning = [], [], []
        for question in QUESTIONS[:TURNS]:
            messages.append({"role": "user", "content": question})
            out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
            msg = out.choices[0].message
            ids = tok.encode(template.render(messages), add_special_tokens=False).ids
            assert len(ids) == out.usage.prompt_tokens  # the prompt the server rendered
            shared.append(common_prefix(ids, last) if prompts else 0)
            last = ids
            prompts.append(out.usage.prompt_tokens)
            cached.append(out.usage.prompt_tokens_details.cached_tokens)
            reasoning.append(getattr(msg, "reasoning_content", None))
            turn = {"role": "assistant", "content": msg.content or ""}
            if echo_reasoning and reasoning[-1]:
                turn["reasoning_content"] = reasoning[-1]
            messages.append(turn)
    return prompts, cached, reasoning, shared


def common_prefix(a: list[int], b: list[int]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def assert_cache_grows(prompts, cached, shared):
    assert cached[0] == 0
    for t in range(1, len(prompts)):
        assert cached[t] > cached[t - 1], (prompts, cached)
        assert cached[t] >= shared[t] - 2, (t, prompts, cached, shared)
        assert cached[t] < prompts[t]


def test_echoing_the_content_back_hits_the_cache_every_turn(tiny_model_dir):
    prompts, cached, _, shared = converse(tiny_model_dir, echo_reasoning=False)
    assert_cache_grows(prompts, cached, shared)


def test_echoing_content_and_reasoning_that_the_template_drops_still_hits(thinking_model_dir):
    prompts, cached, reasoning, shared = converse(thinking_model_dir, echo_reasoning=True)
    assert all(reasoning), reasoning  # the generation prompt opened <think>: answers start as reasoning
    assert_cache_grows(prompts, cached, shared)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_models_keep_their_cache_across_thinking_turns(demo_model, arch):
    prompts, cached, reasoning, shared = converse(demo_model(arch), echo_reasoning=True)
    assert all(reasoning), reasoning  # Qwen3.5's generation prompt opens <think>
    assert all(shared[t] < prompts[t - 1] for t in range(1, len(prompts))), (shared, prompts)  # parts inside it
    assert_cache_grows(prompts, cached, shared)


# ---- issue 38: template paths that resumed short of the divergence ---------------------------------

def keep_thinking_model_dir(demo_model, out):
    """The Qwen3.5 demo with a template that keeps every past reply's think block (empty when
    the client sends no reasoning back: `<think>\\n\\n</think>`) and a tokenizer trained with
    blank lines, so that "\\n\\n" is one token, as in Qwen's own: the generation prompt's last
    token ("\\n" after <think>) then merges into history's "\\n\\n", one token before the
    generation prompt's end."""
    from tokenizers import models, pre_tokenizers, trainers

    from cairn.workers.demo import write_demo_model
    from cairn.workers.demo.corpus import training_corpus
    from cairn.workers.demo.demo_tokenizer import CONTROL_TOKENS, add_control_tokens, byte_level_bpe

    tok = byte_level_bpe(models.BPE())
    trainer = trainers.BpeTrainer(vocab_size=512 - len(CONTROL_TOKENS), min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([line + "\n\n" for line in training_corpus(1500)], trainer=trainer)
    add_control_tokens(tok)
    assert len(tok.encode("\n\n", add_special_tokens=False).ids) == 1
    write_demo_model(out, size="tiny", arch="qwen3_5", tokenizer=tok, vocab_size=512)
    source = (demo_model("qwen3_5") / "chat_template.jinja").read_text()
    kept = source.replace("loop.index0 > ns.last_query", "true")
    assert kept != source
    (out / "chat_template.jinja").write_text(kept)
    return out


@pytest.fixture(scope="module")
def keeps_thinking(demo_model, tmp_path_factory):
    return keep_thinking_model_dir(demo_model, tmp_path_factory.mktemp("keeps-thinking"))


def test_a_template_that_keeps_thinking_resumes_where_a_blank_line_merged_tokens(keeps_thinking):
    """History renders the reply as `<think>\\n\\n</think>\\n\\n...`: the prompt's "\\n" and the next
    one's "\\n\\n" are different tokens, so the next prompt parts one token before this one's end;
    the hint lands there (the head moves back over whitespace that merges)."""
    prompts, cached, _, shared = converse(keeps_thinking, echo_reasoning=False)
    assert all(shared[t] == prompts[t - 1] - 1 for t in range(1, len(prompts))), (shared, prompts)
    assert_cache_grows(prompts, cached, shared)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next", "keeps thinking"])
def test_a_new_conversation_resumes_past_the_first_messages_role_header(demo_model, tmp_path, arch):
    """Two conversations of one tenant with system prompts that share nothing: the second parts
    from the first inside the first page, past `<|im_start|>system\\n`. A state there (keyed by
    the hash root: no page lies under it) and the first page's head give it those tokens."""
    model_dir = keep_thinking_model_dir(demo_model, tmp_path) if arch == "keeps thinking" else demo_model(arch)
    engine = EngineFront.from_pretrained(model_dir, num_pages=256)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    template = ChatTemplate.from_dir(model_dir)
    with BackgroundServer(build_app(LocalEngineClient(engine), model_dir,
                                    APIOptions(served_model_name=MODEL))) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        prompts = []
        for system in ("Stones stack well.", "Rivers cut valleys deep."):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[0]}]
            out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
            prompts.append((tok.encode(template.render(messages), add_special_tokens=False).ids, out.usage))
    (first, _), (second, usage) = prompts
    shared = common_prefix(first, second)
    assert shared == len(tok.encode("<|im_start|>system\n", add_special_tokens=False).ids) > 2
    assert usage.prompt_tokens_details.cached_tokens == shared


def test_an_edit_inside_a_message_resumes_at_most_a_page_short_of_where_it_parts(demo_model):
    """A user edits an earlier message inside its text, where no template can say: the pages of
    what was the newest message's text had states kept (with memory to spare), so the edit
    resumes at the page boundary before it parts, not at the message's start."""
    model_dir = demo_model("qwen3_5")
    engine = EngineFront.from_pretrained(model_dir, num_pages=256)
    tok, template = Tokenizer.from_file(str(model_dir / "tokenizer.json")), ChatTemplate.from_dir(model_dir)
    long_question = " ".join(QUESTIONS) * 2
    edited = long_question[:len(long_question) * 2 // 3] + " Actually, what about moss on the stones?"
    with BackgroundServer(build_app(LocalEngineClient(engine), model_dir,
                                    APIOptions(served_model_name=MODEL))) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        system = {"role": "system", "content": "You are a patient guide to stone cairns."}
        sent = []
        for question in (long_question, edited):
            messages = [system, {"role": "user", "content": question}]
            out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
            sent.append((tok.encode(template.render(messages), add_special_tokens=False).ids, out.usage))
    (first, _), (second, usage) = sent
    parts, page = common_prefix(first, second), engine.engine.spec.page_size
    content = len(tok.encode(template.render([system, {"role": "user", "content": ""}], add_generation_prompt=False)
                             .removesuffix("<|im_end|>\n"), add_special_tokens=False).ids)
    assert parts - content > 2 * page, "the edit parts pages into the message's text"
    assert parts - page < usage.prompt_tokens_details.cached_tokens <= parts
