"""Chat templates and multi-turn conversations (llmc.runtime.chat, `llmc run --chat`, `llmc chat`)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import build_model_dir, make_tokenizer

from llmc.cli import cli
from llmc.runtime import PromptTooLongError, Session
from llmc.runtime.chat import ChatTemplate, Conversation
from llmc.runtime.errors import BundleError, ChatTemplateError

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
          " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
ALTERNATING = ("{{ bos_token }}{% for message in messages %}"
               "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('roles must alternate') }}{% endif %}"
               "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
               "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}")
# whitespace control (trim_blocks, lstrip_blocks), loop controls, tojson of non-ASCII text, {% generation %}
BLOCKS = """{%- for message in messages %}
    {%- if message['role'] == 'stop' %}{% break %}{% endif %}
    {%- if message['role'] == 'system' %}
<<SYS>>{{ message['content'] | tojson }}<</SYS>>
    {%- elif message['role'] == 'assistant' %}
assistant: {% generation %}{{ message['content'] }}{% endgeneration %}{{ eos_token }}
    {% else %}
{{ message['role'] }}: {{ message['content'] }}
    {% endif %}
{%- endfor %}
{%- if add_generation_prompt %}assistant:{% endif %}"""

# tools and documents are None when there are none; the special tokens a template may write
TOOLS = ("{% if tools is not none %}[TOOLS]{% endif %}{% if tools is defined %}<tools>{{ tools | tojson }}</tools>{% endif %}"
         "{% if documents is defined and documents is none %}(no documents){% endif %}"
         "{% for m in messages %}{{ m['content'] }}|{% endfor %}{{ sep_token }}|{{ cls_token }}|{{ mask_token }}|{{ bos_token }}")
SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

MESSAGES = [
    {"role": "system", "content": "Be brief — réponds en français."},
    {"role": "user", "content": "  What is the capital of France?  "},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Germany?"},
]


@pytest.mark.parametrize("template", [CHATML, LLAMA3, BLOCKS, TOOLS], ids=["chatml", "llama3", "blocks", "tools"])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(template, generation_prompt):
    tok = make_tokenizer()
    tok.add_special_tokens({"sep_token": "[SEP]", "cls_token": "[CLS]", "mask_token": "[MASK]"})
    variables = {k: v for k in SPECIAL if isinstance(v := getattr(tok, k), str)}  # as compile stores them
    assert len(variables) == 7
    ours = ChatTemplate(template, variables).render(MESSAGES, add_generation_prompt=generation_prompt)
    theirs = tok.apply_chat_template(MESSAGES, chat_template=template, tokenize=False, add_generation_prompt=generation_prompt)
    assert ours == theirs
    stopped = MESSAGES[:2] + [{"role": "stop", "content": ""}] + MESSAGES[2:]
    assert ChatTemplate(BLOCKS, variables).render(stopped) == ChatTemplate(BLOCKS, variables).render(MESSAGES[:2])


def test_chat_template_errors_are_named():
    t = ChatTemplate(ALTERNATING, {"bos_token": "<s>", "eos_token": "</s>"})
    assert t.render(MESSAGES[1:]).startswith("<s>[INST]")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        t.render(MESSAGES)  # a system turn first
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{% for m in messages %}{{ m['content'] }}")
    with pytest.raises(ValueError, match="message 0"):
        t.render([{"role": "user"}])


CHAT_WORDS = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {{ eos_token }} {% endfor %}"
              "{% if add_generation_prompt %}{{ 'she' }} {% endif %}")


@pytest.fixture(scope="module")
def chat_bundle(tmp_path_factory):
    """A tiny random Llama whose tokenizer has a chat template made of its own words."""
    from llmc.compile import compile_model

    root = tmp_path_factory.mktemp("chat")
    d = build_model_dir("llama", root)
    tok = make_tokenizer()
    tok.chat_template = CHAT_WORDS
    tok.save_pretrained(d)
    out = root / "bundle"
    compile_model(str(d), out, chunk=8, max_context=96)
    return out


def test_a_bundle_without_a_tokenizer_cannot_chat(chat_bundle, tmp_path):
    import shutil

    from conftest import write_manifest

    d = tmp_path / "no-tokenizer"
    shutil.copytree(chat_bundle, d)
    m = json.loads((d / "manifest.json").read_text())
    m["tokenizer"] = {"eos_token_ids": m["tokenizer"]["eos_token_ids"]}
    write_manifest(d, m)
    r = invoke("run", d, "--chat", "--prompt", "the cat")
    assert r.exit_code == 6 and "has no tokenizer" in r.output and "--prompt-ids" in r.output, r.output


def test_manifest_keeps_the_template_and_its_tokens(chat_bundle):
    m = json.loads((chat_bundle / "manifest.json").read_text())["tokenizer"]
    assert m["chat_template"] == CHAT_WORDS
    assert m["special_tokens"] == {"bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]"}


def test_rewind_then_prefill_equals_a_fresh_prefill(bundles):
    s, fresh = Session(bundles("llama")), Session(bundles("llama"))
    rng = np.random.default_rng(0)
    a, b, c = (list(rng.integers(4, 100, n)) for n in (11, 7, 5))
    s.prefill(a + b)
    s.rewind(len(a))
    got = s.prefill(c)
    assert s.position == len(a) + len(c)
    np.testing.assert_allclose(got, fresh.prefill(a + c), atol=1e-4)
    with pytest.raises(ValueError, match="cannot rewind"):
        s.rewind(s.position + 1)


def _greedy(session: Session, ids: list[int], n: int) -> list[int]:
    return session.generate(ids, n, stop_at_eos=False).token_ids


def test_conversation_prefills_only_the_new_turn(chat_bundle):
    s = Session(chat_bundle)
    conv = Conversation(s, system="the king")
    reply1 = [e.token_id for e in conv.say("the cat saw a dog", 6, stop_at_eos=False)]
    ids2 = conv.prompt_ids("where is the river")
    from llmc.runtime import Metrics

    m = Metrics()
    reply2 = [e.token_id for e in conv.say("where is the river", 6, metrics=m, stop_at_eos=False)]
    # the second turn fed only what the cache did not hold: its own words and the last reply token
    assert m.prompt_tokens < len(ids2) - len(reply1)
    assert [x["role"] for x in conv.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert reply2 == _greedy(Session(chat_bundle), ids2, 6)
    assert s.position == len(ids2) + len(reply2) - 1


def test_conversation_rewinds_where_the_history_changed(chat_bundle):
    s = Session(chat_bundle)
    conv = Conversation(s)
    list(conv.say("the cat", 5, stop_at_eos=False))
    conv.messages[-1]["content"] = "red blue green"  # the rendered reply no longer matches the generated ids
    ids2 = conv.prompt_ids("the dog")
    reply2 = [e.token_id for e in conv.say("the dog", 5, stop_at_eos=False)]
    assert reply2 == _greedy(Session(chat_bundle), ids2, 5)


def test_a_reply_left_unfinished_is_recorded_with_what_it_produced(chat_bundle):
    """A reply stream never iterated, or superseded by the next turn while still open, joins the
    conversation with the tokens it yielded; the cache and the record of it stay in step, so the
    next turn replies what a fresh session replies to the whole conversation."""
    conv = Conversation(Session(chat_bundle))
    g = conv.say("the cat", 4, stop_at_eos=False)
    del g  # never iterated: the prompt was prefilled and a first token sampled, none fed
    ids = conv.prompt_ids("the dog")
    assert [m["role"] for m in conv.messages] == ["user", "assistant"] and conv.messages[1]["content"] == ""
    reply = [e.token_id for e in conv.say("the dog", 4, stop_at_eos=False)]
    assert reply == _greedy(Session(chat_bundle), ids, 4)

    conv.reset()
    g1 = conv.say("the cat", 5, stop_at_eos=False)
    first = [next(g1).token_id for _ in range(3)]
    g2 = conv.say("the dog", 5, stop_at_eos=False)  # g1 is ended and recorded with its 3 tokens
    next(g2)
    g1.close()
    assert list(g1) == []
    list(g2)
    assert [m["role"] for m in conv.messages] == ["user", "assistant", "user", "assistant"]
    assert conv.messages[1]["content"] == conv.session.decode_text(first)
    ids3 = conv.prompt_ids("the king")
    reply3 = [e.token_id for e in conv.say("the king", 6, stop_at_eos=False)]
    assert reply3 == _greedy(Session(chat_bundle), ids3, 6)


def test_a_conversation_that_renders_to_nothing_is_refused(chat_bundle):
    conv = Conversation(Session(chat_bundle))
    conv.template = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(PromptTooLongError, match="renders to no tokens"):
        conv.say("")


def test_conversation_too_long_changes_nothing(chat_bundle):
    conv = Conversation(Session(chat_bundle))
    list(conv.say("the cat", 3, stop_at_eos=False))
    before = [dict(x) for x in conv.messages]
    with pytest.raises(PromptTooLongError, match="max-context is 96"):
        conv.say("the dog " * 60)
    assert conv.messages == before
    conv.reset()
    assert conv.messages == [] and conv.session.position == 0


def test_a_bundle_without_a_template_is_refused(bundles):
    with pytest.raises(BundleError, match="no chat template"):
        Conversation(Session(bundles("llama")))


def test_chat_runs_without_torch(chat_bundle):
    import subprocess
    import sys

    from test_runtime import BLOCKER

    code = BLOCKER + f"""
