"""A byte-level tokenizer for small diffusion models: token id = byte value (0..255), then
``<|endoftext|>`` (256) and the mask ``<|mdm_mask|>`` (257). 258 ids keep the embedding and LM
head of a few-million-parameter model small (the default model's 49k vocabulary would be most of
its weights). Saved as an ordinary HF fast tokenizer, so ``Tokenizer.from_pretrained`` reads it."""
from __future__ import annotations

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mdm_mask|>"
EOS_ID, MASK_ID, VOCAB_SIZE = 256, 257, 258


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte value (what the ByteLevel pre-tokenizer emits)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def save_byte_tokenizer(directory: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {c: i for i, c in enumerate(_byte_chars())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN,
                                   mask_token=MASK_TOKEN)
    fast.add_special_tokens({"eos_token": EOS_TOKEN, "mask_token": MASK_TOKEN})
    if fast.convert_tokens_to_ids([EOS_TOKEN, MASK_TOKEN]) != [EOS_ID, MASK_ID]:
        raise RuntimeError("byte tokenizer special ids moved")
    fast.save_pretrained(directory)
