"""Chat templates: rendered as transformers' apply_chat_template renders them, read from a GGUF
(and from a Hugging Face folder), encoded without a second BOS, and refused in one line where a
model has none or the messages are not {"role", "content"} strings."""

import json

import pytest
import tiny_gguf
from tokenizers import Tokenizer as HFTokenizer

import models
from models import registry
from models.tokenizer import (
    Tokenizer,
    gguf_chat_template,
    read_chat_template,
    render_chat_template,
    validate_messages,
)

# tokenizer.chat_template of the registry's qwen2.5-coder-1.5b GGUF (Qwen2.5-Coder-1.5B-Instruct's own
# template; test_the_registry_ggufs_carry_these_templates checks it where that file is cached).
QWEN25_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    "            {{- tool_call.name }}\n"
    '            {{- \'", "arguments": \' }}\n'
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# tokenizer.chat_template of the registry's smollm2-135m GGUF (SmolLM2-135M-Instruct's).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n"
    "' + message['content'] + '<|im_end|>' + '\n"
    "'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n"
    "' }}{% endif %}"
)

# transformers' own output (5.24.0, recorded once in /work/main/.venv-ref, not imported here):
#   tok = PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(tokenizers.models.BPE()),
#                                 bos_token=BOS, eos_token="<|im_end|>")  # TEMPLATES' tokens
#   tok.chat_template = TEMPLATE
#   tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=...)  # CONVERSATIONS
# test_rendering_and_encoding_equal_transformers_live compares again wherever transformers is installed.
EXPECTED = {
    "qwen/user": (
        "<|im_start|>system\n"
        "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n"
        "Write a Python function that reverses a string.<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
    "qwen/system_turns": (
        "<|im_start|>system\n"
        "You answer in one line.<|im_end|>\n"
        "<|im_start|>user\n"
        "2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n"
        "4<|im_end|>\n"
        "<|im_start|>user\n"
        "And 3 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
    "qwen/no_generation_prompt": (
        "<|im_start|>system\n"
        "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n"
        "hi <b>&</b><|im_end|>\n"
        "<|im_start|>assistant\n"
        "hello<|im_end|>\n"
    ),
    "smollm2/user": (
        "<|im_start|>system\n"
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\n"
        "Write a Python function that reverses a string.<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
    "smollm2/system_turns": (
        "<|im_start|>system\n"
        "You answer in one line.<|im_end|>\n"
        "<|im_start|>user\n"
        "2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n"
        "4<|im_end|>\n"
        "<|im_start|>user\n"
        "And 3 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
    "smollm2/no_generation_prompt": (
        "<|im_start|>system\n"
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\n"
        "hi <b>&</b><|im_end|>\n"
        "<|im_start|>assistant\n"
        "hello<|im_end|>\n"
    ),
}

CONVERSATIONS = {
    "user": ([{"role": "user", "content": "Write a Python function that reverses a string."}], True),
    "system_turns": (
        [
            {"role": "system", "content": "You answer in one line."},
            {"role": "user", "content": "2 + 2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3 + 3?"},
        ],
        True,
    ),
    "no_generation_prompt": (
        [{"role": "user", "content": "hi <b>&</b>"}, {"role": "assistant", "content": "hello"}],
        False,
    ),
}
TEMPLATES = {
    "qwen": (QWEN25_TEMPLATE, None, "<|im_end|>"),
    "smollm2": (SMOLLM2_TEMPLATE, "<|im_start|>", "<|im_end|>"),
}

# A template using what the two real ones do not: trim_blocks / lstrip_blocks, {%- -%}, tojson on
# HTML characters, bos_token / eos_token, namespace, loop controls, a {% generation %} block,
# strftime_now and an undefined variable (transformers passes tools=None, documents=None).
FEATURES_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(n=0) %}
{% for m in messages %}
    {% if m.role == "system" %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
  [{{ ns.n }}] {{ m | tojson }}
{% if m.role == "assistant" %}{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}{% endif %}
{% endfor %}
{%- if tools is none and documents is none %}no tools {% endif -%}
{{ strftime_now("%Y") | length }} {{ undefined_thing }}|
{% if add_generation_prompt %}<|assistant|>{% endif %}"""


def _expected(template: str, conversation: str) -> str:
    return EXPECTED[f"{template}/{conversation}"]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("template", TEMPLATES)
def test_rendering_equals_transformers_recorded_output(template, conversation):
    text, bos, eos = TEMPLATES[template]
    messages, generation_prompt = CONVERSATIONS[conversation]
    rendered = render_chat_template(
        text, messages, add_generation_prompt=generation_prompt, bos_token=bos, eos_token=eos
    )
    assert rendered == _expected(template, conversation)


def _transformers_tokenizer(backend, template: str, bos: str | None, eos: str | None):
    """transformers' tokenizer on a copy of `backend` (it adds special tokens it lacks to it)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed here")
    copy = HFTokenizer.from_str(backend.to_str())
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=copy, bos_token=bos, eos_token=eos)
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    """The tiny GGUF's tokenizer with FEATURES_TEMPLATE and add_bos_token (BOS <|endoftext|>,
    EOS too, a control token of its vocabulary)."""
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    tiny_gguf.write(path, chat_template=FEATURES_TEMPLATE, add_bos=True)
    return Tokenizer.from_gguf(path)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("template", TEMPLATES)
def test_rendering_equals_transformers_live(template, conversation, tiny_tokenizer):
    """The recorded strings are what transformers renders, where it is installed."""
    text, bos, eos = TEMPLATES[template]
    theirs = _transformers_tokenizer(tiny_tokenizer.backend, text, bos, eos)
    messages, generation_prompt = CONVERSATIONS[conversation]
    rendered = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    assert rendered == _expected(template, conversation)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_features_render_and_encode_as_transformers_does(conversation, tiny_tokenizer):
    """FEATURES_TEMPLATE through transformers where it is installed: the same text
    (tokenize=False) and the same ids (tokenize=True, which encodes with
    add_special_tokens=False: one BOS, the template's, though the tokenizer adds BOS to text)."""
    theirs = _transformers_tokenizer(
        tiny_tokenizer.backend, FEATURES_TEMPLATE, "<|endoftext|>", "<|endoftext|>"
    )
    messages, generation_prompt = CONVERSATIONS[conversation]
    rendered = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    assert tiny_tokenizer.apply_chat_template(messages, generation_prompt) == rendered
    assert rendered.startswith("<|endoftext|>") and "no tools" in rendered
    assert "\\u003c" not in rendered  # tojson leaves <, >, & as they are (Jinja's own escapes them)
    ids = theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert tiny_tokenizer.encode_chat(messages, generation_prompt) == list(ids)


def test_the_template_text_adds_the_bos_once(tiny_tokenizer):
    """With add_bos_token set and a template that writes {{ bos_token }}, encode_chat starts
    with one BOS; encoding the rendered text as a plain prompt would give two."""
    messages = CONVERSATIONS["user"][0]
    bos = tiny_tokenizer.bos_id
    ids = tiny_tokenizer.encode_chat(messages)
    assert ids[0] == bos and ids[1] != bos and ids.count(bos) == 1
    assert tiny_tokenizer.encode(tiny_tokenizer.apply_chat_template(messages))[:2] == [bos, bos]


@pytest.mark.parametrize(
    "name, template", [("qwen2.5-coder-1.5b", QWEN25_TEMPLATE), ("smollm2-135m", SMOLLM2_TEMPLATE)]
)
def test_the_registry_ggufs_carry_these_templates(name, template):
    """The templates above are the real files' (read from the header only), where they are cached."""
    path = registry.gguf_path(name)
    if not path.is_file():
        pytest.skip(f"{name} is not in the cache ({path})")
    assert gguf_chat_template(path) == template


def test_a_gguf_template_is_kept_through_the_tokenizer_cache(tmp_path):
    """from_gguf reads tokenizer.chat_template; to_json / from_json keep it; a document written
    before the field existed reads it from the GGUF's header (or has none without the file)."""
    path = tmp_path / "tiny.gguf"
    tiny_gguf.write(path, chat_template=SMOLLM2_TEMPLATE)
    tok = Tokenizer.from_gguf(path)
    assert tok.chat_template == SMOLLM2_TEMPLATE == gguf_chat_template(path)
    assert Tokenizer.from_json(tok.to_json()).chat_template == SMOLLM2_TEMPLATE
    legacy = json.loads(tok.to_json())
    del legacy["chat_template"]
    assert Tokenizer.from_json(json.dumps(legacy), gguf=path).chat_template == SMOLLM2_TEMPLATE
    assert Tokenizer.from_json(json.dumps(legacy), gguf=tmp_path / "gone.gguf").chat_template is None
    messages = CONVERSATIONS["user"][0]
    assert tok.apply_chat_template(messages) == _expected("smollm2", "user")
    # <|im_end|> is a control token of the file: the rendered text maps it to its id
    assert tok.token_to_id("<|im_end|>") in tok.encode_chat(messages)


def test_a_model_without_a_template_is_refused_in_one_line(tmp_path):
    path = tmp_path / "plain.gguf"
    tiny_gguf.write(path)
    tok = Tokenizer.from_gguf(path)
    assert tok.chat_template is None and gguf_chat_template(path) is None
    for tokenizer in (tok, models.ByteTokenizer()):
        with pytest.raises(ValueError, match="^the model has no chat template [^\n]*$"):
            tokenizer.encode_chat([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    "messages, where",
    [
        ([], "messages must be a non-empty list"),
        ("hello", "messages must be a non-empty list"),
        ([{"role": "user", "content": "a"}, {"role": "user"}], "messages[1] "),
        ([{"role": "user", "content": 3}], "messages[0] "),
        ([{"role": "user", "content": "a", "name": "x"}], "messages[0] "),
        ([["user", "a"]], "messages[0] "),
    ],
)
def test_bad_messages_are_refused_naming_the_entry(messages, where):
    with pytest.raises(ValueError) as e:
        validate_messages(messages)
    assert str(e.value).startswith(where) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="^messages"):
        render_chat_template(SMOLLM2_TEMPLATE, messages)


def test_a_template_that_refuses_the_conversation_or_touches_its_input_is_a_value_error():
    refuses = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with the user') }}{% endif %}ok"
    assert render_chat_template(refuses, [{"role": "user", "content": "a"}]) == "ok"
    with pytest.raises(ValueError, match="Conversation must start with the user$"):
        render_chat_template(refuses, [{"role": "system", "content": "a"}])
    with pytest.raises(ValueError, match="chat template"):  # the sandbox keeps the input as given
        render_chat_template("{{ messages.append(1) }}", [{"role": "user", "content": "a"}])
    with pytest.raises(ValueError, match="does not parse"):
        render_chat_template("{% if %}", [{"role": "user", "content": "a"}])


def test_read_chat_template_from_a_folder(tmp_path):
    """chat_template.jinja first; else tokenizer_config.json's chat_template, a string or a list
    of named templates ("default" taken); None without either."""
    assert read_chat_template(tmp_path) is None
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"bos_token": None}))
    assert read_chat_template(tmp_path) is None
    config.write_text(json.dumps({"chat_template": "from config"}))
    assert read_chat_template(tmp_path) == "from config"
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    config.write_text(json.dumps({"chat_template": named}))
    assert read_chat_template(tmp_path) == "plain"
    config.write_text(json.dumps({"chat_template": named[:1]}))
    with pytest.raises(ValueError, match="none named 'default'"):
        read_chat_template(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("from jinja\n")
    assert read_chat_template(tmp_path) == "from jinja\n"


@pytest.mark.parametrize("legacy", [False, True], ids=["new_entry", "entry_without_the_field"])
def test_models_load_of_a_gguf_carries_its_template(tmp_path, monkeypatch, legacy):
    """The conversion keeps the template with the cached tokenizer, and models.load's tokenizer
    renders with it; an entry converted before the field existed (its tokenizer.json written
    without it, as the converter then wrote it) takes it from the GGUF."""
    from models import convert

    cache = tmp_path / "cache"
    spec = tiny_gguf.install(cache, chat_template=QWEN25_TEMPLATE)
    monkeypatch.setitem(registry.MODELS, spec.name, spec)
    monkeypatch.setattr(
        convert,
        "convert_in_child",
        lambda name, cache_dir=None, progress=True, **kw: convert.convert(name, cache_dir, progress, **kw),
    )
    if legacy:
        to_json = Tokenizer.to_json

        def without_template(self):
            data = json.loads(to_json(self))
            del data["chat_template"]
            return json.dumps(data)

        monkeypatch.setattr(Tokenizer, "to_json", without_template)
    model = models.load(tiny_gguf.NAME, cache_dir=cache, progress=False)
    written = json.loads((cache / "converted" / tiny_gguf.NAME / "tokenizer.json").read_text())
    assert ("chat_template" in written) is not legacy
    assert model.tokenizer.chat_template == QWEN25_TEMPLATE
    assert model.tokenizer.apply_chat_template(CONVERSATIONS["user"][0]) == _expected("qwen", "user")


@pytest.mark.parametrize(
    "prompt, what",
    [("hello", "a text"), ([{"role": "user", "content": "hi"}], "a conversation")],
)
def test_generate_takes_token_ids_and_says_how_to_encode_text_or_messages(prompt, what):
    """spec_jax.generate keeps one prompt form, token ids; text and messages are named, with the
    tokenizer method that encodes them."""
    from spec_jax.bounds import validate

    target = models.random_model(vocab_size=64, num_layers=1, d_model=16, num_heads=2, num_kv_heads=1, seed=0)
    with pytest.raises(ValueError, match=f"^prompts\\[1\\] is {what}; .*encode_chat\\(messages\\)"):
        validate(target, [[1, 2], prompt], None, 4, 4, None)
