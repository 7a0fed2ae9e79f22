"""A real byte-level BPE tokenizer for the demo and test models, trained offline and deterministically.

The training corpus is generated here from fixed sentence lists (English, Chinese, emoji, code,
numbers) with a fixed seed, so every machine trains the same merges and writes the same
``tokenizer.json`` bytes. Special tokens and the chat template follow Llama 3.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
EOT = "<|eot_id|>"
SPECIAL_TOKENS = (BOS, EOS, "<|start_header_id|>", "<|end_header_id|>", EOT)  # ids 0..4

# Llama 3 style; messages must carry string content (the caller flattens content parts).
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['content'] is not string %}"
    "{{- raise_exception('message content must be a string') }}"
    "{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

_ENGLISH = """\
The jade rabbit lives on the moon and pounds the herbs of immortality in a stone mortar.
On the night of the mid-autumn festival families share mooncakes and look up at the full moon.
A serving system splits the prompt into blocks of sixteen tokens and names each block by a hash.
Prefill is compute bound: the whole prompt passes through the model at once.
Decode is memory bound: every step reads the whole cache to produce a single token.
Trading more storage for less computation is the whole bet of a KV cache centric design.
The scheduler places each request where the time to first token is predicted to be shortest.
When the cluster is overloaded the conductor rejects requests early instead of missing deadlines.
Hello, world! How are you today? I am fine, thank you. What would you like to know?
Please summarize the following article in three sentences.
Once upon a time there was a little rabbit who wanted to visit the moon.
She built a ladder of clouds, climbed it at night, and met an old rabbit grinding medicine.
The quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire.
Water boils at one hundred degrees Celsius at sea level and freezes at zero.
The capital of France is Paris; the capital of Japan is Tokyo; the capital of China is Beijing.
Machine learning models learn patterns from data and use them to make predictions.
A transformer layer applies attention, then a feed forward network, each with a residual path.
Rotary position embeddings rotate queries and keys by an angle that grows with the position.
Grouped query attention shares each key and value head among several query heads.
Thank you for your question. Here is a short answer followed by a longer explanation.
The system prompt tells the assistant to be helpful, honest and concise.
User: What is the weather like tomorrow? Assistant: I cannot see the future, but I can guess.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday make one week.
January, February, March, April, May, June, July, August, September, October, November, December.
Red, orange, yellow, green, blue, indigo and violet are the colours of the rainbow.
Mathematics: two plus two equals four, and the square root of nine is three.
Caf\u00e9, na\u00efve, r\u00e9sum\u00e9, fa\u00e7ade, \u00fcber, stra\u00dfe, \u00e5ngstr\u00f6m, se\u00f1or and pi\u00f1ata borrow letters.
"""

_CHINESE = """\
月亮上住着一只玉兔，它每天都在捣药。
中秋节的晚上，一家人团聚在一起吃月饼、赏月亮。
嫦娥奔月的故事在中国流传了几千年。
今天天气很好，我们一起去公园散步吧。
你好，世界！很高兴认识你。请问有什么可以帮你的？
大型语言模型把提示词切分成词元，然后逐个生成新的词元。
预填充阶段计算密集，解码阶段受内存带宽限制。
把键值缓存存起来，下次遇到相同的前缀就不必重新计算。
春眠不觉晓，处处闻啼鸟。夜来风雨声，花落知多少。
床前明月光，疑是地上霜。举头望明月，低头思故乡。
学而时习之，不亦说乎？有朋自远方来，不亦乐乎？
北京、上海、广州和深圳都是中国的大城市。
一二三四五六七八九十，百千万亿。
"""

_EMOJI = "🐇 🌕 🥮 🌙 ✨ 🚀 😀 😂 🤖 🍵 ❤️ 👍 🎉 🔥 🌸 🐉 🏮 🧧 📦 ⚡"

_CODE = """\
def add(a: int, b: int) -> int:
    return a + b

for i in range(10):
    print(f"step {i}: loss={loss:.4f}")

import torch
x = torch.randn(4, 16, 64)  # (batch, tokens, hidden)
{"role": "user", "content": "Tell me a story about the moon."}
<html><body><p>Hello</p></body></html>
SELECT id, name FROM users WHERE age > 18 ORDER BY name;
"""


@dataclass(frozen=True)
class TokenizerFiles:
    """The two files a tokenizer consists of, ready to write into a model directory."""

    tokenizer_json: str  # contents of tokenizer.json
    tokenizer_config: dict[str, Any]  # contents of tokenizer_config.json

    @property
    def special_token_ids(self) -> dict[str, int]:
        return {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}


def demo_corpus(seed: int = 0, num_documents: int = 4000) -> list[str]:
    """The fixed training corpus: the sentence lists above, once each, then seeded recombinations.

    Recombining words and characters (rather than repeating sentences) keeps merges at the level of
    words and character pairs, so Chinese text still splits into several tokens.
    """
    rng = random.Random(seed)
    english = _ENGLISH.splitlines()
    chinese = _CHINESE.splitlines()
    emoji = _EMOJI.split()
    code_lines = [line for line in _CODE.splitlines() if line]
    words = sorted({w.strip(".,!?;:") for line in english for w in line.split()} - {""})
    hanzi = sorted({c for line in chinese for c in line if "\u4e00" <= c <= "\u9fff"})
    punct = ["，", "。", "！", "？", "、"]
    docs: list[str] = english + chinese + [_CODE, _EMOJI]
    for _ in range(num_documents):
        kind = rng.randrange(6)
        if kind <= 1:
            text = " ".join(rng.choice(words) for _ in range(rng.randrange(6, 16)))
            docs.append(text[0].upper() + text[1:] + rng.choice([".", "!", "?", ","]))
        elif kind == 2:
            docs.append("".join(rng.choice(hanzi) for _ in range(rng.randrange(4, 12))) + rng.choice(punct))
        elif kind == 3:
            docs.append(" ".join(rng.choice(emoji) for _ in range(3)) + " " + rng.choice(words))
        elif kind == 4:
            a, b = rng.randrange(1000), rng.randrange(1000)
            docs.append(
                f"{a} + {b} = {a + b}; in {1900 + rng.randrange(200)} it was {rng.randrange(40)}.{rng.randrange(10)}"
            )
        else:
            docs.append("\n".join(rng.sample(code_lines, 3)))
    return docs


def train_demo_tokenizer(vocab_size: int = 4096, seed: int = 0) -> TokenizerFiles:
    """Train the byte-level BPE on demo_corpus(seed); vocab_size counts special tokens and bytes.

    The result may hold fewer than ``vocab_size`` ids if the corpus runs out of frequent pairs;
    read the real size from the tokenizer.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(demo_corpus(seed), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, 0)]
    )
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOT,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    return TokenizerFiles(tokenizer_json=tok.to_str(pretty=True), tokenizer_config=config)
