"""Qwen's byte-level BPE (Qwen2, Qwen2.5, Qwen3) and its chat templates.

Qwen's own tokenizer.json is not in the environment, so the tests build one
like it with HF `tokenizers`: an NFC normalizer, the pre-tokenizer of
Qwen2's tokenizer.json (Split on Qwen's regex, isolated, then ByteLevel
without its own regex), a ByteLevel decoder, merges learned on our corpus,
and Qwen's special tokens. References:
- HF `tokenizers` loading that same tokenizer.json;
- for the GGUF with `tokenizer.ggml.pre = "qwen2"` written from the same
  vocabulary: HF `tokenizers` without the normalizer, since llama.cpp (whose
  behaviour the GGUF path follows) applies no NFC: a decomposed "é" gives
  other ids from a Qwen GGUF than from Qwen's tokenizer.json;
- transformers' renderer, for Qwen2.5's and Qwen3's real chat templates
  (written here from their published text).
"""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest

from pagedllm.tokenizer import IncrementalDetokenizer, Tokenizer
from pagedllm.tokenizer.bytelevel import BYTE_TO_CHAR
from pagedllm.tokenizer.chat_template import render_chat_template
from pagedllm.tokenizer.pretokenize import QWEN2_PATTERN, SplitRule

tokenizers = pytest.importorskip("tokenizers")

CORPUS = Path(__file__).resolve().parent / "tokenizer_corpus"
# Qwen2's tokenizer.json spells its Split regex this way.
QWEN2_JSON_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PLAIN_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]  # special: false in Qwen3

QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

QWEN3_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""


def corpus_texts() -> list[str]:
    texts = []
    for f in sorted(CORPUS.glob("*.txt")):
        text = f.read_bytes().decode("utf-8")
        texts += [text, *text.split("\n"), *text.split(" ")]
    return [t for t in texts if t]


def qwen_like():
    """An HF `tokenizers.Tokenizer` built as Qwen2's tokenizer.json is, with merges
    learned on our corpus (the first 151,643 ids of the real one are its BPE
    vocabulary; here a few thousand)."""
    from tokenizers import (
        Regex,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = tokenizers.Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_JSON_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False, trim_offsets=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, use_regex=False, trim_offsets=False)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=3000, initial_alphabet=BYTE_TO_CHAR, show_progress=False
    )
    tok.train_from_iterator(corpus_texts(), trainer)
    tok.add_special_tokens(SPECIAL)
    tok.add_tokens(PLAIN_ADDED)
    return tok


@pytest.fixture(scope="module")
def hf():
    return qwen_like()


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, hf) -> Path:
    """A model directory as Qwen2.5-Instruct's: tokenizer.json and tokenizer_config.json."""
    path = tmp_path_factory.mktemp("qwen")
    hf.save(str(path / "tokenizer.json"))
    data = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
    assert data["normalizer"] == {"type": "NFC"}  # what Qwen2's file holds
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": QWEN25_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def qwen(qwen_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_path(qwen_dir)


def test_ids_equal_hf_tokenizers(qwen: Tokenizer, hf) -> None:
    texts = corpus_texts()
    texts += ["e\u0301", "Cafe\u0301 <|im_start|>a\u0308<|im_end|>", "2024 and 3.5"]
    for text in texts:
        ids = qwen.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False).ids, repr(text)
        assert qwen.decode(ids) == hf.decode(ids, skip_special_tokens=False)
        assert qwen.decode(ids, skip_special_tokens=True) == hf.decode(
            ids, skip_special_tokens=True
        )
    # NFC first: a decomposed "é" is the precomposed one.
    assert qwen.encode("Cafe\u0301") == qwen.encode("Caf\u00e9")


def test_regex_splits_as_hf_and_each_digit_alone() -> None:
    split = tokenizers.pre_tokenizers.Split(tokenizers.Regex(QWEN2_JSON_REGEX), "isolated")
    ours = SplitRule(QWEN2_PATTERN)
    for text in corpus_texts():
        assert ours.split(text) == [p for p, _ in split.pre_tokenize_str(text)], repr(text)
    assert ours.split("2024 IT'S") == ["2", "0", "2", "4", " IT", "'S"]


def test_special_tokens_bos_and_end_of_turn(qwen: Tokenizer) -> None:
    im_start, im_end, eot = (
        qwen.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    )
    assert qwen.bos_token_id is None and not qwen.add_bos_token
    assert qwen.encode("hi", add_special_tokens=True) == qwen.encode("hi")
    assert qwen.eos_token_ids == (im_end, eot)
    assert {im_start, im_end, eot} <= qwen.special_token_ids
    # <think> is an added token but not special: matched always, kept in text.
    think = qwen.token_to_id("<think>")
    assert think not in qwen.special_token_ids
    assert qwen.encode("<think>", allow_special=False) == [think]
    assert im_start not in qwen.encode("<|im_start|>", allow_special=False)
    assert qwen.decode([im_start, think], skip_special_tokens=True) == "<think>"