from llmc.runtime import Session
from llmc.runtime.chat import Conversation
c = Conversation(Session({str(chat_bundle)!r}))
for user in ('the cat', 'the dog'):
    assert len(list(c.say(user, 3, stop_at_eos=False))) == 3
bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'onnx')]
assert not bad, bad
print('ok')
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")


def invoke(*args, input=None):
    return CliRunner().invoke(cli, [str(a) for a in args], input=input)


def test_cli_chat_and_run_chat(chat_bundle, bundles):
    r = invoke("chat", chat_bundle, "--max-new-tokens", 4, "--no-eos", input="the cat\n\n/reset\nthe dog\n/exit\nnot read\n")
    assert r.exit_code == 0, r.output
    assert "[new conversation]" in r.output and "[2 turns, 8 tokens generated" in r.output

    r = invoke("chat", chat_bundle, "--json", "--max-new-tokens", 3, "--no-eos", input="the cat\nthe dog\n")
    assert r.exit_code == 0, r.output
    turns = [json.loads(line) for line in r.stdout.splitlines()]
    assert [t["turn"] for t in turns] == [1, 2] and all(len(t["token_ids"]) == 3 and t["finish_reason"] == "length" for t in turns)
    assert turns[1]["timings"]["prompt_tokens"] < turns[1]["context_tokens"] - 2  # the second turn prefilled only its own tokens
    conv = Conversation(Session(chat_bundle))
    list(conv.say("the cat", 3, stop_at_eos=False))
    assert turns[0]["text"] == conv.messages[-1]["content"]

    r = invoke("run", chat_bundle, "--chat", "--system", "the king", "--prompt", "the cat", "--max-new-tokens", 4, "--no-eos", "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    conv = Conversation(Session(chat_bundle), system="the king")
    assert res["prompt_ids"] == conv.prompt_ids("the cat")
    assert res["token_ids"] == _greedy(conv.session, res["prompt_ids"], 4)

    r = invoke("chat", bundles("llama"), input="the cat\n")
    assert r.exit_code == 5 and "no chat template" in r.output and "hint:" in r.output
    r = invoke("chat", chat_bundle, input=b"caf\xe9\n")
    assert r.exit_code == 6 and "the message is not valid UTF-8" in r.output, r.output
    r = invoke("run", chat_bundle, "--chat", "--prompt-ids", "4,5")
    assert r.exit_code == 2 and "--chat" in r.output
    r = invoke("run", chat_bundle, "--system", "x", "--prompt", "the cat")
    assert r.exit_code == 2 and "--system needs --chat" in r.output
    r = invoke("chat", chat_bundle, input="the dog " * 60 + "\n")  # not a terminal: the error ends the session
    assert r.exit_code == 6 and "max-context is 96" in r.output
