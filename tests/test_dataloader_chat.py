"""Conversations rendered by a chat template: only the assistant's turns are trained on.

Specification: a template renders a record's "messages" into segments whose concatenation is the whole rendering; the
targets are exactly what each assistant turn adds after the generation prompt (its content and the end-of-turn
text); preprocessing a JSONL of conversations with `data.chat_template` gives documents of that text and EOS, with
the loss mask on those tokens alone, and the dataloader's labels follow it; a tokenizer_config.json's template (a named
default one too) and its bos/eos tokens work; a changed template rebuilds the dataset; a template that rewrites earlier
turns (drops a reasoning trace) gives one document per assistant turn, each with the conversation before it as the
template renders it then; a template whose assistant turns do not follow its generation prompt, one that raises, a
conversation without a template, and malformed messages are refused naming the record or template; a conversation
with no assistant turn has nothing to train and is left out.
"""

from __future__ import annotations

import json

import pytest

from services.dataloader.chat import ChatTemplate, load_chat_template
from services.dataloader.dataset import IndexedDataset
from services.dataloader.errors import DataError
from services.dataloader.packing import split_document
from services.dataloader.preprocess import preprocess
from services.dataloader.stream import build_micro_batch

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TALK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6"}]


def test_the_targets_are_what_each_assistant_turn_adds():
    chat = ChatTemplate("chatml", CHATML)
    [segments] = chat.documents(TALK, "record")  # one document: the template renders turn by turn
    assert "".join(text for text, _ in segments) == chat.render(TALK, add_generation_prompt=False)
    assert [text for text, target in segments if target] == ["4<|im_end|>\n", "6<|im_end|>\n"]
    assert segments[0] == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
                           "<|im_start|>assistant\n", False)


def test_conversations_preprocess_into_documents_masked_but_for_the_assistant(tmp_path):
    (tmp_path / "chatml.jinja").write_text(CHATML)
    corpus = tmp_path / "talk.jsonl"
    corpus.write_text(json.dumps({"messages": TALK}) + "\n"
                      + json.dumps({"messages": TALK[:2]}) + "\n"  # no assistant turn: nothing to train, left out
                      + json.dumps({"text": "plain"}) + "\n")
    ds = IndexedDataset(preprocess([str(corpus)], "byte", tmp_path / "ds", progress=False,
                                   chat_template=str(tmp_path / "chatml.jinja")))
    assert len(ds) == 2
    chat = ChatTemplate("chatml", CHATML)
    text = chat.render(TALK, add_generation_prompt=False)
    assert bytes(ds.doc(0)[:-1].tolist()).decode() == text
    targets = ds.doc_targets(0)
    trained = bytes(int(t) for t, m in zip(ds.doc(0)[:-1], targets[:-1]) if m).decode()
    assert trained == "4<|im_end|>\n6<|im_end|>\n" and targets[-1]  # and the EOS
    assert ds.doc_targets(1).all()  # the plain text
    seq_len = len(ds.doc(0))
    mb = build_micro_batch([ds], [split_document(0, len(ds.doc(0)), seq_len)], seq_len)
    labels = mb.tensors["labels"][:len(ds.doc(0)) - 1].tolist()
    assert bytes(t for t in labels if 0 <= t < 256).decode() == "4<|im_end|>\n6<|im_end|>\n"
    # another template, another dataset (not the one built for the first)
    (tmp_path / "chatml.jinja").write_text(CHATML.replace("<|im_end|>", "<|end|>"))
    again = IndexedDataset(preprocess([str(corpus)], "byte", tmp_path / "ds", progress=False,
                                      chat_template=str(tmp_path / "chatml.jinja")))
    assert b"<|end|>" in bytes(again.doc(0)[:-1].tolist()) and again.fingerprint != ds.fingerprint