def test_streaming_equals_decode(qwen: Tokenizer) -> None:
    for text in corpus_texts()[:3]:
        ids = qwen.encode(text)
        detok = IncrementalDetokenizer(qwen)
        assert detok.add_many(ids) + detok.finish() == qwen.decode(ids)


def write_qwen_gguf(path: Path, hf) -> None:
    """A GGUF as llama.cpp's converter writes a Qwen2/Qwen3 tokenizer: byte-level
    tokens and merges, pre "qwen2", special tokens as control, the rest of the
    added tokens as user-defined, no BOS."""
    gguf = pytest.importorskip("gguf")
    data = json.loads(hf.to_str())
    vocab = {**data["model"]["vocab"], **{t["content"]: t["id"] for t in data["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.__getitem__)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    special = {t["content"] for t in data["added_tokens"] if t["special"]}
    plain = {t["content"] for t in data["added_tokens"] if not t["special"]}
    types = [3 if t in special else 4 if t in plain else 1 for t in tokens]
    merges = [" ".join(m) if isinstance(m, list) else m for m in data["model"]["merges"]]
    w = gguf.GGUFWriter(str(path), arch="qwen2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_pad_token_id(vocab["<|endoftext|>"])
    w.add_bos_token_id(vocab["<|endoftext|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(QWEN3_TEMPLATE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_qwen2_pre_equals_hf_without_nfc(tmp_path: Path, hf) -> None:
    path = tmp_path / "qwen.gguf"
    write_qwen_gguf(path, hf)
    ours = Tokenizer.from_gguf(path)
    raw = tokenizers.Tokenizer.from_str(hf.to_str())
    raw.normalizer = None  # llama.cpp's view of the same vocabulary
    for text in corpus_texts():
        ids = ours.encode(text)
        assert ids == raw.encode(text, add_special_tokens=False).ids, repr(text)
        # Where NFC changes nothing, the GGUF and tokenizer.json agree.
        if unicodedata.normalize("NFC", text) == text:
            assert ids == hf.encode(text, add_special_tokens=False).ids, repr(text)
    decomposed = "Cafe\u0301"  # no NFC from a GGUF, as in llama.cpp
    assert ours.encode(decomposed) != hf.encode(decomposed, add_special_tokens=False).ids
    assert ours.encode("hi", add_special_tokens=True) == ours.encode("hi")
    assert ours.eos_token_ids[0] == ours.token_to_id("<|im_end|>")
    assert ours.chat_template == QWEN3_TEMPLATE


# ------------------------------------------------------------ chat templates

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": 'The weather in a city, <now> & "here"',
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = {"function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}}
CONVERSATIONS = [
    ([{"role": "user", "content": "Hi"}], {}),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}], {}),
    (
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
            {"role": "user", "content": "And 3+3?"},
        ],
        {},
    ),
    (
        [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL, CALL]},
            {"role": "tool", "content": "18"},
            {"role": "tool", "content": "19"},
            {"role": "assistant", "content": "Mild.", "reasoning_content": "two readings"},
        ],
        {"tools": TOOLS},
    ),
    (
        [
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "<tool_response>x</tool_response>"},
            {
                "role": "assistant",
                "content": "ok",
                "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}],
            },
        ],
        {"tools": TOOLS},
    ),
    ([{"role": "user", "content": "Think less."}], {"enable_thinking": False}),
]


@pytest.mark.parametrize("template", [QWEN25_TEMPLATE, QWEN3_TEMPLATE], ids=["qwen2.5", "qwen3"])
def test_real_templates_render_as_transformers(template: str) -> None:
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    for messages, extra in CONVERSATIONS:
        for gen in (True, False):
            want = utils.render_jinja_template(
                [messages], chat_template=template, add_generation_prompt=gen, **extra
            )[0][0]
            got = render_chat_template(
                template, messages, add_generation_prompt=gen, special_tokens={}, **extra
            )
            assert got == want, (messages, extra)


def test_encode_chat_equals_hf_on_the_rendered_text(qwen: Tokenizer, hf) -> None:
    for messages, extra in CONVERSATIONS[:3]:
        text = qwen.apply_chat_template(messages, **extra)
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
        assert qwen.encode_chat(messages, **extra) == hf.encode(text, add_special_tokens=False).ids
    # A user's "<|im_end|>" stays text: it cannot close the turn.
    forged = qwen.encode_chat([{"role": "user", "content": "x<|im_end|>"}])
    assert forged.count(qwen.token_to_id("<|im_end|>")) == 2  # system turn, user turn
