"""Build a tiny Qwen2 model whose greedy output is fixed, so a real vLLM can serve it offline.

No model hub is reachable here, so the integration suite makes its own model: a byte-level BPE
tokenizer trained on the text below, a Qwen3-style chat template (`<think>`, hermes `<tool_call>`,
tools), and a 2-layer Qwen2 whose weights are set by hand rather than trained.

How the weights force the output. Both layers' MLPs and layer 1's attention write nothing, so the
residual stream is the token's embedding plus what layer 0's attention adds, and the logits are
`lm_head(norm(embedding))`: a lookup table from the current token to the next one. Each token
belongs to a "class" (one hidden dimension) and `lm_head` maps each class to its successor, so
greedy decoding walks a fixed chain from whatever token ends the prompt:

    (any other token) -> <think> Okay, the user says hi. </think> "\\n\\n" -> BRANCH
    BRANCH, no tools  -> Hello! How can I help you today? <|im_end|>
    BRANCH, tools     -> <tool_call> {"name": "get_weather", "arguments": {"city": "Paris"}} </tool_call> <|im_end|>

The branch needs to know whether the template put `<|tool_mode|>` into the prompt (it does so when
tools are given and the last message is the user's, system notes after it aside, as Claude Code
appends one) and no tool result came yet: the model calls the tool once a conversation, then
answers in text. Layer 0's attention finds out: every query is the same constant vector and only
`<|tool_mode|>` and `<tool_response>` have a key (in the slowest-rotating RoPE pair, so position
does not matter), so every position attends to them, evenly, when they are there. `<|tool_mode|>`'s
value writes +1 to a flag dimension that tips the branch token towards `<tool_call>`,
`<tool_response>`'s writes -3, so one tool result outweighs every flag. Without either, attention
spreads over zero values and the flag stays 0. Logit margins are large (>= 15 nats), so even
sampling at temperature 1 follows the chain.

The template renders history as the model generated it, as a well-behaved template does: an
assistant turn is preceded by the `<|tool_mode|>` its generation prompt had, its content is written
without the newlines the reasoning parser leaves after `</think>`, and the chain's pieces are whole
tokens of the tokenizer. So each prompt of a conversation begins with the previous prompt and the
ids generated for it (`verify` checks it), and a captured rollout rebuilds into one sequence.
The context is 65,536 tokens, because agent harnesses send system prompts of tens of thousands of
tokens (and Claude Code asks for `max_tokens: 32000`); the flag's attention score (about 50) keeps
the flag whole at that length.

Usage: python make_model.py DIR   (builds DIR, then checks the chains with transformers)
       python make_model.py --check DIR   (exit 0 when DIR was built by this exact script)
"""

from __future__ import annotations

import hashlib
import itertools
import json
import shutil
import sys
from pathlib import Path

RECIPE = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
STAMP = "gymproxy-recipe.txt"

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|tool_mode|>"]
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
REASONING = ["Okay,", " the user", " says hi."]
BRANCH = "\n\n"
ANSWER = ["Hello", "! How can I", " help you today?"]
CALL = ['\n{"name": "get_weather", ', '"arguments": {"city": ', '"Paris"}}\n']

# What the model says (useful to tests): the reasoning, the text answer, the tool call.
REASONING_TEXT = "".join(REASONING)
ANSWER_TEXT = "".join(ANSWER)
TOOL_NAME, TOOL_ARGUMENTS = "get_weather", {"city": "Paris"}
MAX_POSITIONS = 65_536

CHAT_TEMPLATE = r"""
{%- set turn = namespace(last='') %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments ' }}
    {{- 'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, ' }}
    {{- '"arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'user' or message.role == 'system' %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- if tools and turn.last == 'user' %}{{- '<|tool_mode|>' }}{%- endif %}
        {{- '<|im_start|>assistant\n' }}
        {%- set reasoning = message.reasoning_content or message.reasoning %}
        {%- if reasoning %}{{- '<think>' + reasoning + '</think>\n\n' }}{%- endif %}
        {%- if message.content %}{{- message.content.lstrip('\n') }}{%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- set fn = tool_call.function if tool_call.function else tool_call %}
            {{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' }}
            {%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
    {%- endif %}
    {%- if message.role != 'system' %}{%- set turn.last = message.role %}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {%- if tools and turn.last == 'user' %}{{- '<|tool_mode|>' }}{%- endif %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
""".strip()

# Local training text for the tokenizer: chat-shaped English, JSON schemas and the template's
# fixed text, so that prompts (tool schemas included) stay short.
CORPUS = """
You are a helpful assistant. Answer the question briefly and accurately.
What is the weather like in Paris today? What is 2 + 2? Please tell me a short story about a cat.
Hello! How are you? I am fine, thank you. The weather is sunny and warm, with a light breeze.
Summarise the following text in one sentence. Translate the sentence into French.
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Get the current weather for a city. The name of the city, for example Paris or London.
Return the temperature in degrees Celsius and a short description of the sky.
It is 21 degrees and sunny in Paris. Tokyo is cloudy and 18 degrees. London is rainy.
# Tools
You may call one or more functions to assist with the user query.
You are provided with function signatures within <tools></tools> XML tags:
For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather for a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name."}}, "required": ["city"]}}}
{"type": "function", "name": "get_weather", "description": "Get the current weather for a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": false}, "strict": true}
{"name": "get_weather", "arguments": {"city": "Paris"}}
{"temperature": 21, "unit": "celsius", "sky": "sunny"}
system user assistant tool function parameters properties required description string object number
The user wants to know something. Let me think about it step by step before answering.
First, consider the question. Then check the facts. Finally, write a clear and friendly answer.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 20 21 42 100 256 512 1000 2024 2025 2026.
"""

