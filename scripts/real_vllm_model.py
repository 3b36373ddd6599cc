"""Builds the tiny model the real-vLLM tests serve: a byte-level BPE tokenizer trained on
generated text and a 2-layer Llama with random weights, both from fixed seeds, so the same
files come out every time (no downloads).

Usage: python real_vllm_model.py OUT_DIR
"""

import random
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SEED = 20261201
VOCAB_SIZE = 2048
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
# A ChatML-like template; vLLM renders it with Jinja2, kvroute with minijinja. Without tools, tool
# calls, reasoning or template arguments it renders each message as `<|role|>\ncontent</s>\n`.
# With them it renders the way tool-calling templates do: the tools as indented JSON schemas
# before the messages, each assistant tool call as JSON with its arguments, the reasoning before
# the answer, and an empty think block when the request turns thinking off (`enable_thinking`).
# It loops over a message's content when that is a list, so vLLM gives it every message's content
# as parts (its "openai" content format). The model has a second, `tool_use` template, which
# transformers picks for requests with tools; it differs only in the tools block's header.
def chat_template(tools_header):
    return (
        "{{ bos_token }}"
        "{% if tools %}<|" + tools_header + "|>\n"
        "{% for tool in tools %}{{ tool | tojson(indent=2) }}\n{% endfor %}"
        "{{ eos_token }}\n{% endif %}"
        "{% for message in messages %}"
        "<|{{ message['role'] }}|>\n"
        "{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif %}"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
        "{% if message.tool_calls %}{% for call in message.tool_calls %}"
        "<tool_call>{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}"
        "</tool_call>{% endfor %}{% endif %}"
        "{{ eos_token }}\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n"
        "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
        "{% endif %}"
    )


CHAT_TEMPLATES = {"default": chat_template("tools"), "tool_use": chat_template("tool_use")}
WORDS = (
    "the a an of to in and or for with on at by from as is are was be this that it cache "
    "prefix block token tokens router engine request requests route routing model prompt "
    "system user assistant question answer turn conversation history shared document "
    "vLLM kvroute KV GPU CPU memory latency throughput batch queue load hit miss key value "
    "hash event events replay metric metrics time first second number how what why when "
    "where which who does do can will would should please explain summarize describe "
    "careful helpful brief full sentences about work works working prefill decode store "
    "stored removed evicted server servers fleet pod pods session sessions reuse reused"
).split()


def corpus(rng):
    """Sentences of the words above, with punctuation, digits and roles, for BPE training."""
    for _ in range(20000):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 25))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 10000)))
        sentence = " ".join(words)
        yield sentence[0].upper() + sentence[1:] + rng.choice([".", "?", "!", ":", ","])
    for role in ("system", "user", "assistant"):
        yield f"<|{role}|>\n"


def build_tokenizer(out_dir, rng):
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(rng), trainer=trainer)
    # Completions get a BOS from the tokenizer (add_special_tokens), chats from the template.
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATES
    fast.save_pretrained(out_dir)
    return fast


def build_model(out_dir, tokenizer):
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,  # head size 32: the CPU attention backend needs >= 32
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir)


def main():
    out_dir = sys.argv[1]
    rng = random.Random(SEED)
    tokenizer = build_tokenizer(out_dir, rng)
    build_model(out_dir, tokenizer)


if __name__ == "__main__":
    main()
