"""Writes ``tokenizer/``: a tiny byte-level BPE tokenizer (300 ids) with a ChatML chat template,
built locally from a few sentences, so chat SFT can be tried without downloading a tokenizer.
It is shipped already made; rerun ``python examples/chat/make_tokenizer.py`` to rebuild it.
For a real run, point ``data.tokenizer`` at a model's own directory (e.g. one fetched once with
``huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct --local-dir qwen``): only local files
are read."""

from __future__ import annotations

import json
from pathlib import Path

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def main() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    here = Path(__file__).parent
    corpus = [json.loads(line)["messages"] for line in (here / "chats.jsonl").read_text().splitlines()]
    text = [m["content"] for chat in corpus for m in chat] + ["system user assistant"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                   chat_template=TEMPLATE)
    fast.save_pretrained(here / "tokenizer")


if __name__ == "__main__":
    main()