HIDDEN, HEADS, KV_HEADS, LAYERS = 64, 2, 1, 2  # head_dim 32: the smallest vLLM's CPU attention takes
HEAD_DIM = HIDDEN // HEADS
# Embedding features of <tool_response> and <|tool_mode|>; attention's flag.
RESPONSE_FEATURE, TOOL_FEATURE, FLAG = HIDDEN - 3, HIDDEN - 2, HIDDEN - 1
RESPONSE_VALUE = -3.0  # a tool result's weight on the flag, against +1 for each <|tool_mode|>
SLOW = HEAD_DIM // 2 - 1  # the head dimension whose RoPE pair rotates slowest
A, D, G = 10.0, 2.0, 10.0  # successor weight, branch handicap of <tool_call>, flag weight
FLAG_VALUE = 0.5

QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def build_tokenizer():
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([line for line in CORPUS.splitlines() if line] * 4, trainer)
    pieces = TAGS + REASONING + [BRANCH] + ANSWER + CALL
    tok.add_tokens([AddedToken(p, normalized=False, special=False, single_word=False) for p in pieces])
    return tok


def successors(tok) -> tuple[dict[int, int], int, int, int]:
    """token id -> next token id for the chain tokens; plus the default successor, branch and tool-call ids."""
    ids = {piece: tok.token_to_id(piece) for piece in SPECIAL + TAGS + REASONING + [BRANCH] + ANSWER + CALL}
    missing = [p for p, i in ids.items() if i is None]
    assert not missing, f"pieces not single tokens: {missing}"
    chain = ["<think>", *REASONING, "</think>", BRANCH, *ANSWER, "<|im_end|>"]
    nxt = {ids[a]: ids[b] for a, b in itertools.pairwise(chain)}
    tool_chain = ["<tool_call>", *CALL, "</tool_call>", "<|im_end|>"]
    nxt.update({ids[a]: ids[b] for a, b in itertools.pairwise(tool_chain)})
    nxt[ids["<|im_end|>"]] = ids["<|endoftext|>"]
    nxt[ids["<|endoftext|>"]] = ids["<|endoftext|>"]
    return nxt, ids["<think>"], ids[BRANCH], ids["<tool_call>"]


def build_weights(tok, vocab_size: int):
    import torch

    nxt, default, branch, tool_call = successors(tok)
    # Classes: one per distinct successor; class 0 is "everything else" (successor: <think>).
    targets = [default] + sorted({t for t in nxt.values()} - {default})
    assert len(targets) < RESPONSE_FEATURE, "too many classes for the hidden size"
    cls = {t: i for i, t in enumerate(targets)}
    token_class = [cls[nxt.get(i, default)] for i in range(vocab_size)]
    # The branch token gets its own class (its plain successor "Hello" may be shared otherwise).
    branch_class = len(targets)
    token_class[branch] = branch_class

    sd: dict[str, torch.Tensor] = {}
    embed = torch.zeros(vocab_size, HIDDEN)
    embed[torch.arange(vocab_size), torch.tensor(token_class)] = 1.0
    embed[tok.token_to_id("<|tool_mode|>"), TOOL_FEATURE] = 1.0
    embed[tok.token_to_id("<tool_response>"), RESPONSE_FEATURE] = 1.0
    sd["model.embed_tokens.weight"] = embed
    head = torch.zeros(vocab_size, HIDDEN)
    for target, c in cls.items():
        head[target, c] = A
    head[nxt[branch], branch_class] = A
    head[tool_call, branch_class] = A - D
    head[tool_call, FLAG] = G
    sd["lm_head.weight"] = head
    sd["model.norm.weight"] = torch.ones(HIDDEN)
    inter = 2 * HIDDEN
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        sd[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN)
        q_w, q_b = torch.zeros(HEADS * HEAD_DIM, HIDDEN), torch.zeros(HEADS * HEAD_DIM)
        k_w, k_b = torch.zeros(KV_HEADS * HEAD_DIM, HIDDEN), torch.zeros(KV_HEADS * HEAD_DIM)
        v_w, v_b = torch.zeros(KV_HEADS * HEAD_DIM, HIDDEN), torch.zeros(KV_HEADS * HEAD_DIM)
        o_w = torch.zeros(HIDDEN, HEADS * HEAD_DIM)
        if layer == 0:
            # Head 0 (kv head 0): constant query, keys only on <|tool_mode|> and <tool_response>,
            # values -> flag.
            q_b[SLOW] = 10.0
            k_w[SLOW, TOOL_FEATURE] = 5.0
            k_w[SLOW, RESPONSE_FEATURE] = 5.0
            v_w[0, TOOL_FEATURE] = 1.0
            v_w[0, RESPONSE_FEATURE] = RESPONSE_VALUE
            # norm(<|tool_mode|>) has sqrt(HIDDEN / 2) on TOOL_FEATURE; scale it to FLAG_VALUE.
            o_w[FLAG, 0] = FLAG_VALUE / (HIDDEN / 2) ** 0.5
        sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.q_proj.bias"] = q_w, q_b
        sd[p + "self_attn.k_proj.weight"], sd[p + "self_attn.k_proj.bias"] = k_w, k_b
        sd[p + "self_attn.v_proj.weight"], sd[p + "self_attn.v_proj.bias"] = v_w, v_b
        sd[p + "self_attn.o_proj.weight"] = o_w
        sd[p + "mlp.gate_proj.weight"] = torch.zeros(inter, HIDDEN)
        sd[p + "mlp.up_proj.weight"] = torch.zeros(inter, HIDDEN)
        sd[p + "mlp.down_proj.weight"] = torch.zeros(HIDDEN, inter)
    return sd, inter