def test_a_tokenizer_config_template_with_its_special_tokens(tmp_path):
    template = "{{ bos_token }}" + CHATML.replace("<|im_end|>", "{{ eos_token }}")
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "x"},
                                                    {"name": "default", "template": template}],
                                  "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    chat = load_chat_template(str(config))
    assert chat.render(TALK[:1], add_generation_prompt=False) == "<s><|im_start|>system\nBe brief.</s>\n"
    assert [text for text, target in chat.documents(TALK, "r")[0] if target] == ["4</s>\n", "6</s>\n"]


# Qwen3's way: an assistant turn's reasoning trace ("<think>...</think>") is dropped once a later user message follows
THINKING = ("{% set ns = namespace(last=0) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = "
            "loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == "
            "'assistant' and loop.index0 < ns.last %}{{ m.content.split('</think>')[-1] }}{% else %}{{ m.content }}"
            "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
THOUGHTS = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>add</think>4"},
            {"role": "user", "content": "and 3+3?"}, {"role": "assistant", "content": "<think>add again</think>6"}]


def test_a_template_that_rewrites_earlier_turns_gives_a_document_per_assistant_turn(tmp_path):
    chat = ChatTemplate("thinking", THINKING)
    first, second = chat.documents(THOUGHTS, "record")
    assert first == [("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n", False),
                     ("<think>add</think>4<|im_end|>\n", True)]
    assert second == [("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\n"
                       "and 3+3?<|im_end|>\n<|im_start|>assistant\n", False),  # the first turn as inference sees it
                      ("<think>add again</think>6<|im_end|>\n", True)]
    (tmp_path / "thinking.jinja").write_text(THINKING)
    corpus = tmp_path / "talk.jsonl"
    corpus.write_text(json.dumps({"messages": THOUGHTS}) + "\n")
    ds = IndexedDataset(preprocess([str(corpus)], "byte", tmp_path / "ds", progress=False,
                                   chat_template=str(tmp_path / "thinking.jinja")))
    assert len(ds) == 2
    for i, doc in enumerate((first, second)):
        assert bytes(ds.doc(i)[:-1].tolist()).decode() == "".join(text for text, _ in doc)
        trained = bytes(int(t) for t, m in zip(ds.doc(i)[:-1], ds.doc_targets(i)[:-1]) if m).decode()
        assert trained == doc[1][0]


@pytest.mark.parametrize("template, names", [
    ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<bot>{% endif %}",
     "does not render assistant turn 3 after its generation prompt"),  # the prompt is not how a turn begins
    ("{{ raise_exception('only user and assistant roles') }}", "failed: only user and assistant roles"),
    ("{% for m in messages %}", "does not parse"),
])
def test_templates_that_cannot_mark_turns_are_refused(tmp_path, template, names):
    (tmp_path / "t.jinja").write_text(template)
    corpus = tmp_path / "talk.jsonl"
    corpus.write_text(json.dumps({"messages": TALK}) + "\n")
    with pytest.raises(DataError, match=names):
        preprocess([str(corpus)], "byte", tmp_path / "ds", progress=False, chat_template=str(tmp_path / "t.jinja"))


@pytest.mark.parametrize("record, template, names", [
    ({"messages": TALK}, None, r"talk.jsonl:1 is a conversation .* set `data.chat_template`"),
    ({"messages": [{"role": "user"}]}, "ok", r"talk.jsonl:1: \"messages\" must be a list of"),
    ({"messages": TALK}, "missing", r"`data.chat_template=.*missing.jinja` cannot be read"),
])
def test_conversations_without_a_usable_template_or_form_are_refused(tmp_path, record, template, names):
    (tmp_path / "ok.jinja").write_text(CHATML)
    corpus = tmp_path / "talk.jsonl"
    corpus.write_text(json.dumps(record) + "\n")
    spec = str(tmp_path / f"{template}.jinja") if template else ""
    with pytest.raises(DataError, match=names):
        preprocess([str(corpus)], "byte", tmp_path / "ds", progress=False, chat_template=spec)