def build(out: Path) -> None:
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    raw = build_tokenizer()
    vocab_size = (raw.get_vocab_size() + 63) // 64 * 64
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(tmp)
    # Loadable by transformers 4 and 5 alike: a class both know, the template inside the config.
    config_path = tmp / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE)
    config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (tmp / "chat_template.jinja").unlink(missing_ok=True)

    im_end, eot = raw.token_to_id("<|im_end|>"), raw.token_to_id("<|endoftext|>")
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        rope_theta=1000000.0,  # transformers < 5 reads this key
        tie_word_embeddings=False,
        bos_token_id=eot,
        eos_token_id=im_end,
        pad_token_id=eot,
        torch_dtype="float32",
    )
    sd, _ = build_weights(raw, vocab_size)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if "rotary" not in k]
    assert not missing and not unexpected, (missing, unexpected)
    model.generation_config.eos_token_id = [im_end, eot]
    model.generation_config.pad_token_id = eot
    model.generation_config.do_sample = False
    model.save_pretrained(tmp)
    verify(tmp)
    (tmp / STAMP).write_text(RECIPE + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def verify(path: Path) -> None:
    """Greedy-decode each case with transformers and check the chains."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    user = [{"role": "user", "content": "What is the weather in Paris?"}]
    # What a client sends back of each reply (vLLM's qwen3 parser leaves "\n\n" in the content).
    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    calling = {"role": "assistant", "reasoning_content": REASONING_TEXT, "content": BRANCH, "tool_calls": [call]}
    answering = {"role": "assistant", "reasoning_content": REASONING_TEXT, "content": BRANCH + ANSWER_TEXT}
    after_tool = user + [calling, {"role": "tool", "content": "sunny"}]
    # Claude Code appends a system note after the user's message; a harness's long system prompt.
    noted = user + [{"role": "system", "content": "The working directory is /work."}]
    long = [{"role": "system", "content": "You are a helpful assistant. " * 700}, *user]
    again = after_tool + [answering, {"role": "user", "content": "Thanks!"}]
    plain = f"<think>{REASONING_TEXT}</think>{BRANCH}{ANSWER_TEXT}"
    called = f"<think>{REASONING_TEXT}</think>{BRANCH}<tool_call>{''.join(CALL)}</tool_call>"
    cases = [(user, None, plain), (user, [tool], called), (after_tool, [tool], plain)]
    cases += [(noted, [tool], called), (after_tool + noted[1:], [tool], plain), (long, [tool], called)]
    cases += [(again, [tool], plain)]  # one tool call a conversation
    for messages, tools, want in cases:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        out = model.generate(ids, max_new_tokens=30, do_sample=False)
        got = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        assert got == want, f"tools={bool(tools)} turns={len(messages)}: got {got!r}, want {want!r}"
        # The next prompt begins with this one and what was generated: the history round-trips.
        reply = calling if want == called else answering
        history = tokenizer.apply_chat_template([*messages, reply], tools=tools, tokenize=False)
        following = tokenizer(history, add_special_tokens=False).input_ids
        sequence = out[0].tolist()
        assert following[: len(sequence)] == sequence, f"tools={bool(tools)} turns={len(messages)}: no round trip"
        with torch.no_grad():
            logits = model(out).logits[0, ids.shape[1] - 1 : -1]
        top2 = logits.topk(2).values
        margin = float((top2[:, 0] - top2[:, 1]).min())
        assert margin > 15, f"logit margin {margin:.1f} is too small"
        print(f"ok: {len(ids[0])} prompt tokens, margin {margin:.1f}: {got!r}")


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--check":
        stamp = Path(argv[1]) / STAMP
        return 0 if stamp.is_file() and stamp.read_text().strip() == RECIPE else 1
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    build(Path(argv[0]))
    print(json.dumps({"model": argv[0], "recipe": RECIPE}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
